package install

import (
	"os"
	"path/filepath"
	"testing"
)

// TestToolStamp: a pinned tool counts as installed only with its binary
// and a stamp of its version.
func TestToolStamp(t *testing.T) {
	dir := t.TempDir()
	tl := Tool{bin: "x", pkg: "example.com/x", version: "v1.2.3"}
	if tl.installed(dir) {
		t.Fatal("installed in an empty folder")
	}
	if err := os.WriteFile(filepath.Join(dir, "x"), nil, 0o755); err != nil {
		t.Fatal(err)
	}
	if tl.installed(dir) {
		t.Error("installed without a stamp")
	}
	if err := os.WriteFile(tl.stamp(dir), []byte("example.com/x@v1.2.2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if tl.installed(dir) {
		t.Error("installed with the stamp of another version")
	}
	if err := os.WriteFile(tl.stamp(dir), []byte(tl.String()+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if !tl.installed(dir) {
		t.Error("not installed with its binary and stamp")
	}
}
