package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io/fs"
	"math"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"go.yaml.in/yaml/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/frontdoor/checkapi"
	"github.com/limiterd/limiterd/internal/frontdoor/envoyrls"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

func readConfig(t *testing.T, name string) []byte {
	t.Helper()
	b, err := fs.ReadFile(configFS, "config/"+name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// filled is a request template filled as ghz fills it for one call.
func filled(t *testing.T, name string) []byte {
	t.Helper()
	b, err := fill(readConfig(t, name), "c16", 7)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return b
}

// envoyConfig has the shape of envoy ratelimit's config file (its
// config.YamlRoot), to decode ours strictly: a misspelt key is an error
// here, not a rule envoy ratelimit silently lacks.
type envoyConfig struct {
	Domain      string            `yaml:"domain"`
	Descriptors []envoyDescriptor `yaml:"descriptors"`
}

type envoyDescriptor struct {
	Key            string            `yaml:"key"`
	Value          string            `yaml:"value"`
	RateLimit      *envoyRateLimit   `yaml:"rate_limit"`
	Descriptors    []envoyDescriptor `yaml:"descriptors"`
	ShadowMode     bool              `yaml:"shadow_mode"`
	QuotaMode      bool              `yaml:"quota_mode"`
	DetailedMetric bool              `yaml:"detailed_metric"`
	ValueToMetric  bool              `yaml:"value_to_metric"`
	ShareThreshold bool              `yaml:"share_threshold"`
}

type envoyRateLimit struct {
	RequestsPerUnit uint32 `yaml:"requests_per_unit"`
	Unit            string `yaml:"unit"`
	Unlimited       bool   `yaml:"unlimited"`
	Name            string `yaml:"name"`
	Replaces        []struct {
		Name string `yaml:"name"`
	} `yaml:"replaces"`
}

func decodeEnvoy(b []byte) (*envoyConfig, error) {
	d := yaml.NewDecoder(bytes.NewReader(b))
	d.KnownFields(true)
	var c envoyConfig
	if err := d.Decode(&c); err != nil {
		return nil, err
	}
	return &c, nil
}

// limitFor is the rate limit envoy ratelimit applies to a descriptor of
// entries: each entry matches a descriptor of its key whose value is the
// entry's or empty (any value), the last one's limit applies.
func (c *envoyConfig) limitFor(domain string, entries [][2]string) *envoyRateLimit {
	if domain != c.Domain {
		return nil
	}
	level := c.Descriptors
	var last *envoyDescriptor
	for _, e := range entries {
		last = nil
		for i := range level {
			if d := &level[i]; d.Key == e[0] && (d.Value == "" || d.Value == e[1]) {
				last = d
				break
			}
		}
		if last == nil {
			return nil
		}
		level = last.Descriptors
	}
	if last == nil {
		return nil
	}
	return last.RateLimit
}

// gubernatorRequest has the fields of ghz-gubernator.json, decoded
// strictly.
type gubernatorRequest struct {
	Requests []struct {
		Name      string `json:"name"`
		UniqueKey string `json:"unique_key"`
		Hits      int64  `json:"hits"`
		Limit     int64  `json:"limit"`
		Duration  int64  `json:"duration"`
		Algorithm string `json:"algorithm"`
	} `json:"requests"`
}

// TestSameLimitEverywhere holds every system's config to the one limit,
// limitPerSecond per key per second, for the keys ghz's templates send.
func TestSameLimitEverywhere(t *testing.T) {
	set, err := rules.Parse("limiterd-rules.yml", readConfig(t, "limiterd-rules.yml"))
	if err != nil {
		t.Fatalf("limiterd rules: %v", err)
	}
	for _, r := range set.Rules() {
		l := r.Bucket()
		if l.Algorithm != bucket.TokenBucket || l.Capacity != limitPerSecond || l.RefillPerSecond != limitPerSecond || r.Shadow || r.Lease != 0 || r.Cost > 1 {
			t.Errorf("limiterd rule %s: %+v (shadow %v, lease %v, cost %v), want a token bucket of %d, refilled at %d/s, enforced, no lease, cost 1",
				r.ID, l, r.Shadow, r.Lease, r.Cost, limitPerSecond, limitPerSecond)
		}
	}

	// Check: the template names a rule of the file.
	m, err := request(apiCheck, nil, "c1", 1)
	if err != nil {
		t.Fatal(err)
	}
	check := m.(*limiterv1.CheckRequest)
	if set.Get(check.GetRuleId()) == nil || check.GetKey() == "" {
		t.Errorf("ghz-check.json: rule %q (in the rules: %v), key %q", check.GetRuleId(), set.Get(check.GetRuleId()) != nil, check.GetKey())
	}

	// RLS: limiterd matches the descriptor to one rule, keyed by the
	// entry's value, and envoy ratelimit's config has the same limit for it.
	if m, err = request(apiRLS, nil, "c1", 1); err != nil {
		t.Fatal(err)
	}
	rls := m.(*rlsv3.RateLimitRequest)
	if len(rls.GetDescriptors()) != 1 {
		t.Fatalf("ghz-rls.json: %d descriptors, want 1", len(rls.GetDescriptors()))
	}
	attrs := &rules.Attributes{Domain: rls.GetDomain(), Extra: make(map[string]string)}
	var entries [][2]string
	for _, e := range rls.GetDescriptors()[0].GetEntries() {
		attrs.Extra[e.GetKey()] = e.GetValue()
		entries = append(entries, [2]string{e.GetKey(), e.GetValue()})
	}
	matched := set.Matching(attrs)
	if len(matched) != 1 {
		t.Fatalf("ghz-rls.json's descriptor matches %d limiterd rules, want 1", len(matched))
	}
	if key, ok, err := matched[0].KeyOf(attrs); err != nil || !ok || !strings.Contains(key, entries[len(entries)-1][1]) {
		t.Errorf("limiterd rule %s keys the descriptor by %q (ok %v, %v), want its value %q", matched[0].ID, key, ok, err, entries[len(entries)-1][1])
	}
	envoy, err := decodeEnvoy(readConfig(t, "envoy-ratelimit.yaml"))
	if err != nil {
		t.Fatalf("envoy-ratelimit.yaml: %v", err)
	}
	l := envoy.limitFor(rls.GetDomain(), entries)
	if l == nil {
		t.Fatalf("envoy-ratelimit.yaml has no limit for ghz-rls.json's domain %q and entries %v", rls.GetDomain(), entries)
	}
	if l.Unit != "second" || l.RequestsPerUnit != limitPerSecond || l.Unlimited || len(l.Replaces) > 0 {
		t.Errorf("envoy ratelimit's limit %+v, want %d per second", l, limitPerSecond)
	}

	// Gubernator: the limit is in each request.
	var gub gubernatorRequest
	d := json.NewDecoder(bytes.NewReader(filled(t, "ghz-gubernator.json")))
	d.DisallowUnknownFields()
	if err := d.Decode(&gub); err != nil {
		t.Fatalf("ghz-gubernator.json: %v", err)
	}
	if len(gub.Requests) != 1 {
		t.Fatalf("ghz-gubernator.json: %d requests, want 1", len(gub.Requests))
	}
	g := gub.Requests[0]
	if g.Limit != limitPerSecond || g.Duration != 1000 || g.Hits != 1 || g.Algorithm != "TOKEN_BUCKET" || g.Name == "" || g.UniqueKey == "" {
		t.Errorf("ghz-gubernator.json: %+v, want a token bucket of %d per 1000 ms, 1 hit, a name and a key", g, limitPerSecond)
	}
}

// TestEnvoyConfigStrict: the decoder of envoy ratelimit's config refuses
// what envoy ratelimit would not read, and limitFor finds no limit where
// envoy ratelimit would apply none.
func TestEnvoyConfigStrict(t *testing.T) {
	if _, err := decodeEnvoy([]byte("domain: compare\ndescriptor:\n  - key: key\n")); err == nil {
		t.Error("a misspelt key decoded")
	}
	c, err := decodeEnvoy(readConfig(t, "envoy-ratelimit.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name    string
		domain  string
		entries [][2]string
	}{
		{"other domain", "other", [][2]string{{"key", "a"}}},
		{"other key", c.Domain, [][2]string{{"user", "a"}}},
		{"no entries", c.Domain, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if l := c.limitFor(tt.domain, tt.entries); l != nil {
				t.Errorf("limit %+v", l)
			}
		})
	}
}

// gubernatorFiles compiles config/gubernator.proto.
func gubernatorFiles(t *testing.T) *protoregistry.Files {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "gubernator.proto"), readConfig(t, "gubernator.proto"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, files, err := compileGubernator(context.Background(), dir)
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// TestTemplates: every ghz template fills into valid JSON that protojson
// decodes into its method's request message, with a new key per call and
// per run.
func TestTemplates(t *testing.T) {
	keyOf := map[api]func(m protoreflect.Message) string{
		apiRLS: func(m protoreflect.Message) string {
			return m.Interface().(*rlsv3.RateLimitRequest).GetDescriptors()[0].GetEntries()[0].GetValue()
		},
		apiCheck: func(m protoreflect.Message) string { return m.Interface().(*limiterv1.CheckRequest).GetKey() },
		apiGubernator: func(m protoreflect.Message) string {
			r := m.Get(m.Descriptor().Fields().ByName("requests")).List().Get(0).Message()
			return r.Get(r.Descriptor().Fields().ByName("unique_key")).String()
		},
	}
	for _, a := range []api{apiRLS, apiCheck, apiHealth, apiGubernator} {
		t.Run(a.template, func(t *testing.T) {
			if !json.Valid(filled(t, a.template)) {
				t.Fatalf("%s filled is not JSON:\n%s", a.template, filled(t, a.template))
			}
			var gub *protoregistry.Files
			if a == apiGubernator {
				gub = gubernatorFiles(t)
			}
			first, err := request(a, gub, "c16", 1)
			if err != nil {
				t.Fatal(err)
			}
			second, err := request(a, gub, "c16", 2)
			if err != nil {
				t.Fatal(err)
			}
			otherRun, err := request(a, gub, "c64", 1)
			if err != nil {
				t.Fatal(err)
			}
			if want := strings.Split(a.method, "/")[0]; !strings.HasPrefix(string(first.ProtoReflect().Descriptor().FullName()), want[:strings.LastIndex(want, ".")]) {
				t.Errorf("%s decodes into %s, not a message of %s", a.template, first.ProtoReflect().Descriptor().FullName(), want)
			}
			if key := keyOf[a]; key != nil {
				k1, k2, k3 := key(first.ProtoReflect()), key(second.ProtoReflect()), key(otherRun.ProtoReflect())
				if k1 == "" || k1 == k2 {
					t.Errorf("%s: keys %q and %q, want a new key per call", a.template, k1, k2)
				}
				if k1 == k3 {
					t.Errorf("%s: call 1 of two runs has key %q in both, want a new key per run", a.template, k1)
				}
			}
		})
	}
}

// TestProtoset: the FileDescriptorSet ghz reads resolves and has every
// method the rows call.
func TestProtoset(t *testing.T) {
	set, err := protoset(nil)
	if err != nil {
		t.Fatal(err)
	}
	files, err := protodesc.NewFiles(set)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range []api{apiRLS, apiCheck, apiHealth} {
		svc, method, _ := strings.Cut(a.method, "/")
		d, err := files.FindDescriptorByName(protoreflect.FullName(svc))
		if err != nil {
			t.Errorf("%s: %v", a.method, err)
			continue
		}
		if d.(protoreflect.ServiceDescriptor).Methods().ByName(protoreflect.Name(method)) == nil {
			t.Errorf("%s: no method %s", svc, method)
		}
	}
}

// TestProtosetGubernator: with gubernator's compiled .proto, the set has
// its method too, and an answer is read as the run reads it.
func TestProtosetGubernator(t *testing.T) {
	gub := gubernatorFiles(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "gubernator.proto"), readConfig(t, "gubernator.proto"), 0o644); err != nil {
		t.Fatal(err)
	}
	gset, _, err := compileGubernator(context.Background(), dir)
	if err != nil {
		t.Fatal(err)
	}
	set, err := protoset(gset)
	if err != nil {
		t.Fatal(err)
	}
	files, err := protodesc.NewFiles(set)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := files.FindDescriptorByName("pb.gubernator.V1.GetRateLimits"); err != nil {
		t.Error(err)
	}
	answer := func(status int32, msg string, limit int64) *dynamicpb.Message {
		resp, err := gubernatorMessage(gub, "GetRateLimitsResp")
		if err != nil {
			t.Fatal(err)
		}
		r, err := gubernatorMessage(gub, "RateLimitResp")
		if err != nil {
			t.Fatal(err)
		}
		f := r.Descriptor().Fields()
		r.Set(f.ByName("status"), protoreflect.ValueOfEnum(protoreflect.EnumNumber(status)))
		r.Set(f.ByName("error"), protoreflect.ValueOfString(msg))
		r.Set(f.ByName("limit"), protoreflect.ValueOfInt64(limit))
		list := resp.Mutable(resp.Descriptor().Fields().ByName("responses")).List()
		list.Append(protoreflect.ValueOfMessage(r))
		return resp
	}
	for _, tt := range []struct {
		name string
		resp *dynamicpb.Message
		ok   bool
	}{
		{"under limit", answer(0, "", limitPerSecond), true},
		{"over limit", answer(1, "", limitPerSecond), false},
		{"error", answer(0, "no peers", limitPerSecond), false},
		{"another limit", answer(0, "", 10), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if err := checkGubernator(tt.resp); (err == nil) != tt.ok {
				t.Errorf("checkGubernator: %v, want ok %v", err, tt.ok)
			}
		})
	}
}

// serve runs limiter.v1, Envoy RLS v3 and the health check over an engine
// on the embedded store with the rules of yml, on an in-memory listener.
func serve(t *testing.T, yml []byte) *grpc.ClientConn {
	t.Helper()
	set, err := rules.Parse("rules.yml", yml)
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(engine.Options{Store: bucket.NewMemory()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	limiterv1.RegisterLimiterServer(srv, checkapi.New(e))
	rlsv3.RegisterRateLimitServiceServer(srv, envoyrls.New(e, envoyrls.Options{}))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	lis := bufconn.Listen(1 << 20)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("passthrough:///compare", grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestVerify: the checks of the answers pass for limiterd with the
// comparison's rules, and fail when its limit is another or no rule
// matches: what tells a run whose answers did not come from its config.
func TestVerify(t *testing.T) {
	good := readConfig(t, "limiterd-rules.yml")
	tests := []struct {
		name  string
		rules []byte
		ok    map[api]bool
	}{
		{"the comparison's rules", good, map[api]bool{apiRLS: true, apiCheck: true, apiHealth: true}},
		{"another limit", bytes.ReplaceAll(good, []byte("1000000"), []byte("1000")), map[api]bool{apiRLS: false, apiCheck: false, apiHealth: true}},
		{"another domain", bytes.ReplaceAll(good, []byte("domain: compare"), []byte("domain: other")), map[api]bool{apiRLS: false, apiCheck: true, apiHealth: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			conn := serve(t, tt.rules)
			e := &env{}
			for a, ok := range tt.ok {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				err := e.verify(ctx, a, conn, 3)
				cancel()
				if (err == nil) != ok {
					t.Errorf("%s: %v, want ok %v", a.method, err, ok)
				}
			}
		})
	}
}

func TestDecisionsMoved(t *testing.T) {
	before := map[[2]string]float64{{"compare", "allowed"}: 10, {"compare", "fallback_allowed"}: 2}
	tests := []struct {
		name    string
		after   map[[2]string]float64
		decides bool
		calls   uint64
		ok      bool
	}{
		{"all allowed", map[[2]string]float64{{"compare", "allowed"}: 110, {"compare", "fallback_allowed"}: 2}, true, 100, true},
		{"one more decided than counted", map[[2]string]float64{{"compare", "allowed"}: 111, {"compare", "fallback_allowed"}: 2}, true, 100, true},
		{"fallback", map[[2]string]float64{{"compare", "allowed"}: 110, {"compare", "fallback_allowed"}: 3}, true, 100, false},
		{"limited", map[[2]string]float64{{"compare", "allowed"}: 110, {"compare", "fallback_allowed"}: 2, {"compare", "limited"}: 1}, true, 100, false},
		{"fewer decided than OK calls", map[[2]string]float64{{"compare", "allowed"}: 100, {"compare", "fallback_allowed"}: 2}, true, 100, false},
		{"health decides nothing", map[[2]string]float64{{"compare", "allowed"}: 10, {"compare", "fallback_allowed"}: 2}, false, 100, true},
		{"health with decisions", map[[2]string]float64{{"compare", "allowed"}: 11, {"compare", "fallback_allowed"}: 2}, false, 100, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if msg := decisionsMoved(before, tt.after, tt.decides, tt.calls); (msg == "") != tt.ok {
				t.Errorf("decisionsMoved: %q, want ok %v", msg, tt.ok)
			}
		})
	}
}

func TestNotOK(t *testing.T) {
	tests := []struct {
		name string
		rep  ghzReport
		ok   bool
	}{
		{"all OK", ghzReport{Count: 5, StatusCodeDist: map[string]int{"OK": 5}}, true},
		{"one unavailable", ghzReport{Count: 5, StatusCodeDist: map[string]int{"OK": 4, "Unavailable": 1}, ErrorDist: map[string]int{"transport is closing": 1}}, false},
		{"no calls", ghzReport{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if msg := tt.rep.notOK(); (msg == "") != tt.ok {
				t.Errorf("notOK: %q, want ok %v", msg, tt.ok)
			}
		})
	}
}

func TestParseStat(t *testing.T) {
	// A name with a space and a parenthesis; utime 1234, stime 56.
	line := "4242 (redis-server ) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 1234 56 0 0 20 0 5 0 100 1000 200\n"
	got, err := parseStat([]byte(line))
	if err != nil || got != 1290 {
		t.Errorf("parseStat: %d, %v; want 1290", got, err)
	}
	if _, err := parseStat([]byte("4242 no name")); err == nil {
		t.Error("parseStat of a line without a name: no error")
	}
	if _, err := cpuTicks(os.Getpid()); err != nil {
		t.Errorf("cpuTicks of this process: %v", err)
	}
}

func TestCommandStats(t *testing.T) {
	info := "# Commandstats\r\ncmdstat_evalsha:calls=300,usec=2700,usec_per_call=9.00,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_config|resetstat:calls=1,usec=10,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n"
	got := commandStats(info)
	if c := got["evalsha"]; c.calls != 300 || c.usec != 2700 {
		t.Errorf("evalsha: %+v", c)
	}
	if c := got["config|resetstat"]; c.calls != 1 || c.usec != 10 {
		t.Errorf("config|resetstat: %+v", c)
	}
	if len(got) != 2 {
		t.Errorf("%d commands, want 2: %v", len(got), got)
	}
}

// TestToolStamp: a pinned tool counts as installed only with its binary
// and a stamp of its version.
func TestToolStamp(t *testing.T) {
	dir := t.TempDir()
	tl := tool{bin: "x", pkg: "example.com/x", version: "v1.2.3"}
	if tl.installed(dir) {
		t.Fatal("installed in an empty folder")
	}
	if err := os.WriteFile(filepath.Join(dir, "x"), nil, 0o755); err != nil {
		t.Fatal(err)
	}
	if tl.installed(dir) {
		t.Error("installed without a stamp")
	}
	if err := os.WriteFile(tl.stamp(dir), []byte("example.com/x@v1.2.2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if tl.installed(dir) {
		t.Error("installed with the stamp of another version")
	}
	if err := os.WriteFile(tl.stamp(dir), []byte(tl.String()+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if !tl.installed(dir) {
		t.Error("not installed with its binary and stamp")
	}
}

// TestPerRound: a ratio is taken within each round where both rows
// counted, and its median reported.
func TestPerRound(t *testing.T) {
	res := make(results)
	for round, v := range [][2]float64{{200, 100}, {300, 100}, {900, 0}, {150, 100}} {
		a, b := sample{rps: v[0]}, sample{rps: v[1]}
		if v[1] == 0 {
			b.failed = "codes: Unavailable 1"
		}
		res.add(1, round, map[int]sample{64: a})
		res.add(3, round, map[int]sample{64: b})
	}
	got := res.perRound(1, 3, 64, func(x, y sample) float64 { return x.rps / y.rps })
	if got != 2 {
		t.Errorf("perRound: %v, want the median of 2, 3 and 1.5: 2", got)
	}
	if got := res.perRound(1, 5, 64, func(x, y sample) float64 { return 1 }); !math.IsNaN(got) {
		t.Errorf("perRound with a row not run: %v, want NaN", got)
	}
}
