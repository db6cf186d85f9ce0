package deploy

import (
	"bytes"
	"context"
	"debug/buildinfo"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"
	"time"
)

const prometheusModule = "github.com/prometheus/prometheus"

// prometheusVersion is the Prometheus module version go.mod requires,
// which promtool should match.
func prometheusVersion() string {
	data, err := os.ReadFile(filepath.Join("..", "go.mod"))
	if err != nil {
		return "<the version in go.mod>"
	}
	m := regexp.MustCompile(`(?m)^\s*(?:require\s+)?` + regexp.QuoteMeta(prometheusModule) + `\s+(v\S+)`).FindSubmatch(data)
	if m == nil {
		return "<the version in go.mod>"
	}
	return string(m[1])
}

// findPromtool looks for promtool on PATH, where Debian's prometheus
// package puts it (make test installs the package for the alerts'
// end-to-end test); a promtool built from the Prometheus module, in the
// repository's bin/ or on PATH, does as well.
func findPromtool(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("promtool"); err == nil {
		return p
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(root, "bin", "promtool")
	if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
		return p
	}
	t.Fatalf("promtool is not on PATH nor in %s; install it with `scripts/install-deps.sh prometheus` (Debian's prometheus package) or\n  GOBIN=%s go install %s/cmd/promtool@%s",
		filepath.Dir(p), filepath.Dir(p), prometheusModule, prometheusVersion())
	return ""
}

// TestAlertRulesPromtool runs `promtool check rules` on the alert rules and
// `promtool test rules` on their unit tests.
func TestAlertRulesPromtool(t *testing.T) {
	promtool := findPromtool(t)
	if bi, err := buildinfo.ReadFile(promtool); err == nil && bi.Main.Path == prometheusModule && bi.Main.Version != prometheusVersion() {
		t.Logf("%s is Prometheus %s, the deploy tests parse PromQL with %s", promtool, bi.Main.Version, prometheusVersion())
	}
	for _, args := range [][]string{
		{"check", "rules", alertsFile},
		{"test", "rules", alertTestsFile},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		cmd := exec.CommandContext(ctx, promtool, args...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		err := cmd.Run()
		cancel()
		if err != nil {
			t.Errorf("promtool %v: %v\n%s", args, err, out.String())
		}
	}
}
