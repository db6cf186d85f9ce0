package envoyrls

import (
	"context"
	"strconv"
	"testing"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/frontdoor/checkapi"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// benchRules is one rule as Envoy's example uses it, [generic_key=per-ip,
// remote_address=IP], large enough (and refilled faster than a benchmark
// spends) that every check is allowed.
const benchRules = `rules:
  - id: per-ip
    capacity: 1e9
    refill_per_second: 1e6
    key_by: ip
    match: {domain: edge, attributes: {generic_key: per-ip}}
`

// benchKeys is how many client addresses the new-key shape cycles through.
const benchKeys = 1 << 16

func benchEngine(b *testing.B) *engine.Engine {
	b.Helper()
	set, err := rules.Parse("bench.yml", []byte(benchRules))
	if err != nil {
		b.Fatal(err)
	}
	e, err := engine.New(engine.Options{Store: bucket.NewMemory()}, set, prometheus.NewRegistry())
	if err != nil {
		b.Fatal(err)
	}
	return e
}

// benchAddrs are the client addresses of the shapes: one address for every
// check (same-key), or a new one for each (new-key, from benchKeys).
func benchAddrs() map[string][]string {
	many := make([]string, benchKeys)
	for i := range many {
		many[i] = "10." + strconv.Itoa(i>>8) + "." + strconv.Itoa(i&0xff) + ".1"
	}
	return map[string][]string{"same-key": {"192.0.2.1"}, "new-key": many}
}

var benchShapes = []string{"same-key", "new-key"}

// BenchmarkShouldRateLimit is the in-process cost of an Envoy request of
// one descriptor matching one rule, on the embedded store, without quota
// headers (the default) and with them; resp-B is the encoded answer,
// marshal its encoding and unmarshal the request's decoding, which gRPC
// does around the service. BenchmarkCheckByAttributes is the same decision
// through limiter.v1.Limiter/Check; without headers the two should cost
// about the same.
//
//	go test -run '^$' -bench 'ShouldRateLimit|Check' -benchmem ./internal/frontdoor/envoyrls
func BenchmarkShouldRateLimit(b *testing.B) {
	e := benchEngine(b)
	ctx := context.Background()
	addrs := benchAddrs()
	for _, opts := range []Options{{}, {QuotaHeaders: true}} {
		s, err := New(e, opts, prometheus.NewRegistry())
		if err != nil {
			b.Fatal(err)
		}
		prefix := ""
		if opts.QuotaHeaders {
			prefix = "headers/"
		}
		for _, shape := range benchShapes {
			b.Run(prefix+shape, func(b *testing.B) {
				reqs := make([]*rlsv3.RateLimitRequest, len(addrs[shape]))
				for i, a := range addrs[shape] {
					reqs[i] = &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{
						envoyDesc("generic_key", "per-ip", "remote_address", a)}}
				}
				var resp *rlsv3.RateLimitResponse
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					var err error
					if resp, err = s.ShouldRateLimit(ctx, reqs[i%len(reqs)]); err != nil {
						b.Fatal(err)
					}
					i++
				}
				if resp.GetOverallCode() != rlsv3.RateLimitResponse_OK || len(resp.GetResponseHeadersToAdd()) > 0 != opts.QuotaHeaders {
					b.Fatalf("answer %v, want OK, headers %v", resp, opts.QuotaHeaders)
				}
				b.ReportMetric(float64(proto.Size(resp)), "resp-B")
			})
		}
		b.Run(prefix+"marshal", func(b *testing.B) {
			resp, err := s.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{
				envoyDesc("generic_key", "per-ip", "remote_address", "192.0.2.1")}})
			if err != nil {
				b.Fatal(err)
			}
			benchMarshal(b, resp)
		})
	}
	b.Run("unmarshal", func(b *testing.B) {
		benchUnmarshal(b, &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{
			envoyDesc("generic_key", "per-ip", "remote_address", "192.0.2.1")}}, &rlsv3.RateLimitRequest{})
	})
}

// BenchmarkCheckByAttributes: the decision of BenchmarkShouldRateLimit, by
// a Check of the descriptor's attributes.
func BenchmarkCheckByAttributes(b *testing.B) {
	s := checkapi.New(benchEngine(b))
	ctx := context.Background()
	addrs := benchAddrs()
	for _, shape := range benchShapes {
		b.Run(shape, func(b *testing.B) {
			reqs := make([]*limiterv1.CheckRequest, len(addrs[shape]))
			for i, a := range addrs[shape] {
				reqs[i] = &limiterv1.CheckRequest{Attributes: &limiterv1.Attributes{Domain: "edge", Ip: a,
					Extra: map[string]string{"generic_key": "per-ip", "remote_address": a}}}
			}
			var resp *limiterv1.CheckResponse
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				var err error
				if resp, err = s.Check(ctx, reqs[i%len(reqs)]); err != nil {
					b.Fatal(err)
				}
				i++
			}
			if !resp.GetAllowed() {
				b.Fatalf("answer %v, want allowed", resp)
			}
			b.ReportMetric(float64(proto.Size(resp)), "resp-B")
		})
	}
	b.Run("marshal", func(b *testing.B) {
		resp, err := s.Check(ctx, &limiterv1.CheckRequest{Attributes: &limiterv1.Attributes{Domain: "edge", Ip: "192.0.2.1",
			Extra: map[string]string{"generic_key": "per-ip", "remote_address": "192.0.2.1"}}})
		if err != nil {
			b.Fatal(err)
		}
		benchMarshal(b, resp)
	})
	b.Run("unmarshal", func(b *testing.B) {
		benchUnmarshal(b, &limiterv1.CheckRequest{Attributes: &limiterv1.Attributes{Domain: "edge", Ip: "192.0.2.1",
			Extra: map[string]string{"generic_key": "per-ip", "remote_address": "192.0.2.1"}}}, &limiterv1.CheckRequest{})
	})
}

// benchMarshal is the cost of encoding m, as gRPC does for an answer.
func benchMarshal(b *testing.B, m proto.Message) {
	b.ReportAllocs()
	for b.Loop() {
		if _, err := proto.Marshal(m); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(proto.Size(m)), "resp-B")
}

// benchUnmarshal is the cost of decoding req into into, as gRPC does for
// a request before the service sees it; req-B is its size.
func benchUnmarshal(b *testing.B, req, into proto.Message) {
	wire, err := proto.Marshal(req)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		proto.Reset(into)
		if err := proto.Unmarshal(wire, into); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(len(wire)), "req-B")
}
