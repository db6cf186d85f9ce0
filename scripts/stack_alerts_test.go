package scripts

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	"go.yaml.in/yaml/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// The local stack's addresses (scripts/stack.sh).
const (
	promURL = "http://127.0.0.1:9090"
	amURL   = "http://127.0.0.1:9094"
)

var stackGRPC = map[string]string{"us-east": "127.0.0.1:8081", "eu-west": "127.0.0.1:8082", "ap-south": "127.0.0.1:8083"}

// alertScale divides every range window and for: of the alert rules in the
// test's copy: 5m becomes 5 s, 10m 10 s. The expressions are otherwise the
// real ones, so the test proves them, not a copy.
const alertScale = 60

var (
	windowRE = regexp.MustCompile(`\[(\d+)([smh])\]`)
	forRE    = regexp.MustCompile(`(?m)^([ \t]+for:[ \t]+)(\d+)([smh])[ \t]*$`)
)

// scaledDuration is d/alertScale, at least 4 s (four scrapes at 1 s).
func scaledDuration(n, unit string) string {
	v, _ := strconv.Atoi(n)
	sec := v * map[string]int{"s": 1, "m": 60, "h": 3600}[unit]
	return strconv.Itoa(max(sec/alertScale, 4)) + "s"
}

// testAlertRules rewrites alerts.yml's range windows and for: durations by
// alertScale.
func testAlertRules(src []byte) []byte {
	out := windowRE.ReplaceAllFunc(src, func(m []byte) []byte {
		s := windowRE.FindSubmatch(m)
		return []byte("[" + scaledDuration(string(s[1]), string(s[2])) + "]")
	})
	return forRE.ReplaceAllFunc(out, func(m []byte) []byte {
		s := forRE.FindSubmatch(m)
		return append(append([]byte{}, s[1]...), scaledDuration(string(s[2]), string(s[3]))...)
	})
}

// alertExprs reads the expression of every alert of a rules file.
func alertExprs(t *testing.T, data []byte) map[string]string {
	t.Helper()
	var f struct {
		Groups []struct {
			Rules []struct {
				Alert string `yaml:"alert"`
				Expr  string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(data, &f); err != nil {
		t.Fatalf("alert rules: %v", err)
	}
	out := map[string]string{}
	for _, g := range f.Groups {
		for _, r := range g.Rules {
			out[r.Alert] = r.Expr
		}
	}
	return out
}

// promQuery runs expr through Prometheus's /api/v1/query and returns the
// labels of each series of the result.
func promQuery(ctx context.Context, expr string) ([]map[string]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", promURL+"/api/v1/query?"+url.Values{"query": {expr}}.Encode(), nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var body struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			Result []struct {
				Metric map[string]string `json:"metric"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("query %q: %s: %w", expr, resp.Status, err)
	}
	if body.Status != "success" {
		return nil, fmt.Errorf("query %q: %s", expr, body.Error)
	}
	var out []map[string]string
	for _, r := range body.Data.Result {
		out = append(out, r.Metric)
	}
	return out, nil
}

// watch is one expression watched through a failure: an alert's (or, with
// expr set, a plain query's) result must have a series carrying labels.
type watch struct {
	alert     string
	expr      string // empty: the alert's expression
	labels    map[string]string
	afterHeal bool // fires only once healed (the lag of a backlog applied late)
	optional  bool // recorded when it fires, not required to

	mu      sync.Mutex
	fired   time.Duration // from the failure; -1: not yet
	cleared time.Duration // from the heal; -1: not yet
	last    string
}

func (w *watch) name() string {
	if w.expr != "" && w.alert == "" {
		return w.expr
	}
	return w.alert
}

func (w *watch) where() string {
	var kv []string
	for k, v := range w.labels {
		kv = append(kv, k+"="+v)
	}
	slices.Sort(kv)
	return strings.Join(kv, ",")
}

// failure is one fault injected into the stack, and what it must set off.
type failure struct {
	name    string
	watches []*watch
	inject  func(ctx context.Context) error
	hold    time.Duration // least time between the failure and the heal
	heal    func(ctx context.Context) error

	start, healed time.Time
}

// run injects f, waits until every watch that fires during the failure
// has, heals and waits until every watch fired and cleared again.
func (f *failure) run(ctx context.Context, t *testing.T, exprs map[string]string) {
	for _, w := range f.watches {
		w.fired, w.cleared = -1, -1
		if w.expr == "" {
			w.expr = exprs[w.alert]
			if w.expr == "" {
				t.Errorf("%s: no alert %s in alerts.yml", f.name, w.alert)
				return
			}
		}
	}
	var healedMu sync.Mutex
	healedAt := func() time.Time { healedMu.Lock(); defer healedMu.Unlock(); return f.healed }
	pctx, stop := context.WithCancel(ctx)
	defer stop()
	var wg sync.WaitGroup
	f.start = time.Now()
	for _, w := range f.watches {
		wg.Go(func() {
			tick := time.NewTicker(500 * time.Millisecond)
			defer tick.Stop()
			for {
				res, err := promQuery(pctx, w.expr)
				now := time.Now()
				on := slices.ContainsFunc(res, func(m map[string]string) bool {
					for k, v := range w.labels {
						if m[k] != v {
							return false
						}
					}
					return true
				})
				w.mu.Lock()
				if err != nil {
					w.last = err.Error()
				} else {
					w.last = fmt.Sprint(res)
				}
				if err == nil && on && w.fired < 0 {
					w.fired = now.Sub(f.start)
				}
				if h := healedAt(); err == nil && !on && w.fired >= 0 && !h.IsZero() && w.cleared < 0 {
					w.cleared = max(now.Sub(h), 0)
				}
				w.mu.Unlock()
				select {
				case <-pctx.Done():
					return
				case <-tick.C:
				}
			}
		})
	}
	done := func(cond func(w *watch) bool) bool {
		for _, w := range f.watches {
			w.mu.Lock()
			ok := w.optional || cond(w)
			w.mu.Unlock()
			if !ok {
				return false
			}
		}
		return true
	}
	waitFor := func(limit time.Duration, cond func(w *watch) bool) bool {
		deadline := time.Now().Add(limit)
		for !done(cond) {
			if time.Now().After(deadline) || ctx.Err() != nil {
				return false
			}
			time.Sleep(200 * time.Millisecond)
		}
		return true
	}

	if err := f.inject(ctx); err != nil {
		t.Errorf("%s: inject: %v", f.name, err)
	}
	fired := waitFor(45*time.Second, func(w *watch) bool { return w.afterHeal || w.fired >= 0 })
	if d := f.hold - time.Since(f.start); d > 0 {
		time.Sleep(d)
	}
	if err := f.heal(ctx); err != nil {
		t.Errorf("%s: heal: %v", f.name, err)
	}
	healedMu.Lock()
	f.healed = time.Now()
	healedMu.Unlock()
	// Every watch that fired clears; one due after the heal may still fire.
	waitFor(60*time.Second, func(w *watch) bool {
		return (w.fired >= 0 || !w.afterHeal && !fired) && (w.fired < 0 || w.cleared >= 0)
	})
	stop()
	wg.Wait()
	for _, w := range f.watches {
		switch {
		case w.optional:
		case w.fired < 0:
			t.Errorf("%s: %s{%s} never turned true (last result %s; expr %s)", f.name, w.name(), w.where(), w.last, w.expr)
		case w.cleared < 0:
			t.Errorf("%s: %s{%s} still true %.0f s after the heal (last result %s; expr %s)", f.name, w.name(), w.where(), time.Since(f.healed).Seconds(), w.last, w.expr)
		}
	}
}

// TestStackAlerts runs the local stack with its monitoring (make up
// MONITORING=1, the real Prometheus and Alertmanager scraping and
// evaluating every second, every Redis node through redis_exporter and
// every NATS server through natsexporter), checks that Prometheus has each
// Redis primary's and NATS server's series, and, over it, injects each
// failure the alerts are for, asserting through Prometheus's query API that the alert's
// expression turns true during the failure and false after the heal, and
// that alerts reach Alertmanager. It prints how long each took. The rules
// Prometheus loads are deploy/prometheus/alerts.yml with every range
// window and for: divided by 60 (testAlertRules); nothing else changed.
func TestStackAlerts(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the whole stack with Prometheus and Alertmanager")
	}
	var missing []string
	for _, bins := range [][]string{{"bash"}, {"redis-server"}, {"redis-cli"}, {"prometheus"}, {"prometheus-alertmanager", "alertmanager"}, {"prometheus-redis-exporter", "redis_exporter"}} {
		if !slices.ContainsFunc(bins, func(b string) bool { _, err := exec.LookPath(b); return err == nil }) {
			missing = append(missing, strings.Join(bins, " or "))
		}
	}
	if len(missing) > 0 {
		msg := fmt.Sprintf("%s missing: scripts/install-deps.sh redis prometheus alertmanager redis-exporter installs them", strings.Join(missing, ", "))
		if inCI() {
			t.Fatal(msg + " (CI=true: the alerts' end-to-end test must run)")
		}
		t.Skip(msg)
	}
	ports := exec.Command("bash", "stack.sh", "ports")
	ports.Env = append(os.Environ(), "MONITORING=1")
	out, err := ports.Output()
	if err != nil {
		t.Fatalf("MONITORING=1 stack.sh ports: %v", err)
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
	dir := t.TempDir()
	rulesFile := filepath.Join(dir, "rules.yml")
	goodRules, err := os.ReadFile(filepath.Join(root, "examples", "rules.yml"))
	if err != nil {
		t.Fatal(err)
	}
	writeFile := func(path string, data []byte) error {
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, data, 0o644); err != nil {
			return err
		}
		return os.Rename(tmp, path)
	}
	if err := writeFile(rulesFile, goodRules); err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile(filepath.Join(root, "deploy", "prometheus", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	alerts := testAlertRules(src)
	alertsFile := filepath.Join(dir, "alerts.yml")
	if err := os.WriteFile(alertsFile, alerts, 0o644); err != nil {
		t.Fatal(err)
	}
	exprs := alertExprs(t, alerts)

	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	sh := func(timeout time.Duration, args ...string) (string, error) {
		// Not ctx: the cleanup's stack.sh down runs after ctx is cancelled.
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, args[0], args[1:]...)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "STACK_TIMEOUT=60", "MONITORING=1", "MONITORING_RULES="+alertsFile,
			"MONITORING_INTERVAL=1s", "RULES="+rulesFile, "LIMITERD_FLAGS=--redis.allow-unsafe-eviction")
		out, err := cmd.CombinedOutput()
		if err != nil {
			return string(out), fmt.Errorf("%s: %w\n%s", strings.Join(args, " "), err, out)
		}
		return string(out), nil
	}
	began := time.Now()
	t.Cleanup(func() {
		if out, err := sh(2*time.Minute, "bash", "scripts/stack.sh", "down"); err != nil {
			t.Errorf("stack.sh down: %v", err)
		} else if testing.Verbose() {
			t.Log(out)
		}
	})
	if _, err := sh(4*time.Minute, "bash", "scripts/stack.sh", "up"); err != nil {
		t.Fatal(err)
	}
	t.Logf("stack and monitoring up in %.1f s", time.Since(began).Seconds())
	// Prometheus scrapes from about 5 s after it is ready (its discovery
	// updates the targets every 5 s): a failure injected before the first
	// scrapes would have no "before" to increase from.
	// 20 targets: 3 limiterd, 3 reconcilers, 9 Redis nodes, 3 NATS
	// servers, Prometheus and Alertmanager.
	for deadline := time.Now().Add(30 * time.Second); ; {
		res, err := promQuery(ctx, `count(count_over_time(up[10s]) >= 3 and up == 1) >= 20`)
		if err == nil && len(res) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Prometheus has not scraped the stack's 20 targets 3 times within 30 s (%v %v): see .stack/logs/prometheus.log", res, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("every target scraped 3 times at %.1f s", time.Since(began).Seconds())
	checkExporterSeries(ctx, t)
	stackCmd := func(args ...string) func(context.Context) error {
		return func(context.Context) error {
			_, err := sh(90*time.Second, append([]string{"bash", "scripts/stack.sh"}, args...)...)
			return err
		}
	}
	redisCLI := func(port int, args ...string) (string, error) {
		out, err := sh(10*time.Second, append([]string{"redis-cli", "-p", strconv.Itoa(port)}, args...)...)
		return strings.TrimSpace(out), err
	}

	clients := map[string]limiterv1.LimiterClient{}
	for r, addr := range stackGRPC {
		cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		clients[r] = limiterv1.NewLimiterClient(cc)
	}
	// drive checks rule for key (a new key each time when key is empty)
	// at perSecond in region until ctx ends; errors are the failures'.
	drive := func(ctx context.Context, wg *sync.WaitGroup, region, rule, key string, perSecond int) {
		wg.Go(func() {
			tick := time.NewTicker(time.Second / time.Duration(perSecond))
			defer tick.Stop()
			for {
				k := key
				if k == "" {
					k = fmt.Sprintf("mon-%d", rand.Int64())
				}
				cctx, ccancel := context.WithTimeout(ctx, time.Second)
				_, _ = clients[region].Check(cctx, &limiterv1.CheckRequest{RuleId: rule, Key: k})
				ccancel()
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
			}
		})
	}
	// Traffic through the whole test: a reconciled fail-open rule and a
	// fail-closed one, in every region, so that spends flow.
	var traffic sync.WaitGroup
	tctx, stopTraffic := context.WithCancel(ctx)
	defer func() { stopTraffic(); traffic.Wait() }()
	for r := range stackGRPC {
		drive(tctx, &traffic, r, "api", "", 10)
		drive(tctx, &traffic, r, "password-reset", "", 5)
	}

	// Alertmanager: note every alert of the rules it receives.
	var amMu sync.Mutex
	amSeen := map[string]time.Duration{}
	var amWG sync.WaitGroup
	amCtx, stopAM := context.WithCancel(ctx)
	defer func() { stopAM(); amWG.Wait() }()
	amWG.Go(func() {
		for amCtx.Err() == nil {
			req, _ := http.NewRequestWithContext(amCtx, "GET", amURL+"/api/v2/alerts", nil)
			if resp, err := http.DefaultClient.Do(req); err == nil {
				var got []struct {
					Labels map[string]string `json:"labels"`
				}
				_ = json.NewDecoder(resp.Body).Decode(&got)
				resp.Body.Close()
				amMu.Lock()
				for _, a := range got {
					k := a.Labels["alertname"] + "{" + a.Labels["region"] + "}"
					if _, ok := amSeen[k]; !ok && exprs[a.Labels["alertname"]] != "" {
						amSeen[k] = time.Since(began)
					}
				}
				amMu.Unlock()
			}
			select {
			case <-amCtx.Done():
			case <-time.After(time.Second):
			}
		}
	})

	region := func(r string) map[string]string { return map[string]string{"region": r} }

	// Overshoot: one key of a global-* rule that is not reconciled, driven
	// from two regions: each admits the whole limit.
	var overWG sync.WaitGroup
	overCtx, stopOver := context.WithCancel(ctx)
	overshoot := &failure{
		name: "global-demo-unreconciled driven from eu-west and ap-south, 20/s each",
		watches: []*watch{
			{alert: "LimiterGlobalOvershoot", labels: map[string]string{"rule": "global-demo-unreconciled"}},
		},
		inject: func(context.Context) error {
			key := fmt.Sprintf("mon-overshoot-%d", rand.Int64())
			drive(overCtx, &overWG, "eu-west", "global-demo-unreconciled", key, 20)
			drive(overCtx, &overWG, "ap-south", "global-demo-unreconciled", key, 20)
			return nil
		},
		hold: 8 * time.Second,
		heal: func(context.Context) error { stopOver(); overWG.Wait(); return nil },
	}

	// Eviction: a us-east node with allkeys-lru (limiterd runs with
	// --redis.allow-unsafe-eviction) and a maxmemory below what it holds.
	evictPort := 0
	eviction := &failure{
		name: "us-east node with maxmemory-policy allkeys-lru and a tiny maxmemory evicts",
		watches: []*watch{
			{alert: "LimiterRedisEvictions", labels: region("us-east")},
			{alert: "LimiterRedisUnsafeEvictionPolicy", labels: region("us-east")},
			{alert: "LimiterRedisMemoryHigh", labels: region("us-east")},
		},
		inject: func(context.Context) error {
			if _, err := redisCLI(7000, "-c", "setrange", "mon:fill", "2000000", "x"); err != nil {
				return err
			}
			slot, err := redisCLI(7000, "cluster", "keyslot", "mon:fill")
			if err != nil {
				return err
			}
			for _, p := range []int{7000, 7001, 7002} {
				if n, _ := redisCLI(p, "cluster", "countkeysinslot", slot); n == "1" {
					evictPort = p
				}
			}
			if evictPort == 0 {
				return fmt.Errorf("no us-east node holds mon:fill (slot %s)", slot)
			}
			used := func() (int64, error) {
				info, err := redisCLI(evictPort, "info", "memory")
				if err != nil {
					return 0, err
				}
				m := regexp.MustCompile(`(?m)^used_memory:(\d+)`).FindStringSubmatch(info)
				if m == nil {
					return 0, fmt.Errorf("no used_memory in INFO of 127.0.0.1:%d", evictPort)
				}
				return strconv.ParseInt(m[1], 10, 64)
			}
			u, err := used()
			if err != nil {
				return err
			}
			if _, err := redisCLI(evictPort, "config", "set", "maxmemory-policy", "allkeys-lru"); err != nil {
				return err
			}
			if _, err := redisCLI(evictPort, "config", "set", "maxmemory", strconv.FormatInt(u-(1<<20), 10)); err != nil {
				return err
			}
			if _, err := redisCLI(evictPort, "setrange", "mon:fill", "0", "y"); err != nil {
				return err
			}
			stats, err := redisCLI(evictPort, "info", "stats")
			if err != nil {
				return err
			}
			if m := regexp.MustCompile(`(?m)^evicted_keys:(\d+)`).FindStringSubmatch(stats); m == nil || m[1] == "0" {
				return fmt.Errorf("127.0.0.1:%d evicted nothing", evictPort)
			}
			// Above 70% of maxmemory from here on, without evicting more.
			if u, err = used(); err != nil {
				return err
			}
			_, err = redisCLI(evictPort, "config", "set", "maxmemory", strconv.FormatInt(u*5/4, 10))
			return err
		},
		heal: func(context.Context) error {
			if evictPort == 0 {
				return nil
			}
			if _, err := redisCLI(evictPort, "config", "set", "maxmemory", "512mb"); err != nil {
				return err
			}
			_, err := redisCLI(evictPort, "config", "set", "maxmemory-policy", "noeviction")
			return err
		},
	}

	// A bad rules file: every daemon of every region reads it, refuses it
	// and keeps its rules.
	badRules := &failure{
		name: "rules file with an unknown algorithm written",
		watches: []*watch{
			{alert: "LimiterRulesReloadFailed", labels: map[string]string{"region": "us-east", "source": "file"}},
			{alert: "LimiterRulesReloadFailed", labels: map[string]string{"region": "eu-west", "source": "file"}},
			{alert: "LimiterRulesReloadFailed", labels: map[string]string{"region": "ap-south", "source": "file"}},
		},
		inject: func(context.Context) error {
			return writeFile(rulesFile, append(bytes.Clone(goodRules), "\n  - id: mon-bad\n    algorithm: no-such-algorithm\n    capacity: 1\n"...))
		},
		heal: func(context.Context) error { return writeFile(rulesFile, goodRules) },
	}

	// A Redis primary of us-east stopped: with no replica the cluster fails.
	redisDown := &failure{
		name: "redis-us-east:7001 stopped",
		watches: []*watch{
			{alert: "store errors (no alert)", expr: "sum by (region) (increase(limiter_store_errors_total[5s])) > 0", labels: region("us-east")},
			{alert: "LimiterStoreBreakerOpen", labels: region("us-east")},
			{alert: "LimiterFallbackDecisions", labels: region("us-east")},
			{alert: "LimiterFailClosedRefusals", labels: map[string]string{"region": "us-east", "rule": "password-reset"}},
		},
		inject: stackCmd("stop", "redis-us-east:7001"),
		heal:   stackCmd("start", "redis-us-east:7001"),
	}

	// The reconciler of eu-west stopped for 15 s while spends flow.
	reconcilerDown := &failure{
		name: "reconciler-eu-west stopped for 15 s",
		watches: []*watch{
			// Does not fire (deploy/README.md, Alerts): the restarted
			// reconciler may apply the late spends before its first
			// scrape, which a window shorter than the stop cannot rate.
			{alert: "LimiterReconcileLagHigh", labels: region("eu-west"), afterHeal: true, optional: true},
			{alert: "LimiterReconcileLagHigh", labels: map[string]string{"region": "us-east", "source_region": "eu-west"}, afterHeal: true},
			{alert: "LimiterRelayBacklogGrowing", labels: region("eu-west"), optional: true},
			{alert: "LimiterReconcilerNotApplying", labels: region("eu-west"), optional: true},
			{alert: "LimiterReconcilerAbsent", labels: region("eu-west")},
			{alert: "reconciler target down (no alert)", expr: `up{job="reconciler"} == 0`, labels: region("eu-west")},
		},
		inject: stackCmd("stop", "reconciler-eu-west"),
		hold:   15 * time.Second,
		heal:   stackCmd("start", "reconciler-eu-west"),
	}

	// The NATS server of ap-south stopped: its limiterd cannot publish.
	natsDown := &failure{
		name: "nats-ap-south stopped",
		watches: []*watch{
			{alert: "LimiterSpendPublishErrors", labels: region("ap-south")},
			{alert: "LimiterSpendBacklogGrowing", labels: region("ap-south")},
		},
		inject: stackCmd("stop", "nats-ap-south"),
		heal:   stackCmd("start", "nats-ap-south"),
	}

	// Two waves of failures in different regions at once.
	waves := [][]*failure{{overshoot, eviction, badRules}, {redisDown, reconcilerDown, natsDown}}
	for i, wave := range waves {
		var wg sync.WaitGroup
		for _, f := range wave {
			wg.Go(func() { f.run(ctx, t, exprs) })
		}
		wg.Wait()
		t.Logf("wave %d done at %.1f s", i+1, time.Since(began).Seconds())
	}
	stopAM()
	amWG.Wait()

	var tab bytes.Buffer
	tw := tabwriter.NewWriter(&tab, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "alert\tlabels\tfailure\tfire (s)\tclear (s)")
	for _, wave := range waves {
		for _, f := range wave {
			for _, w := range f.watches {
				fire, clear := "never", "-"
				if w.fired >= 0 {
					fire = fmt.Sprintf("%.1f", w.fired.Seconds())
					if w.afterHeal {
						fire += " (after heal at " + fmt.Sprintf("%.1f", f.healed.Sub(f.start).Seconds()) + ")"
					}
					clear = "never"
					if w.cleared >= 0 {
						clear = fmt.Sprintf("%.1f", w.cleared.Seconds())
					}
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", w.name(), w.where(), f.name, fire, clear)
			}
		}
	}
	tw.Flush()
	t.Logf("alert expressions over the stack (windows and for: / %d; fire: from the failure, clear: from the heal):\n%s", alertScale, tab.String())

	amMu.Lock()
	defer amMu.Unlock()
	if len(amSeen) == 0 {
		t.Errorf("no alert of the rules reached Alertmanager (%s/api/v2/alerts)", amURL)
	}
	var seen []string
	for k, d := range amSeen {
		seen = append(seen, fmt.Sprintf("%s at %.0f s", k, d.Seconds()))
	}
	slices.Sort(seen)
	t.Logf("alerts Alertmanager received: %s", strings.Join(seen, ", "))
	t.Logf("whole test: %.1f s", time.Since(began).Seconds())
}

// stackRedisPorts are the Redis nodes of each region of the stack, all
// primaries (scripts/stack.sh).
var stackRedisPorts = map[string][]int{"us-east": {7000, 7001, 7002}, "eu-west": {7100, 7101, 7102}, "ap-south": {7200, 7201, 7202}}

// checkExporterSeries checks, through Prometheus's query API, what the
// exporters of the stack's monitoring give it: redis_up 1 and the role
// master for every Redis primary of every region (job redis, instance
// redis://host:port), and for every region's NATS server nats_up 1 and a
// round-trip time to each other region's gateway (job nats).
func checkExporterSeries(ctx context.Context, t *testing.T) {
	t.Helper()
	type want struct {
		expr string
		keys []string // "region instance" or "region gateway" of each series wanted
		key  func(m map[string]string) string
	}
	var redisNodes, natsServers, gateways []string
	for r, ports := range stackRedisPorts {
		for _, p := range ports {
			redisNodes = append(redisNodes, fmt.Sprintf("%s redis://127.0.0.1:%d", r, p))
		}
		natsServers = append(natsServers, r)
		for o := range stackRedisPorts {
			if o != r {
				gateways = append(gateways, r+" "+o)
			}
		}
	}
	byInstance := func(m map[string]string) string { return m["region"] + " " + m["instance"] }
	wants := []want{
		{`redis_up{job="redis"} == 1`, redisNodes, byInstance},
		{`redis_instance_info{job="redis", role="master"}`, redisNodes, byInstance},
		{`nats_up{job="nats"} == 1`, natsServers, func(m map[string]string) string { return m["region"] }},
		{`nats_gateway_rtt_seconds{job="nats"} > 0`, gateways, func(m map[string]string) string { return m["region"] + " " + m["gateway"] }},
	}
	for _, w := range wants {
		var missing []string
		var res []map[string]string
		var err error
		for deadline := time.Now().Add(20 * time.Second); ; {
			res, err = promQuery(ctx, w.expr)
			got := map[string]bool{}
			for _, m := range res {
				got[w.key(m)] = true
			}
			missing = slices.DeleteFunc(slices.Clone(w.keys), func(k string) bool { return got[k] })
			if err == nil && len(missing) == 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(500 * time.Millisecond)
		}
		slices.Sort(missing)
		if err != nil || len(missing) > 0 {
			t.Errorf("%s: no series for %q (error %v, result %v): see .stack/logs/redis-exporter.log, nats-exporter.log", w.expr, missing, err, res)
			continue
		}
		t.Logf("%s: %d series, one for each of %d wanted", w.expr, len(res), len(w.keys))
	}
}
