package scripts

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// stubs are stand-ins for the tools install-deps.sh looks for, by the
// package apt-get would install them from.
var stubs = map[string]struct{ pkg, script string }{
	"redis-server": {"redis-server", `echo "Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc-5.3.0 bits=64 build=0"`},
	"redis-cli":    {"redis-tools", `echo "redis-cli 7.0.15"`},
	"nginx":        {"nginx", `echo "nginx version: nginx/1.22.1" >&2`},
	"gcc":          {"gcc", `echo 12.2.0`},
	// Debian names its alertmanager prometheus-alertmanager.
	"prometheus":              {"prometheus", `echo "prometheus, version 2.42.0+ds (branch: debian/sid, revision: 2.42.0+ds-5+deb12u1)"`},
	"prometheus-alertmanager": {"prometheus-alertmanager", `echo "alertmanager, version 0.25.0 (branch: debian/sid, revision: 0.25.0-1+b4)"`},
	"chromium":                {"chromium", `echo "Chromium 156.0.8078.114 built on Debian GNU/Linux 12 (bookworm)"`},
	// Debian's redis_exporter logs its version to stderr.
	"prometheus-redis-exporter": {"prometheus-redis-exporter", `echo 'time="2026-12-06T03:03:03Z" level=info msg="Redis Metrics Exporter 1.45.0-2+b4    build date: 20230409-10:15:07    sha1: debian/sid"' >&2`},
}

// TestInstallDeps runs install-deps.sh against a PATH of stubs, with an
// apt-get that records what it is asked to install and installs the stubs
// of those packages, and checks which packages each call asks for.
func TestInstallDeps(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	tests := []struct {
		name    string
		args    []string // install-deps.sh's arguments
		missing []string // tools not on PATH at the start
		want    []string // packages apt-get installs, in order; none: apt-get is not called
	}{
		{name: "everything there", args: nil, missing: nil, want: nil},
		// go test -race needs cgo, which go turns off without a C compiler.
		{name: "no C compiler", args: nil, missing: []string{"gcc"}, want: []string{"gcc", "libc6-dev"}},
		{name: "no redis", args: nil, missing: []string{"redis-server"}, want: []string{"redis-server", "redis-tools"}},
		{name: "no redis-cli nor C compiler", args: nil, missing: []string{"redis-cli", "gcc"}, want: []string{"redis-server", "redis-tools", "gcc", "libc6-dev"}},
		// make up runs only Redis, NATS and the daemons: no C compiler.
		{name: "redis only", args: []string{"redis"}, missing: []string{"redis-server", "gcc"}, want: []string{"redis-server", "redis-tools"}},
		{name: "redis only, there", args: []string{"redis"}, missing: []string{"gcc"}, want: nil},
		{name: "C compiler only", args: []string{"cc"}, missing: []string{"redis-server", "gcc"}, want: []string{"gcc", "libc6-dev"}},
		// The alerts' end-to-end test and make up MONITORING=1.
		{name: "no prometheus nor alertmanager", args: nil, missing: []string{"prometheus", "prometheus-alertmanager"}, want: []string{"prometheus", "prometheus-alertmanager"}},
		{name: "monitoring of make up", args: []string{"redis", "prometheus", "alertmanager", "redis-exporter"}, missing: []string{"prometheus-alertmanager", "gcc", "nginx"}, want: []string{"prometheus-alertmanager"}},
		// The stack's monitoring scrapes every Redis node through it.
		{name: "no redis_exporter", args: nil, missing: []string{"prometheus-redis-exporter"}, want: []string{"prometheus-redis-exporter"}},
		{name: "monitoring of make up, no redis_exporter", args: []string{"redis", "prometheus", "alertmanager", "redis-exporter"}, missing: []string{"prometheus-redis-exporter", "chromium"}, want: []string{"prometheus-redis-exporter"}},
		{name: "redis only, no redis_exporter", args: []string{"redis"}, missing: []string{"prometheus-redis-exporter"}, want: nil},
		{name: "redis only, no prometheus", args: []string{"redis"}, missing: []string{"prometheus"}, want: nil},
		// The status page's browser test.
		{name: "no chromium", args: nil, missing: []string{"chromium"}, want: []string{"chromium"}},
		{name: "chromium only", args: []string{"chromium"}, missing: []string{"chromium", "gcc"}, want: []string{"chromium"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			bin := filepath.Join(dir, "bin")
			if err := os.Mkdir(bin, 0o755); err != nil {
				t.Fatal(err)
			}
			// The real tools the script itself runs, and nothing else of the
			// machine's PATH (whose gcc or redis-server would be found).
			for _, tool := range []string{"cat", "chmod", "env", "mktemp", "rm", "sed"} {
				p, err := exec.LookPath(tool)
				if err != nil {
					t.Skipf("no %s", tool)
				}
				if err := os.Symlink(p, filepath.Join(bin, tool)); err != nil {
					t.Fatal(err)
				}
			}
			writeStub(t, bin, "go", `[ "$*" = "env CC" ] && echo gcc`)
			writeStub(t, bin, "id", `echo 0`) // root: no sudo
			store := filepath.Join(dir, "store")
			if err := os.Mkdir(store, 0o755); err != nil {
				t.Fatal(err)
			}
			var installer strings.Builder
			installer.WriteString("[ \"$1\" = install ] || exit 0\nfor p in \"$@\"; do\n\tcase $p in -*|install) continue ;; esac\n\techo \"$p\" >>" + filepath.Join(dir, "installed") + "\n")
			for tool, s := range stubs {
				writeStub(t, store, tool, s.script)
				if !slices.Contains(tt.missing, tool) {
					writeStub(t, bin, tool, s.script)
				}
				installer.WriteString("\t[ \"$p\" = " + s.pkg + " ] && cat " + filepath.Join(store, tool) + " >" + filepath.Join(bin, tool) + " && chmod +x " + filepath.Join(bin, tool) + "\n")
			}
			installer.WriteString("done\nexit 0\n")
			writeStub(t, bin, "apt-get", installer.String())

			cmd := exec.Command(bash, append([]string{"install-deps.sh"}, tt.args...)...)
			cmd.Env = []string{"PATH=" + bin, "HOME=" + dir}
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			if err := cmd.Run(); err != nil {
				t.Fatalf("install-deps.sh %v: %v\nstdout:\n%s\nstderr:\n%s", tt.args, err, &stdout, &stderr)
			}
			installed, err := os.ReadFile(filepath.Join(dir, "installed"))
			if err != nil && !os.IsNotExist(err) {
				t.Fatal(err)
			}
			if got := strings.Fields(string(installed)); !slices.Equal(got, tt.want) {
				t.Errorf("apt-get installed %q, want %q", got, tt.want)
			}
			if lines := strings.Split(strings.TrimSpace(stdout.String()), "\n"); len(lines) != 1 || lines[0] == "" {
				t.Errorf("install-deps.sh printed %d lines, want one line saying what it did:\n%s", len(lines), &stdout)
			}
			if stderr.Len() > 0 {
				t.Errorf("install-deps.sh wrote to stderr:\n%s", &stderr)
			}
		})
	}
}

func writeStub(t *testing.T, dir, name, body string) {
	t.Helper()
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	if err := os.WriteFile(filepath.Join(dir, name), []byte("#!"+bash+"\n"+body+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
}
