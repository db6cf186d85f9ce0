// Package install puts the programs the comparison runs in place: the
// pinned Go tools (ghz, envoy ratelimit, Gubernator) installed into bin/
// with go install, limiterd built from the tree, and the programs that come
// from the machine, found on PATH.
package install

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Tool is a pinned Go program the comparison installs into bin/ at run
// time with go install: never vendored, committed or added to go.mod.
type Tool struct {
	// bin is the name go install gives the binary (its package's folder).
	bin     string
	pkg     string
	version string
}

// The pinned tools, in one place; docs/performance.md's `make compare` lists them.
var (
	// Ghz drives every system: one load tool, never a system's own client.
	Ghz = Tool{bin: "ghz", pkg: "github.com/bojand/ghz/cmd/ghz", version: "v0.93.0"}
	// EnvoyRatelimit is envoyproxy/ratelimit's server (main of 2026-01-22).
	EnvoyRatelimit = Tool{bin: "service_cmd", pkg: "github.com/envoyproxy/ratelimit/src/service_cmd", version: "v1.4.1-0.20260122083618-3fb702589d36"}
	// Gubernator is Gubernator v2; v2.21.0 needs a newer Go than 1.26.
	Gubernator = Tool{bin: "gubernator", pkg: "github.com/gubernator-io/gubernator/v2/cmd/gubernator", version: "v2.13.0"}
)

func (t Tool) String() string { return t.pkg + "@" + t.version }

// Version is the version t is pinned at.
func (t Tool) Version() string { return t.version }

// stamp is the file beside the binary that names the version installed.
func (t Tool) stamp(dir string) string { return filepath.Join(dir, t.bin+".version") }

// installed reports whether dir holds t's binary at t's version.
func (t Tool) installed(dir string) bool {
	got, err := os.ReadFile(t.stamp(dir))
	if err != nil {
		return false
	}
	if _, err := os.Stat(filepath.Join(dir, t.bin)); err != nil {
		return false
	}
	return strings.TrimSpace(string(got)) == t.String()
}

// Install runs `GOBIN=dir go install pkg@version` with the go command
// goBin unless dir already holds that version, saying so with logf first,
// and returns the binary's path. GOTOOLCHAIN=local: the Go on this machine
// builds it, no other toolchain is downloaded.
func (t Tool) Install(ctx context.Context, goBin, dir string, logf func(format string, args ...any)) (string, error) {
	path := filepath.Join(dir, t.bin)
	if t.installed(dir) {
		return path, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	logf("installing %s into %s", t, dir)
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

// BuildLimiterd builds ./cmd/limiterd of the tree at root into dir with the
// go command goBin, and returns the binary's path.
func BuildLimiterd(ctx context.Context, goBin, root, dir string) (string, error) {
	cmd := exec.CommandContext(ctx, goBin, "build", "-o", dir+string(filepath.Separator), "./cmd/limiterd")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/limiterd: %w\n%s", err, out)
	}
	return filepath.Join(dir, "limiterd"), nil
}

// Revision names the commit of the tree at root, +dirty when it has
// changes; "" when git cannot tell.
func Revision(ctx context.Context, root string) string {
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

// Need checks that each program is on PATH, naming what installs it.
func Need(progs ...string) error {
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
