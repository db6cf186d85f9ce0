package limiterd

import (
	"context"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/otlptest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/internal/tracing"
	"github.com/limiterd/limiterd/pkg/region"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// TestTraceAcrossRegions: with tracing on, a check of a pinned rule sent
// to a region that is not its key's home is one trace over both limiterd:
// the Check served in a, the Peer/Decide it sent, and that call served at
// the home b, whose span is a child of a's. a's Check span carries an
// event per stage of the check. With tracing off nothing is sent.
func TestTraceAcrossRegions(t *testing.T) {
	recv, endpoint := otlptest.Start(t)
	dir := t.TempDir()
	rulesFile := filepath.Join(dir, "rules.yml")
	if err := os.WriteFile(rulesFile, []byte(pinRules), 0o644); err != nil {
		t.Fatal(err)
	}
	addrs := map[string]string{"a": testenv.FreeAddr(t), "b": testenv.FreeAddr(t)}
	topoFile := filepath.Join(dir, "topology.yml")
	topoText := topoYAML(1, time.Time{}, addrs, "a", "b")
	if err := os.WriteFile(topoFile, []byte(topoText), 0o644); err != nil {
		t.Fatal(err)
	}
	topo, err := region.Parse("topology.yml", []byte(topoText))
	if err != nil {
		t.Fatal(err)
	}
	key := ""
	for i := 0; key == ""; i++ {
		if k := fmt.Sprint("user:", i); topo.Home(k, nil) == "b" {
			key = k
		}
	}
	secret := testenv.SecretFile(t)
	start := func(name string, tr tracing.Options) *Daemon {
		return startDaemon(t, nil, func(o *Options) {
			o.Region.Name, o.Region.TopologyFile, o.Region.PeerSecretFile, o.Rules.File = name, topoFile, secret, rulesFile
			o.Server.GRPCAddress, o.Tracing = addrs[name], tr
		})
	}
	on := tracing.Options{Endpoint: endpoint, Insecure: true, SampleRatio: 1}
	a, b := start("a", on), start("b", on)
	s := &topoStack{t: t, regions: map[string]*topoRegion{"a": {name: "a", d: a}, "b": {name: "b", d: b}}}
	s.waitPeers()
	client := limiterv1.NewLimiterClient(dial(t, a.GRPCAddr()))
	resp, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "pin", Key: key})
	if err != nil || !resp.GetAllowed() {
		t.Fatalf("check of %s (home b) through a: %v, %v", key, resp, err)
	}
	// Stopping sends what is buffered.
	for _, d := range []*Daemon{a, b} {
		if err := d.Stop(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	spans := recv.All()
	find := func(region, name string, kind tracepb.Span_SpanKind) *tracepb.Span {
		for _, s := range spans {
			if s.Service == "limiterd" && s.Region == region && s.Span.GetName() == name && s.Span.GetKind() == kind {
				return s.Span
			}
		}
		var got []string
		for _, s := range spans {
			got = append(got, fmt.Sprintf("%s/%s %s %v", s.Service, s.Region, s.Span.GetName(), s.Span.GetKind()))
		}
		t.Fatalf("no %v span %s from limiterd in %s; received %q", kind, name, region, got)
		return nil
	}
	check := find("a", "limiter.v1.Limiter/Check", tracepb.Span_SPAN_KIND_SERVER)
	sent := find("a", "limiter.v1.Peer/Decide", tracepb.Span_SPAN_KIND_CLIENT)
	served := find("b", "limiter.v1.Peer/Decide", tracepb.Span_SPAN_KIND_SERVER)
	trace := hex.EncodeToString(check.GetTraceId())
	for _, s := range []*tracepb.Span{sent, served} {
		if got := hex.EncodeToString(s.GetTraceId()); got != trace {
			t.Errorf("span %s in trace %s, the check's is %s", s.GetName(), got, trace)
		}
	}
	if !slices.Equal(sent.GetParentSpanId(), check.GetSpanId()) || !slices.Equal(served.GetParentSpanId(), sent.GetSpanId()) {
		t.Error("the spans do not chain: Check in a, then Peer/Decide sent by a, then served by b")
	}
	var events []string
	for _, e := range check.GetEvents() {
		events = append(events, e.GetName())
	}
	for _, want := range []string{"deny cache", "route", "home regions"} {
		if !slices.Contains(events, want) {
			t.Errorf("the check's span has events %q, none %q", events, want)
		}
	}

	// Off: a daemon without an endpoint sends nothing.
	n := len(recv.All())
	addrs["a"] = testenv.FreeAddr(t)
	off := startDaemon(t, nil, func(o *Options) { o.Rules.File = rulesFile; o.Tracing.Endpoint = "" })
	if _, err := limiterv1.NewLimiterClient(dial(t, off.GRPCAddr())).Check(context.Background(), &limiterv1.CheckRequest{RuleId: "pin", Key: key}); err != nil {
		t.Fatal(err)
	}
	if err := off.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := len(recv.All()); got != n {
		t.Errorf("tracing off: %d spans sent", got-n)
	}
}

// TestTraceRedisCall: with tracing on, a sampled check on a Redis store
// has a client span of its script call, a child of the check's span in
// the same trace, naming the primary it went to and the time it waited in
// limiterd's queue before its pipeline was written. With tracing off the
// daemon sends no span.
func TestTraceRedisCall(t *testing.T) {
	recv, endpoint := otlptest.Start(t)
	cluster := redistest.NewCluster(t, 1, 0)
	primary := cluster.Addrs()[0]
	d := startDaemon(t, cluster.Addrs(), func(o *Options) {
		o.Tracing = tracing.Options{Endpoint: endpoint, Insecure: true, SampleRatio: 1}
	})
	testenv.WaitFor(t, "the store connected", func() bool { return d.redis.Connected() })
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	if resp, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "tb", Key: "traced"}); err != nil || !resp.GetAllowed() {
		t.Fatalf("check: %v, %v", resp, err)
	}
	if err := d.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	var check, call *tracepb.Span
	var got []string
	for _, s := range recv.All() {
		got = append(got, fmt.Sprintf("%s %v", s.Span.GetName(), s.Span.GetKind()))
		switch {
		case s.Span.GetName() == "limiter.v1.Limiter/Check" && s.Span.GetKind() == tracepb.Span_SPAN_KIND_SERVER:
			check = s.Span
		case s.Span.GetName() == "EVALSHA" && s.Span.GetKind() == tracepb.Span_SPAN_KIND_CLIENT:
			call = s.Span
		}
	}
	if check == nil || call == nil {
		t.Fatalf("want a Check server span and an EVALSHA client span; received %q", got)
	}
	if !slices.Equal(call.GetTraceId(), check.GetTraceId()) || !slices.Equal(call.GetParentSpanId(), check.GetSpanId()) {
		t.Error("the Redis call's span is not a child of the check's")
	}
	attrs := map[string]string{}
	for _, kv := range call.GetAttributes() {
		v := kv.GetValue()
		switch {
		case v.GetStringValue() != "":
			attrs[kv.GetKey()] = v.GetStringValue()
		default:
			attrs[kv.GetKey()] = fmt.Sprint(v.GetIntValue())
		}
	}
	host, port, _ := net.SplitHostPort(primary)
	for k, want := range map[string]string{"db.system.name": "redis", "server.address": host, "server.port": port, "limiter.redis.pipeline_calls": "1"} {
		if attrs[k] != want {
			t.Errorf("EVALSHA span: %s = %q, want %q (attributes %v)", k, attrs[k], want, attrs)
		}
	}
	if w, err := strconv.ParseInt(attrs["limiter.redis.queue_wait_us"], 10, 64); err != nil || w < 0 || uint64(w) > (call.GetEndTimeUnixNano()-call.GetStartTimeUnixNano())/1000 {
		t.Errorf("EVALSHA span: limiter.redis.queue_wait_us %q, want a wait within the span (attributes %v)", attrs["limiter.redis.queue_wait_us"], attrs)
	}
	if call.GetStatus().GetCode() == tracepb.Status_STATUS_CODE_ERROR {
		t.Errorf("EVALSHA span: status %v", call.GetStatus())
	}
	if call.GetStartTimeUnixNano() < check.GetStartTimeUnixNano() || call.GetEndTimeUnixNano() > check.GetEndTimeUnixNano() {
		t.Error("the Redis call's span is not within the check's")
	}
}
