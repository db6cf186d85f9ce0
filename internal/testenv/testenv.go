// Package testenv starts real servers for integration tests.
//
// RedisCluster and RedisNode run redis-server processes on free loopback
// ports; NATS runs a nats-server process with JetStream, and
// NATSSupercluster a NATS supercluster of them (a cluster per region,
// gateways between the regions, each gateway link cut and healed at will).
// Everything a helper starts is stopped with t.Cleanup. When a binary is
// missing the helper skips the test and names the install command, except
// when the environment variable CI is true: there a missing server fails
// the test, so that a green CI run means the integration tests ran.
package testenv

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
)

// installHint is the command that installs the Redis binaries.
const installHint = "apt-get install -y redis-server redis-tools (or: make deps)"

// inCI reports whether the environment variable CI is set to a true value.
func inCI() bool {
	ci, err := strconv.ParseBool(os.Getenv("CI"))
	return err == nil && ci
}

// lookBinary returns the path of the executable name, or ends the test: with
// Fatalf in CI, with Skipf elsewhere.
func lookBinary(t testing.TB, name string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err == nil {
		return path
	}
	if inCI() {
		t.Fatalf("testenv: %s not found on PATH and CI=true, so this is a failure, not a skip; install it with: %s", name, installHint)
	}
	t.Skipf("testenv: %s not found on PATH; install it with: %s", name, installHint)
	return ""
}

// SecretFile writes a fresh random secret (32 hex characters) to a file of
// mode 0600 in a temporary directory and returns its path, for the flags
// that read secrets from files (--region.peer-secret-file, ...).
func SecretFile(t testing.TB) string {
	t.Helper()
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(path, []byte(hex.EncodeToString(b)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
