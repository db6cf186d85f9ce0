// Package testenv starts real servers for integration tests.
//
// RedisCluster and RedisNode run redis-server processes on free loopback
// ports; NATS runs a nats-server process with JetStream. Everything a
// helper starts is stopped with t.Cleanup. When a binary is missing the helper
// skips the test and names the install command, except when the environment
// variable CI is true: there a missing server fails the test, so that a green
// CI run means the integration tests ran.
package testenv

import (
	"os"
	"os/exec"
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
