package scripts

import (
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestMakeInstalls holds each make target to what it installs: the tests
// need Redis, nginx, a C compiler (for -race) and promtool; the local stack
// runs Redis and what it builds itself (NATS and the daemons), so `make up`
// installs Redis only and none of promtool's minutes-long build.
func TestMakeInstalls(t *testing.T) {
	mk, err := exec.LookPath("make")
	if err != nil {
		t.Skip("no make")
	}
	tests := []struct {
		name     string
		target   string
		deps     []string // install-deps.sh's arguments
		promtool bool     // runs deploy/install-promtool.sh
	}{
		{name: "test", target: "test", deps: []string{"redis", "nginx", "cc"}, promtool: true},
		{name: "deps", target: "deps", deps: []string{"redis", "nginx", "cc"}, promtool: true},
		{name: "up", target: "up", deps: []string{"redis"}, promtool: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cmd := exec.Command(mk, "-n", "-C", "..", tt.target)
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
				if slices.ContainsFunc(f, func(w string) bool { return filepath.Base(w) == "install-promtool.sh" }) {
					promtool = true
				}
			}
			if calls != 1 || !slices.Equal(deps, tt.deps) {
				t.Errorf("make %s runs install-deps.sh %d times, last with %q; want once with %q\n%s", tt.target, calls, deps, tt.deps, out)
			}
			if promtool != tt.promtool {
				t.Errorf("make %s runs install-promtool.sh: %v, want %v\n%s", tt.target, promtool, tt.promtool, out)
			}
		})
	}
}
