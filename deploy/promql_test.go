package deploy

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/promql/parser"
	"go.yaml.in/yaml/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/reconciler"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// Files holding PromQL, relative to this package.
var (
	dashboardFile  = filepath.Join("grafana", "limiterd.json")
	alertsFile     = filepath.Join("prometheus", "alerts.yml")
	alertTestsFile = filepath.Join("prometheus", "alerts_test.yml")
)

// externalMetrics are the metrics the dashboard and alerts may use that the
// daemons do not export, with the exporter that does: redis_exporter's, per
// Redis node, and natsexporter's (internal/tools/natsexporter), per NATS
// server. TestExternalMetricsExported runs both against real servers.
// Every other metric must be exported by limiterd or the reconciler.
var externalMetrics = map[string]string{
	"redis_instance_info":                      redisExporter,
	"redis_cpu_sys_seconds_total":              redisExporter,
	"redis_cpu_user_seconds_total":             redisExporter,
	"redis_commands_processed_total":           redisExporter,
	"redis_memory_used_bytes":                  redisExporter,
	"redis_memory_max_bytes":                   redisExporter,
	"redis_evicted_keys_total":                 redisExporter,
	"nats_cpu_percent":                         natsExporter,
	"nats_gateway_rtt_seconds":                 natsExporter,
	"nats_gateway_pending_bytes":               natsExporter,
	"nats_jetstream_consumer_pending_messages": natsExporter,
}

// The exporters of externalMetrics.
const (
	redisExporter = "redis_exporter"
	natsExporter  = "natsexporter"
)

// promqlExpr is one PromQL expression and where it comes from.
type promqlExpr struct {
	where string
	expr  string
}

// grafanaVars are the Grafana variables that may appear outside label
// values in an expression, with what they stand for when parsing.
var grafanaVars = strings.NewReplacer(
	"${__rate_interval}", "5m", "$__rate_interval", "5m",
	"${__interval}", "1m", "$__interval", "1m",
	"${__range}", "1h", "$__range", "1h",
)

var labelValuesCall = regexp.MustCompile(`^\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$`)

// dashboardExprs returns every expression of the dashboard: each target's
// expr and each query variable's query (label_values(<selector>, label)
// gives its selector).
func dashboardExprs(path string) ([]promqlExpr, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var d struct {
		Panels []struct {
			Title   string `json:"title"`
			Type    string `json:"type"`
			Targets []struct {
				RefID string `json:"refId"`
				Expr  string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name  string          `json:"name"`
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &d); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	var out []promqlExpr
	for _, p := range d.Panels {
		for _, t := range p.Targets {
			out = append(out, promqlExpr{fmt.Sprintf("%s: panel %q target %s", path, p.Title, t.RefID), grafanaVars.Replace(t.Expr)})
		}
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &q); err != nil {
			var s string
			if err := json.Unmarshal(v.Query, &s); err != nil {
				return nil, fmt.Errorf("%s: variable %s: query is neither a string nor {query}", path, v.Name)
			}
			q.Query = s
		}
		expr := q.Query
		if m := labelValuesCall.FindStringSubmatch(expr); m != nil {
			expr = m[1]
		}
		out = append(out, promqlExpr{fmt.Sprintf("%s: variable %s", path, v.Name), grafanaVars.Replace(expr)})
	}
	return out, nil
}

var promqlParser = parser.NewParser(parser.Options{})

// ruleGroups is a Prometheus rule file, as far as these tests read it.
type ruleGroups struct {
	Groups []struct {
		Name     string `yaml:"name"`
		Interval string `yaml:"interval"`
		Rules    []struct {
			Alert         string            `yaml:"alert"`
			Record        string            `yaml:"record"`
			Expr          string            `yaml:"expr"`
			For           string            `yaml:"for"`
			KeepFiringFor string            `yaml:"keep_firing_for"`
			Labels        map[string]string `yaml:"labels"`
			Annotations   map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// loadAlertRules decodes the rule file strictly (an unknown field is an
// error); promtool check rules validates the rest.
func loadAlertRules(path string) (*ruleGroups, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var g ruleGroups
	if err := dec.Decode(&g); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &g, nil
}

// ruleExprs returns the expression of every rule of the rule file.
func ruleExprs(path string) ([]promqlExpr, error) {
	groups, err := loadAlertRules(path)
	if err != nil {
		return nil, err
	}
	var out []promqlExpr
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			out = append(out, promqlExpr{fmt.Sprintf("%s: group %s, rule %s%s", path, g.Name, r.Alert, r.Record), r.Expr})
		}
	}
	return out, nil
}

// metricNames parses expr and returns the metric names its selectors use;
// a selector without one fixed name is an error.
func metricNames(expr string) ([]string, error) {
	e, err := promqlParser.ParseExpr(expr)
	if err != nil {
		return nil, err
	}
	names := map[string]bool{}
	var errs []error
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := vs.Name
		for _, m := range vs.LabelMatchers {
			if m.Name == model.MetricNameLabel && name == "" {
				if m.Type.String() != "=" {
					errs = append(errs, fmt.Errorf("selector %s: the metric name must be fixed", vs))
				}
				name = m.Value
			}
		}
		if name == "" {
			errs = append(errs, fmt.Errorf("selector %s names no metric", vs))
			return nil
		}
		names[name] = true
		return nil
	})
	if len(errs) > 0 {
		return nil, fmt.Errorf("%v", errs)
	}
	return slices.Sorted(maps.Keys(names)), nil
}

// allExprs collects the expressions of the dashboard and the alert rules.
func allExprs(t *testing.T) []promqlExpr {
	t.Helper()
	dash, err := dashboardExprs(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	rules, err := ruleExprs(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	if len(dash) == 0 || len(rules) == 0 {
		t.Fatalf("%d dashboard and %d rule expressions: want some of each", len(dash), len(rules))
	}
	return append(dash, rules...)
}

// usedMetrics parses every expression and returns each metric name used,
// with where.
func usedMetrics(t *testing.T) map[string][]string {
	t.Helper()
	used := map[string][]string{}
	for _, e := range allExprs(t) {
		names, err := metricNames(e.expr)
		if err != nil {
			t.Errorf("%s: %v\n%s", e.where, err, e.expr)
			continue
		}
		if len(names) == 0 {
			t.Errorf("%s: uses no metric: %s", e.where, e.expr)
		}
		for _, n := range names {
			used[n] = append(used[n], e.where)
		}
	}
	return used
}

// TestPromQLParses parses every PromQL expression of the dashboard and the
// alert rules (Grafana's $__rate_interval and friends stand for durations)
// and checks that each metric name is either allow-listed as external or
// looks like the daemons' own (limiter_*); TestPromQLMetricsExported then
// checks the daemons really export each one.
func TestPromQLParses(t *testing.T) {
	used := usedMetrics(t)
	for name, where := range used {
		if _, ok := externalMetrics[name]; !ok && !strings.HasPrefix(name, "limiter_") {
			t.Errorf("%s: metric %s is neither the daemons' (limiter_*) nor in externalMetrics", where[0], name)
		}
	}
	for name := range externalMetrics {
		if used[name] == nil {
			t.Errorf("externalMetrics lists %s, which nothing uses: remove it", name)
		}
	}
}

// TestDashboard checks the dashboard's structure: unique panel ids, every
// graph queries the ${datasource} variable with at least one target and
// unique refIds, panels inside the 24-column grid, and the variables the
// expressions use are defined.
func TestDashboard(t *testing.T) {
	data, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		UID    string `json:"uid"`
		Title  string `json:"title"`
		Panels []struct {
			ID         int    `json:"id"`
			Type       string `json:"type"`
			Title      string `json:"title"`
			Datasource *struct {
				Type string `json:"type"`
				UID  string `json:"uid"`
			} `json:"datasource"`
			GridPos struct{ H, W, X, Y int } `json:"gridPos"`
			Targets []struct {
				RefID string `json:"refId"`
				Expr  string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name string `json:"name"`
				Type string `json:"type"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatal(err)
	}
	if d.UID == "" || d.Title == "" {
		t.Error("dashboard needs a uid and a title")
	}
	vars := map[string]bool{"__rate_interval": true, "__interval": true, "__range": true}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
	}
	if !vars["datasource"] {
		t.Error("no datasource variable")
	}
	ids := map[int]bool{}
	graphs := 0
	varRef := regexp.MustCompile(`\$\{?([A-Za-z_][A-Za-z0-9_]*)`)
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel %q: id %d used twice", p.Title, p.ID)
		}
		ids[p.ID] = true
		if p.GridPos.W <= 0 || p.GridPos.H <= 0 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q: gridPos %+v outside the 24-column grid", p.Title, p.GridPos)
		}
		if p.Type == "row" {
			continue
		}
		graphs++
		if p.Datasource == nil || p.Datasource.Type != "prometheus" || p.Datasource.UID != "${datasource}" {
			t.Errorf("panel %q: datasource must be the prometheus ${datasource} variable", p.Title)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q: no target", p.Title)
		}
		refs := map[string]bool{}
		for _, tg := range p.Targets {
			if tg.RefID == "" || refs[tg.RefID] {
				t.Errorf("panel %q: refId %q empty or repeated", p.Title, tg.RefID)
			}
			refs[tg.RefID] = true
			for _, m := range varRef.FindAllStringSubmatch(tg.Expr, -1) {
				if !vars[m[1]] {
					t.Errorf("panel %q: expression uses $%s, which is no variable of the dashboard", p.Title, m[1])
				}
			}
		}
	}
	if graphs < 10 {
		t.Errorf("%d graph panels, want the dozen or so of deploy/README.md", graphs)
	}
}

// alertTests is the part of a promtool test file this package reads.
type alertTests struct {
	RuleFiles []string `yaml:"rule_files"`
	Tests     []struct {
		Name          string `yaml:"name"`
		AlertRuleTest []struct {
			Alertname string `yaml:"alertname"`
			ExpAlerts []struct {
				ExpLabels map[string]string `yaml:"exp_labels"`
			} `yaml:"exp_alerts"`
		} `yaml:"alert_rule_test"`
	} `yaml:"tests"`
}

// TestAlertRulesDocumented checks every alert: a severity of page or
// ticket, a summary, a one-line runbook annotation, and at least one
// promtool test case in which it fires.
func TestAlertRulesDocumented(t *testing.T) {
	groups, err := loadAlertRules(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(alertTestsFile)
	if err != nil {
		t.Fatal(err)
	}
	var tests alertTests
	if err := yaml.Unmarshal(data, &tests); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(tests.RuleFiles, filepath.Base(alertsFile)) {
		t.Errorf("%s does not test %s (rule_files %q)", alertTestsFile, filepath.Base(alertsFile), tests.RuleFiles)
	}
	fires := map[string]int{}
	for _, tc := range tests.Tests {
		for _, at := range tc.AlertRuleTest {
			if len(at.ExpAlerts) > 0 {
				fires[at.Alertname]++
			}
		}
	}
	alerts := 0
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			alerts++
			if s := r.Labels["severity"]; s != "page" && s != "ticket" {
				t.Errorf("alert %s: severity %q, want page or ticket", r.Alert, s)
			}
			if r.Annotations["summary"] == "" {
				t.Errorf("alert %s: no summary annotation", r.Alert)
			}
			if rb := strings.TrimSpace(r.Annotations["runbook"]); rb == "" || strings.Contains(rb, "\n") {
				t.Errorf("alert %s: runbook annotation %q: want one line", r.Alert, rb)
			}
			if fires[r.Alert] == 0 {
				t.Errorf("alert %s: no case of %s in which it fires", r.Alert, alertTestsFile)
			}
			delete(fires, r.Alert)
		}
	}
	for name := range fires {
		t.Errorf("%s tests alert %s, which %s does not define", alertTestsFile, name, alertsFile)
	}
	if alerts == 0 {
		t.Fatal("no alert rules")
	}
}

// exportedNames returns the metric names a registry exposes: histograms as
// their _bucket, _sum and _count series, summaries as themselves, _sum and
// _count.
func exportedNames(t *testing.T, g prometheus.Gatherer, into map[string]bool) {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		name := mf.GetName()
		switch mf.GetType() {
		case dto.MetricType_HISTOGRAM, dto.MetricType_GAUGE_HISTOGRAM:
			into[name+"_bucket"], into[name+"_sum"], into[name+"_count"] = true, true, true
		case dto.MetricType_SUMMARY:
			into[name], into[name+"_sum"], into[name+"_count"] = true, true, true
		default:
			into[name] = true
		}
	}
}

func freeLoopback(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// waitFor polls cond every 50 ms until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %v", what, d)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func httpStatus(url string) int {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestPromQLMetricsExported runs the daemons in-process as production does
// (a real Redis Cluster, a real NATS JetStream): a limiterd of region
// us-east with the deployed rules, that region's reconciler and a reconciler
// of eu-west, for a two-region topology. It makes checks so that labelled
// series exist and waits until a spend of us-east has been debited in
// eu-west (the reconcile lag series), then gathers the three registries:
// every metric the dashboard and the alerts use must be among them or in
// externalMetrics. It also requests every probe path of the manifests on
// the running daemons.
func TestPromQLMetricsExported(t *testing.T) {
	used := usedMetrics(t)
	cluster := redistest.NewCluster(t, 3, 0)
	nats := natstest.NewServer(t)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))

	dir := t.TempDir()
	topology := filepath.Join(dir, "topology.yml")
	grpcAddr := freeLoopback(t)
	topo := fmt.Sprintf("regions:\n  - name: us-east\n    limiter_address: %s\n  - name: eu-west\n    limiter_address: %s\n", grpcAddr, freeLoopback(t))
	if err := os.WriteFile(topology, []byte(topo), 0o644); err != nil {
		t.Fatal(err)
	}
	rulesFile := filepath.Join(k8sDir, "base", "rules.yml")

	ctx := context.Background()
	recs := map[string]*reconciler.Reconciler{}
	for _, name := range []string{"us-east", "eu-west"} {
		o := reconciler.DefaultOptions()
		o.Region, o.TopologyFile, o.RulesFile, o.NATSURL = name, topology, rulesFile, nats.URL()
		o.Redis, o.Interval, o.AckWait = redisstore.Conn{Addrs: cluster.Addrs()}, 100*time.Millisecond, time.Second
		o.StreamMaxBytes, o.HTTPAddress, o.Logger = 64<<20, "127.0.0.1:0", quiet.With("reconciler", name)
		r, err := reconciler.New(o)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Start(ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Stop() })
		recs[name] = r
	}
	for name, r := range recs {
		waitFor(t, 20*time.Second, "reconciler "+name+" ready", func() bool { return httpStatus("http://"+r.HTTPAddr()+"/readyz") == http.StatusOK })
	}

	o := limiterd.DefaultOptions()
	o.Server.GRPCAddress, o.Server.HTTPAddress, o.Rules.File, o.Region.TopologyFile = grpcAddr, "127.0.0.1:0", rulesFile, topology
	o.Region.PeerSecretFile = testenv.SecretFile(t)
	o.Redis.Addrs, o.RedisTuning.Timeout, o.Region.Name, o.NATS.URL = cluster.Addrs(), time.Second, "us-east", nats.URL()
	o.NATS.GossipInterval, o.Region.Instance, o.Logger = 100*time.Millisecond, "limiterd-deploy-test", quiet
	o.NATS.GossipMaxDefer = 0
	d, err := limiterd.New(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop(context.Background()) })

	cc, err := grpc.NewClient(d.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	client := limiterv1.NewLimiterClient(cc)
	check := func(rule, key string) *limiterv1.CheckResponse {
		t.Helper()
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		resp, err := client.Check(cctx, &limiterv1.CheckRequest{RuleId: rule, Key: key})
		if err != nil {
			t.Fatalf("check %s %s: %v", rule, key, err)
		}
		return resp
	}
	for _, rule := range []string{"api", "search", "export-daily", "global-demo"} {
		check(rule, "user:1")
	}
	// Past the limit of 5 an hour: a store rejection, then the deny cache's.
	limited := 0
	for range 8 {
		if !check("password-reset", "user:2").GetAllowed() {
			limited++
		}
	}
	if limited == 0 {
		t.Fatal("password-reset admitted 8 checks: the limited series will not exist")
	}
	// Paced checks for limiter_paced_*: the third at once waits its slot.
	for i := range 3 {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		resp, err := client.Check(cctx, &limiterv1.CheckRequest{RuleId: "sms-provider", Key: "provider:acme", MaxWaitMs: 1000})
		cancel()
		if err != nil || !resp.GetAllowed() {
			t.Fatalf("paced check %d: %v, %v", i, resp, err)
		}
	}
	// An invalid request (empty key) for limiter_invalid_requests_total.
	if _, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "api"}); err == nil {
		t.Error("a check with no key was accepted")
	}

	exported := map[string]bool{}
	waitFor(t, 30*time.Second, "a us-east spend applied in eu-west (limiter_reconcile_lag_seconds)", func() bool {
		check("global-demo", "user:1")
		got := map[string]bool{}
		exportedNames(t, recs["eu-west"].Registry(), got)
		return got["limiter_reconcile_lag_seconds_bucket"]
	})
	exportedNames(t, d.Registry(), exported)
	for _, r := range recs {
		exportedNames(t, r.Registry(), exported)
	}

	for _, name := range slices.Sorted(maps.Keys(used)) {
		if _, ext := externalMetrics[name]; ext {
			if exported[name] {
				t.Errorf("%s is in externalMetrics but the daemons export it: remove it from the list", name)
			}
			continue
		}
		if !exported[name] {
			t.Errorf("%s: metric %s is not exported by limiterd or the reconciler", used[name][0], name)
		}
	}
	var unused []string
	for name := range exported {
		if strings.HasPrefix(name, "limiter_") && used[name] == nil {
			unused = append(unused, name)
		}
	}
	slices.Sort(unused)
	t.Logf("limiter_* series neither the dashboard nor the alerts use: %s", strings.Join(unused, ", "))

	// Every probe and scrape path of the manifests answers 200 on the daemons.
	addrs := map[string]string{limiterdContainer: d.HTTPAddr(), reconcilerContainer: recs["us-east"].HTTPAddr()}
	for _, dir := range overlayDirs(t) {
		b := buildOverlay(t, dir)
		for _, dep := range b.deployments {
			for _, c := range dep.Spec.Template.Spec.Containers {
				for _, p := range []string{c.ReadinessProbe.HTTPGet.Path, c.LivenessProbe.HTTPGet.Path, "/metrics"} {
					if got := httpStatus("http://" + addrs[c.Name] + p); got != http.StatusOK {
						t.Errorf("%s: GET %s on the running %s: status %d, want 200", dir, p, c.Name, got)
					}
				}
			}
		}
	}
}
