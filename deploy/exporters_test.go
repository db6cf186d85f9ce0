package deploy

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/promql/parser"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// targetLabels are the labels Prometheus's scrape configuration puts on an
// exporter's series (scripts/stack.sh, the ServiceMonitors): an expression
// may select or group by them though no exporter sets them.
var targetLabels = map[string]bool{"region": true, "instance": true, "job": true, "pod": true}

// exported is every series one exporter served: each metric's label sets.
type exported map[string][]map[string]string

// scrapeExporter reads url, an exporter's /scrape?target=..., into into.
func scrapeExporter(t *testing.T, u string, into exported) error {
	t.Helper()
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(u)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", u, resp.Status)
	}
	tp := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := tp.TextToMetricFamilies(resp.Body)
	if err != nil {
		return fmt.Errorf("GET %s: %w", u, err)
	}
	for name, mf := range mfs {
		for _, m := range mf.GetMetric() {
			into[name] = append(into[name], labelMap(m))
		}
	}
	return nil
}

func labelMap(m *dto.Metric) map[string]string {
	out := map[string]string{}
	for _, l := range m.GetLabel() {
		out[l.GetName()] = l.GetValue()
	}
	return out
}

// startExporter runs bin with args (a listener on addr) until the test
// ends, and waits until GET http://addr/metrics answers 200.
func startExporter(t *testing.T, addr, bin string, args ...string) {
	t.Helper()
	dir := t.TempDir()
	logf := filepath.Join(dir, "exporter.log")
	p, err := testenv.StartProcess(dir, logf, bin, args...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	deadline := time.Now().Add(20 * time.Second)
	for httpStatus("http://"+addr+"/metrics") != http.StatusOK {
		select {
		case <-p.Done():
			t.Fatalf("%s exited: %v\n%s", filepath.Base(bin), p.Err(), testenv.TailFiles(logf))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not serving http://%s/metrics after 20 s\n%s", filepath.Base(bin), addr, testenv.TailFiles(logf))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// lookExporter returns the path of the first of names on PATH, or ends the
// test: a failure under CI=true, else a skip.
func lookExporter(t *testing.T, hint string, names ...string) string {
	t.Helper()
	for _, n := range names {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
	}
	msg := fmt.Sprintf("none of %s on PATH: %s", strings.Join(names, ", "), hint)
	if testenv.InCI() {
		t.Fatal(msg + " (CI=true: a failure, not a skip)")
	}
	t.Skip(msg)
	return ""
}

// TestExternalMetricsExported runs each exporter of externalMetrics
// against real servers, as the local stack's monitoring does: Debian's
// redis_exporter on a Redis Cluster primary and its replica, and
// natsexporter on a server of a two-region supercluster with a stream and
// a consumer. Every metric the dashboard and the alerts take from an
// exporter must be among the series it serves, and so must each label an
// expression selects (with a value that matches) or groups by, but the
// target labels Prometheus adds (region, instance, job, pod).
func TestExternalMetricsExported(t *testing.T) {
	exprs := allExprs(t)
	series := map[string]exported{redisExporter: {}, natsExporter: {}}

	// redis_exporter, multi-target: no --redis.addr, each node at
	// /scrape?target=redis://host:port.
	redisBin := lookExporter(t, "scripts/install-deps.sh redis-exporter installs it", "prometheus-redis-exporter", "redis_exporter")
	cluster := redistest.NewCluster(t, 1, 1)
	rx := testenv.FreeAddr(t)
	startExporter(t, rx, redisBin, "-web.listen-address", rx, "-redis.addr", "")
	for _, n := range cluster.Addrs() {
		if err := scrapeExporter(t, "http://"+rx+"/scrape?target="+url.QueryEscape("redis://"+n), series[redisExporter]); err != nil {
			t.Fatal(err)
		}
	}

	// natsexporter, built from this module.
	goBin, err := exec.LookPath("go")
	if err != nil {
		if testenv.InCI() {
			t.Fatalf("go not on PATH and CI=true: %v", err)
		}
		t.Skipf("go not on PATH: %v", err)
	}
	natsBin := filepath.Join(t.TempDir(), "natsexporter")
	build := exec.Command(goBin, "build", "-o", natsBin, "./internal/tools/natsexporter")
	build.Dir = ".."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./internal/tools/natsexporter: %v\n%s", err, out)
	}
	sc := natstest.NewSupercluster(t, []string{"east", "west"}, 1)
	east := sc.Servers("east")[0]
	nc, err := nats.Connect(sc.URL("east"))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "LIMITER_LOCAL_EAST", Subjects: []string{"spends.>"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "relay", AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "spends.east", []byte("x")); err != nil {
		t.Fatal(err)
	}
	nx := testenv.FreeAddr(t)
	startExporter(t, nx, natsBin, "--listen", nx, "--targets", east.MonitorAddr())
	// A gateway's round-trip time is there once the server has pinged it.
	testenv.WaitFor(t, "natsexporter serves nats_gateway_rtt_seconds", func() bool {
		got := exported{}
		if err := scrapeExporter(t, "http://"+nx+"/scrape?target="+url.QueryEscape(east.MonitorAddr()), got); err != nil {
			t.Fatal(err)
		}
		series[natsExporter] = got
		return len(got["nats_gateway_rtt_seconds"]) > 0
	})

	for name, exp := range externalMetrics {
		if len(series[exp][name]) == 0 {
			t.Errorf("externalMetrics: %s does not export %s", exp, name)
		}
	}
	for _, e := range exprs {
		checkExternalLabels(t, e, series)
	}
	var primaries int
	for _, l := range series[redisExporter]["redis_instance_info"] {
		if l["role"] == "master" {
			primaries++
		}
	}
	if primaries != 1 {
		t.Errorf("redis_exporter: %d redis_instance_info series with role=\"master\" for a cluster of one primary and its replica, want 1", primaries)
	}
}

// checkExternalLabels checks the selectors of e's external metrics against
// the series their exporter served: each label matcher must match one, and
// each label an aggregation around them groups by must be on one.
func checkExternalLabels(t *testing.T, e promqlExpr, series map[string]exported) {
	t.Helper()
	ast, err := promqlParser.ParseExpr(e.expr)
	if err != nil {
		return // TestPromQLParses reports it
	}
	// of is the exporter's series of a selector, when an exporter's.
	of := func(vs *parser.VectorSelector) ([]map[string]string, bool) {
		exp, ok := externalMetrics[vs.Name]
		if !ok {
			return nil, false
		}
		return series[exp][vs.Name], true
	}
	parser.Inspect(ast, func(n parser.Node, _ []parser.Node) error {
		switch n := n.(type) {
		case *parser.VectorSelector:
			got, ok := of(n)
			if !ok {
				return nil
			}
			for _, m := range n.LabelMatchers {
				if m.Name == model.MetricNameLabel || targetLabels[m.Name] {
					continue
				}
				if !slices.ContainsFunc(got, func(l map[string]string) bool { return m.Matches(l[m.Name]) }) {
					t.Errorf("%s: %s{%s}: none of the %d series %s served matches", e.where, n.Name, m, len(got), externalMetrics[n.Name])
				}
			}
		case *parser.AggregateExpr:
			if n.Without {
				return nil
			}
			var inner [][]map[string]string
			parser.Inspect(n.Expr, func(c parser.Node, _ []parser.Node) error {
				if vs, ok := c.(*parser.VectorSelector); ok {
					if got, ok := of(vs); ok {
						inner = append(inner, got)
					}
				}
				return nil
			})
			if len(inner) == 0 {
				return nil
			}
			for _, g := range n.Grouping {
				if targetLabels[g] {
					continue
				}
				if !slices.ContainsFunc(inner, func(got []map[string]string) bool {
					return slices.ContainsFunc(got, func(l map[string]string) bool { _, ok := l[g]; return ok })
				}) {
					t.Errorf("%s: groups by %s, which no series of its exporters' metrics carries: %s", e.where, g, e.expr)
				}
			}
		}
		return nil
	})
}
