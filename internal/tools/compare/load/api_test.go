package load

import (
	"bytes"
	"context"
	"encoding/json"
	"io/fs"
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
	m, err := request(Check, nil, "c1", 1)
	if err != nil {
		t.Fatal(err)
	}
	check := m.(*limiterv1.CheckRequest)
	if set.Get(check.GetRuleId()) == nil || check.GetKey() == "" {
		t.Errorf("ghz-check.json: rule %q (in the rules: %v), key %q", check.GetRuleId(), set.Get(check.GetRuleId()) != nil, check.GetKey())
	}

	// RLS: limiterd matches the descriptor to one rule, keyed by the
	// entry's value, and envoy ratelimit's config has the same limit for it.
	if m, err = request(RLS, nil, "c1", 1); err != nil {
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
	keyOf := map[API]func(m protoreflect.Message) string{
		RLS: func(m protoreflect.Message) string {
			return m.Interface().(*rlsv3.RateLimitRequest).GetDescriptors()[0].GetEntries()[0].GetValue()
		},
		Check: func(m protoreflect.Message) string { return m.Interface().(*limiterv1.CheckRequest).GetKey() },
		Gubernator: func(m protoreflect.Message) string {
			r := m.Get(m.Descriptor().Fields().ByName("requests")).List().Get(0).Message()
			return r.Get(r.Descriptor().Fields().ByName("unique_key")).String()
		},
	}
	for _, a := range []API{RLS, Check, Health, Gubernator} {
		t.Run(a.template, func(t *testing.T) {
			if !json.Valid(filled(t, a.template)) {
				t.Fatalf("%s filled is not JSON:\n%s", a.template, filled(t, a.template))
			}
			var gub *protoregistry.Files
			if a == Gubernator {
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
	for _, a := range []API{RLS, Check, Health} {
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
	envoy, err := envoyrls.New(e, envoyrls.Options{}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	rlsv3.RegisterRateLimitServiceServer(srv, envoy)
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
		ok    map[API]bool
	}{
		{"the comparison's rules", good, map[API]bool{RLS: true, Check: true, Health: true}},
		{"another limit", bytes.ReplaceAll(good, []byte("1000000"), []byte("1000")), map[API]bool{RLS: false, Check: false, Health: true}},
		{"another domain", bytes.ReplaceAll(good, []byte("domain: compare"), []byte("domain: other")), map[API]bool{RLS: false, Check: true, Health: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			conn := serve(t, tt.rules)
			ru := &Runner{}
			for a, ok := range tt.ok {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				err := ru.Verify(ctx, a, conn, 3)
				cancel()
				if (err == nil) != ok {
					t.Errorf("%s: %v, want ok %v", a.method, err, ok)
				}
			}
		})
	}
}
