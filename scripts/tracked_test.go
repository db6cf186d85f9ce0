package scripts

import (
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// maxTrackedBytes is the largest file git may track: the biggest source file
// is about 40 KiB, a build output several MiB.
const maxTrackedBytes = 1 << 20

// gitRoot returns the top of the work tree, or ends the test when git or a
// checkout is missing: a skip outside CI, a failure in CI (which runs in a
// clone, so a failure there means the test could not do its job).
func gitRoot(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		if ci, _ := strconv.ParseBool(os.Getenv("CI")); ci {
			t.Fatalf("git rev-parse --show-toplevel: %v (CI=true: a clone with git is expected)", err)
		}
		t.Skipf("not a git checkout, or no git: %v", err)
	}
	return strings.TrimSpace(string(out))
}

func git(t *testing.T, root string, args ...string) []byte {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("git %s: %v", strings.Join(args, " "), err)
	}
	return out
}

// TestNoBuildOutputsTracked fails when git tracks a file over 1 MiB or an
// executable binary (ELF), the marks of a build output committed by mistake.
func TestNoBuildOutputsTracked(t *testing.T) {
	root := gitRoot(t)
	for _, name := range bytes.Split(git(t, root, "ls-files", "-z"), []byte{0}) {
		if len(name) == 0 {
			continue
		}
		path := filepath.Join(root, string(name))
		fi, err := os.Lstat(path)
		if err != nil || !fi.Mode().IsRegular() {
			continue // deleted in the work tree but not yet in the index, or a symlink
		}
		if fi.Size() > maxTrackedBytes {
			t.Errorf("git tracks %s, %d bytes (over %d): a build output? git rm it and ignore it in .gitignore", name, fi.Size(), maxTrackedBytes)
		}
		if isELF(t, path) {
			t.Errorf("git tracks %s, an ELF binary: git rm it and ignore it in .gitignore", name)
		}
	}
}

func isELF(t *testing.T, path string) bool {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	magic := make([]byte, 4)
	if _, err := io.ReadFull(f, magic); err != nil {
		return false // shorter than the magic number
	}
	return bytes.Equal(magic, []byte("\x7fELF"))
}

// TestBuildOutputsIgnored: what `go build ./cmd/...` and the test and
// profiling flags drop into the checkout is ignored, and no tracked file is
// (a pattern like "limiterd" without its leading slash would ignore
// cmd/limiterd/ and internal/limiterd/ too).
func TestBuildOutputsIgnored(t *testing.T) {
	root := gitRoot(t)
	cmds, err := filepath.Glob(filepath.Join(root, "cmd", "*", "main.go"))
	if err != nil || len(cmds) == 0 {
		t.Fatalf("no commands under cmd/: %v", err)
	}
	outputs := []string{"bin/limiterd", "bin/promtool", ".stack/pids", "rules.test", "cover.out", "cpu.prof", "mem.pprof", "internal/rules/rules.test"}
	for _, c := range cmds {
		outputs = append(outputs, filepath.Base(filepath.Dir(c)))
	}
	for _, name := range outputs {
		cmd := exec.Command("git", "check-ignore", "-q", "--no-index", name)
		cmd.Dir = root
		if err := cmd.Run(); err != nil {
			t.Errorf("%s is not ignored by .gitignore (git check-ignore: %v)", name, err)
		}
	}
	if out := git(t, root, "ls-files", "--cached", "--ignored", "--exclude-standard"); len(out) > 0 {
		t.Errorf(".gitignore ignores files git tracks:\n%s", out)
	}
}
