// Package testenv is what the integration test servers share: free loopback
// ports (ReservePort), server processes killed with the test binary
// (StartProcess), a throw-away certificate authority (NewCA), secret files
// (SecretFile), and InCI, which tells a missing server that fails the test
// from one that skips it.
//
// The servers themselves are started by its subpackages: redistest for
// redis-server nodes and Redis Clusters, natstest for nats-server processes
// with JetStream and NATS superclusters.
package testenv

import (
	"crypto/rand"
	"encoding/hex"
	"flag"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// InCI reports whether the environment variable CI is set to a true value.
// There a missing server fails the test instead of skipping it, so that a
// green CI run means the integration tests ran.
func InCI() bool {
	ci, err := strconv.ParseBool(os.Getenv("CI"))
	return err == nil && ci
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

// DocumentsFlags fails t for each flag of fs that the page (a path from the
// test's package directory) does not name as --flag.
func DocumentsFlags(t testing.TB, page string, fs *flag.FlagSet) {
	t.Helper()
	text, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	fs.VisitAll(func(f *flag.Flag) {
		if !strings.Contains(string(text), "--"+f.Name) {
			t.Errorf("%s does not document --%s", page, f.Name)
		}
	})
}
