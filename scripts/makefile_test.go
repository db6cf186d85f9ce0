package scripts

import (
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestMakeInstalls holds each make target to what it installs: the tests
// need Redis, nginx, a C compiler (for -race), Prometheus (whose package
// brings promtool), Alertmanager and redis_exporter (the alerts'
// end-to-end test); the local stack runs Redis and what it builds itself
// (NATS and the daemons), so `make up` installs Redis only (Prometheus,
// Alertmanager and redis_exporter too with MONITORING=1); so does the soak, which runs the same servers. No target
// builds promtool from its Go module (minutes on a fresh machine).
func TestMakeInstalls(t *testing.T) {
	mk, err := exec.LookPath("make")
	if err != nil {
		t.Skip("no make")
	}
	tests := []struct {
		name   string
		target string
		vars   []string // make's variables
		deps   []string // install-deps.sh's arguments
	}{
		{name: "test", target: "test", deps: []string{"redis", "nginx", "cc", "prometheus", "alertmanager", "redis-exporter", "chromium"}},
		{name: "deps", target: "deps", deps: []string{"redis", "nginx", "cc", "prometheus", "alertmanager", "redis-exporter", "chromium"}},
		{name: "up", target: "up", deps: []string{"redis"}},
		{name: "up with monitoring", target: "up", vars: []string{"MONITORING=1"}, deps: []string{"redis", "prometheus", "alertmanager", "redis-exporter"}},
		{name: "soak", target: "soak", deps: []string{"redis"}},
		// The comparison runs Redis; its peers and ghz it installs itself.
		{name: "compare", target: "compare", deps: []string{"redis"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cmd := exec.Command(mk, append([]string{"-n", "-C", "..", tt.target}, tt.vars...)...)
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("make -n %s: %v\n%s", tt.target, err, out)
			}
			var deps []string
			calls, promtool := 0, false
			for line := range strings.Lines(string(out)) {
				f := strings.Fields(line)
				if i := slices.IndexFunc(f, func(w string) bool { return filepath.Base(w) == "install-deps.sh" }); i >= 0 {
					calls++
					deps = f[i+1:]
				}
				if slices.ContainsFunc(f, func(w string) bool {
					return filepath.Base(w) == "install-promtool.sh" || strings.HasSuffix(w, "/cmd/promtool") || strings.Contains(w, "/cmd/promtool@")
				}) {
					promtool = true
				}
			}
			if calls != 1 || !slices.Equal(deps, tt.deps) {
				t.Errorf("make %s runs install-deps.sh %d times, last with %q; want once with %q\n%s", tt.target, calls, deps, tt.deps, out)
			}
			if promtool {
				t.Errorf("make %s builds promtool from its Go module (Debian's prometheus package has one)\n%s", tt.target, out)
			}
		})
	}
}

// TestMakeCompare holds `make compare` to what docs/performance.md says it runs:
// the comparison tool, 3 rounds of 5 s runs unless told otherwise, with
// COMPARE_FLAGS passed on.
func TestMakeCompare(t *testing.T) {
	mk, err := exec.LookPath("make")
	if err != nil {
		t.Skip("no make")
	}
	for _, tt := range []struct {
		name string
		args []string
		want []string
	}{
		{"default", nil, []string{"--rounds 3", "--duration 5s"}},
		{"shorter", []string{"COMPARE_ROUNDS=1", "COMPARE_DURATION=2s", "COMPARE_FLAGS=--rows 1,3"}, []string{"--rounds 1", "--duration 2s", "--rows 1,3"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			run, out := dryRunLine(t, mk, "compare", tt.args, func(line string) bool { return strings.Contains(line, " run ./internal/tools/compare") })
			for _, w := range tt.want {
				if !strings.Contains(run, w) {
					t.Errorf("make compare runs %q: no %q\n%s", run, w, out)
				}
			}
		})
	}
}

// TestMakeSoak holds `make soak` to what docs/multi-region.md says it runs: TestSoak
// alone, once, for SOAK_DURATION (3 minutes unless given), with the
// nats-server of the module, not under the race detector.
func TestMakeSoak(t *testing.T) {
	mk, err := exec.LookPath("make")
	if err != nil {
		t.Skip("no make")
	}
	for _, tt := range []struct {
		name string
		args []string
		want string
	}{
		{"default", nil, "-soak.duration=3m"},
		{"longer", []string{"SOAK_DURATION=10m"}, "-soak.duration=10m"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			run, out := dryRunLine(t, mk, "soak", tt.args, func(line string) bool {
				return strings.Contains(line, " test ") && strings.Contains(line, "./internal/soak")
			})
			for _, w := range []string{"LIMITER_NATS_SERVER=", "-run '^TestSoak$'", "-count=1", tt.want} {
				if !strings.Contains(run, w) {
					t.Errorf("make soak runs %q: no %q\n%s", run, w, out)
				}
			}
			if strings.Contains(run, "-race") {
				t.Errorf("make soak runs the race detector: %q", run)
			}
		})
	}
}

// dryRunLine runs `make -n target args...` at the module root and returns
// the last line of what it would run that matches, and the whole output.
func dryRunLine(t *testing.T, mk, target string, args []string, match func(string) bool) (line, out string) {
	t.Helper()
	b, err := exec.Command(mk, append([]string{"-n", "-C", "..", target}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("make -n %s: %v\n%s", target, err, b)
	}
	for l := range strings.Lines(string(b)) {
		if match(l) {
			line = l
		}
	}
	return line, string(b)
}
