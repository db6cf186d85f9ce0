package scripts

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/reconciler"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// TestStackNATSIdentities: the identities `make up` writes (stack.sh
// nats-auth, the step `up` runs) lock a real nats-server, and every daemon
// runs with its own, as `up` passes them: both regions' reconcilers set up
// their streams, a spend admitted in us-east is debited in eu-west, a rule
// put through us-east's admin API (the admin writer's seed) is in force in
// eu-west, and eu-west's limiterd, which holds no writer seed, cannot put one.
func TestStackNATSIdentities(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	dir := t.TempDir()
	auth := filepath.Join(dir, "auth")
	if out, err := exec.Command(bash, "stack.sh", "nats-auth", auth).CombinedOutput(); err != nil {
		t.Fatalf("stack.sh nats-auth: %v\n%s", err, out)
	}
	seed := func(name string) string { return filepath.Join(auth, name+".nk") }
	for _, name := range []string{"limiterd-us-east", "limiterd-eu-west", "reconciler-us-east", "reconciler-eu-west", "admin", "auth"} {
		p := seed(name)
		if name == "auth" {
			p = filepath.Join(auth, "auth.conf")
		}
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", p, fi.Mode().Perm())
		}
	}
	conf, err := os.ReadFile(filepath.Join(auth, "auth.conf"))
	if err != nil {
		t.Fatal(err)
	}
	ns := natstest.NewServer(t, natstest.Config(string(conf)))

	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if os.Getenv("LIMITER_TEST_LOG") != "" {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	regions := []string{"us-east", "eu-west"}
	var topo strings.Builder
	topo.WriteString("regions:\n")
	for _, r := range regions {
		fmt.Fprintf(&topo, "  - name: %s\n    limiter_address: 127.0.0.1:1\n", r)
	}
	topoFile := filepath.Join(dir, "topology.yml")
	tokenFile := filepath.Join(dir, "admin-token")
	const token = "0123456789abcdef0123456789abcdef"
	for p, data := range map[string]string{topoFile: topo.String(), tokenFile: token + "\n"} {
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	rulesFile, err := filepath.Abs("../examples/rules.yml")
	if err != nil {
		t.Fatal(err)
	}

	recs := map[string]*reconciler.Reconciler{}
	lims := map[string]*limiterd.Daemon{}
	for _, r := range regions {
		node := redistest.NewNode(t)
		ro := reconciler.DefaultOptions()
		ro.Region, ro.TopologyFile, ro.RulesFile, ro.NATSURL = r, topoFile, rulesFile, ns.URL()
		ro.Redis, ro.NATSAuth = redisstore.Conn{Addrs: []string{node.Addr()}}, natsconn.Auth{NkeySeedFile: seed("reconciler-" + r)}
		ro.Interval, ro.StreamMaxBytes, ro.HTTPAddress, ro.Logger = 200*time.Millisecond, 64<<20, "127.0.0.1:0", log.With("daemon", "reconciler-"+r)
		rec, err := reconciler.New(ro)
		if err != nil {
			t.Fatal(err)
		}
		if err := rec.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { rec.Stop() })
		recs[r] = rec

		var admin natsconn.Auth
		if r == "us-east" {
			admin = natsconn.Auth{NkeySeedFile: seed("admin")}
		}
		o := limiterd.DefaultOptions()
		o.Server.GRPCAddress, o.Server.HTTPAddress, o.Rules.File, o.Region.Name, o.Region.Instance = "127.0.0.1:0", "127.0.0.1:0", rulesFile, r, "limiterd-"+r
		o.NATS.URL, o.NATS.Auth, o.Admin.NATSAuth = ns.URL(), natsconn.Auth{NkeySeedFile: seed("limiterd-" + r)}, admin
		o.Admin.TokenFile, o.NATS.GossipInterval, o.Logger = tokenFile, 200*time.Millisecond, log.With("daemon", "limiterd-"+r)
		o.NATS.GossipMaxDefer = 0
		d, err := limiterd.New(o)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Stop(context.Background()) })
		lims[r] = d
	}
	for r, rec := range recs {
		waitOK(t, "reconciler-"+r+" /readyz", "http://"+rec.HTTPAddr()+"/readyz")
	}

	// A spend admitted in us-east reaches eu-west's buckets.
	cc, err := grpc.NewClient(lims["us-east"].GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	usEast := limiterv1.NewLimiterClient(cc)
	if resp, err := usEast.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "global-demo", Key: "k"}); err != nil || !resp.Allowed {
		t.Fatalf("check in us-east: %v, %v", resp, err)
	}
	applied := func() float64 {
		mfs, err := recs["eu-west"].Registry().Gather()
		if err != nil {
			t.Fatal(err)
		}
		// Debited, or found refilled already: on a busy machine the
		// spend may arrive after the bucket has refilled past it.
		n := 0.0
		for _, mf := range mfs {
			if mf.GetName() == "limiter_spends_applied_total" || mf.GetName() == "limiter_spends_refilled_total" {
				for _, m := range mf.GetMetric() {
					if m.GetLabel()[0].GetValue() == "us-east" {
						n += m.GetCounter().GetValue()
					}
				}
			}
		}
		return n
	}
	if !waitUntil(func() bool { return applied() >= 1 }) {
		// What each daemon saw: the spend published, relayed, its
		// partition held and read.
		var seen []string
		for r, rec := range recs {
			seen = append(seen, metricsWithPrefix(t, "reconciler-"+r, rec.Registry(), "limiter_apply_", "limiter_reconcile_", "limiter_relay", "limiter_spends_"))
		}
		for r, d := range lims {
			seen = append(seen, metricsWithPrefix(t, "limiterd-"+r, d.Registry(), "limiter_spend", "limiter_gossip"))
		}
		t.Fatalf("eu-west applies us-east's spend: not after 30s\n%s", strings.Join(seen, "\n"))
	}

	// Rules: written by us-east's admin writer, read by everyone.
	rule := "id: burst\ncapacity: 5\nrefill_per_second: 1\n"
	if code, body := put(t, lims["us-east"].HTTPAddr(), "/admin/rules/burst", token, rule); code != http.StatusOK {
		t.Fatalf("PUT through us-east's admin API: %d %s", code, body)
	}
	cc2, err := grpc.NewClient(lims["eu-west"].GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc2.Close() })
	euWest := limiterv1.NewLimiterClient(cc2)
	waitFor(t, "the admin's rule in force in eu-west", func() bool {
		_, err := euWest.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "burst", Key: "k"})
		return status.Code(err) != codes.NotFound
	})
	// Refused at once, saying why (not after the write's timeout).
	if code, msg := put(t, lims["eu-west"].HTTPAddr(), "/admin/rules/other", token, "id: other\ncapacity: 5\nrefill_per_second: 1\n"); code != http.StatusConflict || !strings.Contains(msg, "--admin.nats-nkey-seed-file") {
		t.Errorf("PUT through eu-west's limiterd, with a read-only identity: %d %q; want 409 naming --admin.nats-nkey-seed-file", code, msg)
	}
}

func put(t *testing.T, addr, path, token, body string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, "http://"+addr+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func waitOK(t *testing.T, what, url string) {
	t.Helper()
	waitFor(t, what, func() bool {
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// waitFor polls ok until it holds, for at most 30 s.
func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	if !waitUntil(ok) {
		t.Fatalf("%s: not after 30s", what)
	}
}

// waitUntil polls ok for up to 30 s and reports whether it held.
func waitUntil(ok func() bool) bool {
	deadline := time.Now().Add(30 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
	return true
}

// metricsWithPrefix prints the series of reg whose names start with one
// of prefixes, under name: what a failed wait names.
func metricsWithPrefix(t *testing.T, name string, reg prometheus.Gatherer, prefixes ...string) string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		return name + ": " + err.Error()
	}
	var b strings.Builder
	b.WriteString(name + ":")
	for _, mf := range mfs {
		if !slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(mf.GetName(), p) }) {
			continue
		}
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			v := m.GetCounter().GetValue() + m.GetGauge().GetValue() + float64(m.GetHistogram().GetSampleCount())
			fmt.Fprintf(&b, " %s{%s}=%v", mf.GetName(), strings.Join(labels, ","), v)
		}
	}
	return b.String()
}
