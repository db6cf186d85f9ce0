package limiterd

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
)

// binaries are the programs the tests build and run as processes, in one
// folder that TestMain removes when the tests end.
var binaries struct {
	mu    sync.Mutex
	dir   string
	built map[string]error // by package
}

// builtBinary builds pkg (a path relative to this package) into name, once
// per test binary, without the race detector, and returns its path.
func builtBinary(t *testing.T, name, pkg string) string {
	t.Helper()
	binaries.mu.Lock()
	defer binaries.mu.Unlock()
	if binaries.dir == "" {
		dir, err := os.MkdirTemp("", "limiterd-test-bin")
		if err != nil {
			t.Fatal(err)
		}
		binaries.dir, binaries.built = dir, map[string]error{}
	}
	path := filepath.Join(binaries.dir, name)
	err, done := binaries.built[pkg]
	if !done {
		if out, berr := exec.Command("go", "build", "-o", path, pkg).CombinedOutput(); berr != nil {
			err = fmt.Errorf("go build %s: %w\n%s", pkg, berr, out)
		}
		binaries.built[pkg] = err
	}
	if err != nil {
		t.Fatal(err)
	}
	return path
}

// TestMain removes the binaries the tests built.
func TestMain(m *testing.M) {
	code := m.Run()
	if binaries.dir != "" {
		os.RemoveAll(binaries.dir)
	}
	os.Exit(code)
}
