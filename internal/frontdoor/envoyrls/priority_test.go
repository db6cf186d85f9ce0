package envoyrls

import (
	"context"
	"strings"
	"testing"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestEnvoyPriority: a descriptor entry priority is the request's class,
// not an attribute; a refusal for the reserve of the classes above it is
// OVER_LIMIT with x-ratelimit-reason: reserved and retry-after, which a
// refusal for the limit has not.
func TestEnvoyPriority(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte(`rules:
  - id: shed
    capacity: 10
    refill_per_second: 0.01
    match: {domain: edge}
    key_by: global
    reserve: {critical: 0.5}
  - id: by-priority
    capacity: 10
    refill_per_second: 1
    match: {domain: edge, attributes: {priority: critical}}
    key_by: global
`))
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(engine.Options{Store: bucket.NewMemory()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(e, Options{}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	check := func(priority string, hits uint32) *rlsv3.RateLimitResponse {
		t.Helper()
		descs := []*ratelimitv3.RateLimitDescriptor{envoyDesc("generic_key", "g")}
		if priority != "" {
			descs = append(descs, envoyDesc("priority", priority))
		}
		resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: descs, HitsAddend: hits})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	headers := func(resp *rlsv3.RateLimitResponse) map[string]string {
		m := map[string]string{}
		for _, h := range resp.GetResponseHeadersToAdd() {
			m[h.GetKey()] = h.GetValue()
		}
		return m
	}
	if resp := check("sheddable", 5); resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
		t.Fatalf("sheddable 5 of 10: %v", resp)
	}
	for _, st := range check("critical", 0).GetStatuses() {
		if st.GetCurrentLimit().GetName() == "by-priority" {
			t.Fatal("the priority entry matched a rule as an attribute")
		}
	}
	resp := check("", 1) // default keeps critical's half: 4 left
	if h := headers(resp); resp.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT || h["x-ratelimit-reason"] != "reserved" || h["retry-after"] == "" {
		t.Fatalf("default into critical's reserve: %v, headers %v; want OVER_LIMIT, reserved, retry-after", resp, h)
	}
	if resp := check("critical", 4); resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
		t.Fatalf("critical 4 of 4: %v", resp)
	}
	resp = check("critical", 1)
	if h := headers(resp); resp.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT || h["x-ratelimit-reason"] != "" {
		t.Fatalf("critical on empty: %v, headers %v; want OVER_LIMIT for the limit, no reason", resp, h)
	}
	for name, descs := range map[string][]*ratelimitv3.RateLimitDescriptor{
		"two classes": {envoyDesc("generic_key", "g", "priority", "critical"), envoyDesc("priority", "sheddable")},
		"too long":    {envoyDesc("generic_key", "g", "priority", strings.Repeat("c", rules.MaxClassLen+1))},
	} {
		_, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: descs})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), "priority") {
			t.Errorf("%s: %v, want InvalidArgument naming priority", name, err)
		}
	}
}
