package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// tool is a pinned Go program the comparison installs into bin/ at run
// time with go install: never vendored, committed or added to go.mod.
type tool struct {
	// bin is the name go install gives the binary (its package's folder).
	bin     string
	pkg     string
	version string
}

// The pinned tools, in one place; the README's `make compare` lists them.
var (
	// ghz drives every system: one load tool, never a system's own client.
	ghzTool = tool{bin: "ghz", pkg: "github.com/bojand/ghz/cmd/ghz", version: "v0.93.0"}
	// envoyRatelimit is envoyproxy/ratelimit's server (main of 2026-01-22).
	envoyRatelimit = tool{bin: "service_cmd", pkg: "github.com/envoyproxy/ratelimit/src/service_cmd", version: "v1.4.1-0.20260122083618-3fb702589d36"}
	// gubernator is Gubernator v2; v2.21.0 needs a newer Go than 1.26.
	gubernator = tool{bin: "gubernator", pkg: "github.com/gubernator-io/gubernator/v2/cmd/gubernator", version: "v2.13.0"}
)

func (t tool) String() string { return t.pkg + "@" + t.version }

// stamp is the file beside the binary that names the version installed.
func (t tool) stamp(dir string) string { return filepath.Join(dir, t.bin+".version") }

// installed reports whether dir holds t's binary at t's version.
func (t tool) installed(dir string) bool {
	got, err := os.ReadFile(t.stamp(dir))
	if err != nil {
		return false
	}
	if _, err := os.Stat(filepath.Join(dir, t.bin)); err != nil {
		return false
	}
	return strings.TrimSpace(string(got)) == t.String()
}

// install runs `GOBIN=dir go install pkg@version` unless dir already holds
// that version, and returns the binary's path. GOTOOLCHAIN=local: the Go
// on this machine builds it, no other toolchain is downloaded.
func (t tool) install(ctx context.Context, goBin, dir string) (string, error) {
	path := filepath.Join(dir, t.bin)
	if t.installed(dir) {
		return path, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	progress("installing %s into %s", t, dir)
	cmd := exec.CommandContext(ctx, goBin, "install", t.String())
	cmd.Env = append(os.Environ(), "GOBIN="+dir, "GOTOOLCHAIN=local")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go install %s: %w\n%s", t, err, out)
	}
	if err := os.WriteFile(t.stamp(dir), []byte(t.String()+"\n"), 0o644); err != nil {
		return "", err
	}
	return path, nil
}

// buildLimiterd builds ./cmd/limiterd of the tree at root into dir.
func buildLimiterd(ctx context.Context, goBin, root, dir string) (string, error) {
	cmd := exec.CommandContext(ctx, goBin, "build", "-o", dir+string(filepath.Separator), "./cmd/limiterd")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/limiterd: %w\n%s", err, out)
	}
	return filepath.Join(dir, "limiterd"), nil
}

// treeRevision names the commit of the tree at root, +dirty when it has
// changes; "" when git cannot tell.
func treeRevision(ctx context.Context, root string) string {
	out, err := exec.CommandContext(ctx, "git", "-C", root, "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return ""
	}
	rev := strings.TrimSpace(string(out))
	if st, err := exec.CommandContext(ctx, "git", "-C", root, "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(bytes.TrimSpace(st)) > 0 {
		rev += "+dirty"
	}
	return rev
}

// moduleRoot is the folder above dir (or dir) holding this module's go.mod
// and scripts/redis-cluster.sh.
func moduleRoot(dir string) (string, error) {
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "scripts", "redis-cluster.sh")); err == nil {
			if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
				return d, nil
			}
		}
		if filepath.Dir(d) == d {
			return "", fmt.Errorf("no module root with scripts/redis-cluster.sh above %s: %w", dir, fs.ErrNotExist)
		}
	}
}

// need checks that each program is on PATH, naming what installs it.
func need(progs ...string) error {
	var errs []error
	for _, p := range progs {
		if _, err := exec.LookPath(p); err != nil {
			errs = append(errs, fmt.Errorf("%s not on PATH (%s): %w", p, installHint[p], err))
		}
	}
	return errors.Join(errs...)
}

var installHint = map[string]string{
	"redis-server": "scripts/install-deps.sh redis",
	"redis-cli":    "scripts/install-deps.sh redis",
	"taskset":      "apt-get install util-linux",
}
