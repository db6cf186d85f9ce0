package scripts

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// inCI mirrors internal/testenv: under CI=true nothing the test needs may
// be missing.
func inCI() bool {
	v, _ := strconv.ParseBool(os.Getenv("CI"))
	return v
}

// TestStackUpDemoDown runs the local stack of docs/local-stack.md as a user would:
// `make up` (three regions, each its own nats-server, joined by gateways;
// locked NATS), the admin example, a short
// `make demo`, `make down`. The reconciled rule stays within one gossip
// interval of remote spending of its limit; the unreconciled one does not.
func TestStackUpDemoDown(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the whole stack")
	}
	for _, bin := range []string{"bash", "redis-server", "redis-cli"} {
		if _, err := exec.LookPath(bin); err != nil {
			if inCI() {
				t.Fatalf("%s missing", bin)
			}
			t.Skipf("%s missing (scripts/install-deps.sh installs it)", bin)
		}
	}
	out, err := exec.Command("bash", "stack.sh", "ports").Output()
	if err != nil {
		t.Fatalf("stack.sh ports: %v", err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		addr, what, _ := strings.Cut(line, " ")
		if c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond); err == nil {
			c.Close()
			if inCI() {
				t.Fatalf("%s (%s) is in use", addr, what)
			}
			t.Skipf("%s (%s) is in use: is a stack up? (make down)", addr, what)
		}
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	run := func(timeout time.Duration, name string, args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "STACK_TIMEOUT=60", "WAN=") // the default delays
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	t.Cleanup(func() { run(2*time.Minute, "bash", "scripts/stack.sh", "down") })
	run(4*time.Minute, "bash", "scripts/stack.sh", "up")

	// The default WAN delays are between the regions: each gateway's round
	// trip, as us-east's server measured it, is at least twice its
	// one-way delay, and not much more.
	for _, tt := range []struct {
		to     string
		oneWay time.Duration
	}{{"eu-west", 40 * time.Millisecond}, {"ap-south", 110 * time.Millisecond}} {
		rtt := gatewayRTT(t, "127.0.0.1:8222", tt.to)
		if rtt < 2*tt.oneWay || rtt > 2*tt.oneWay+150*time.Millisecond {
			t.Errorf("us-east's gateway to %s: round trip %v, want [%v, %v]", tt.to, rtt, 2*tt.oneWay, 2*tt.oneWay+150*time.Millisecond)
		}
	}

	token, err := os.ReadFile(filepath.Join(root, ".stack", "admin-token"))
	if err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest("PUT", "http://127.0.0.1:9091/admin/rules/burst", strings.NewReader("id: burst\ncapacity: 5\nrefill_per_second: 1\n"))
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the docs' admin PUT: %s", resp.Status)
	}

	chart := filepath.Join(t.TempDir(), "demo.svg")
	report := run(2*time.Minute, "go", "run", "./cmd/limiterdemo", "--rules.file=examples/rules.yml", "--duration=6s", "--chart="+chart)
	t.Log(report)
	if st, err := os.Stat(chart); err != nil || st.Size() == 0 {
		t.Errorf("the demo wrote no chart to %s: %v", chart, err)
	}
	// "overshoot   +0.0 = +0.00 x one gossip interval ...": reconciled first.
	re := regexp.MustCompile(`(?m)^\s+overshoot\s+\S+ = ([+-][0-9.]+) x one gossip interval`)
	var over []float64
	sc := bufio.NewScanner(strings.NewReader(report))
	for sc.Scan() {
		if m := re.FindStringSubmatch(sc.Text()); m != nil {
			v, _ := strconv.ParseFloat(m[1], 64)
			over = append(over, v)
		}
	}
	if len(over) != 2 {
		t.Fatalf("the demo's report has %d overshoot lines, want 2", len(over))
	}
	if over[0] > 1 {
		t.Errorf("reconciled rule over its limit by %.2f intervals of remote spending, want at most 1", over[0])
	}
	if over[1] <= 1 {
		t.Errorf("unreconciled rule over its limit by only %.2f intervals: the demo shows no contrast", over[1])
	}
}

// gatewayRTT is the round trip of the outbound gateway to region of the
// nats-server whose monitoring port is at mon, as it measured it; it
// waits up to 10 s for the first measure.
func gatewayRTT(t *testing.T, mon, region string) time.Duration {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var gw struct {
			Outbound map[string]struct {
				Connection struct {
					RTT string `json:"rtt"`
				} `json:"connection"`
			} `json:"outbound_gateways"`
		}
		resp, err := http.Get("http://" + mon + "/gatewayz")
		if err == nil {
			err = json.NewDecoder(resp.Body).Decode(&gw)
			resp.Body.Close()
		}
		if err == nil {
			if d, perr := time.ParseDuration(gw.Outbound[region].Connection.RTT); perr == nil && d > 0 {
				return d
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s/gatewayz: no round trip to %s after 10s (%v, %+v)", mon, region, err, gw)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
