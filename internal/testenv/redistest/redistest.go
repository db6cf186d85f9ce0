// Package redistest runs redis-server processes for integration tests:
// NewNode and NewTLSNode a standalone node, NewCluster a Redis Cluster, all
// on free loopback ports. Everything it starts is killed with t.Cleanup.
// When redis-server or redis-cli is missing it skips the test and names
// the install command, except when the environment variable CI is true:
// there a missing binary fails the test, so that a green CI run means the
// integration tests ran.
package redistest

import (
	"os/exec"
	"testing"

	"github.com/limiterd/limiterd/internal/testenv"
)

// installHint is the command that installs the Redis binaries.
const installHint = "apt-get install -y redis-server redis-tools (or: make deps)"

// clusterBusOffset is the distance Redis puts between a node's port and its
// cluster bus port.
const clusterBusOffset = 10000

// lookBinary returns the path of the executable name, or ends the test: with
// Fatalf in CI, with Skipf elsewhere.
func lookBinary(t testing.TB, name string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err == nil {
		return path
	}
	if testenv.InCI() {
		t.Fatalf("redistest: %s not found on PATH and CI=true, so this is a failure, not a skip; install it with: %s", name, installHint)
	}
	t.Skipf("redistest: %s not found on PATH; install it with: %s", name, installHint)
	return ""
}

// reservePort returns a free loopback port for a node; for a cluster node
// its cluster bus port is free and reserved too.
func reservePort(cluster bool) (int, error) {
	if cluster {
		return testenv.ReservePortPair(clusterBusOffset)
	}
	return testenv.ReservePort()
}
