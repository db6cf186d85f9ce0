package envoyrls

import (
	"context"
	"testing"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// requestLimitRules: "allowed" honours a descriptor's limit up to 10
// requests per second, "fixed" never does; both allow 3 per key, hardly
// refilled, and "window" is a window rule that honours one.
const requestLimitRules = `rules:
  - id: allowed
    capacity: 3
    refill_per_second: 0.0001
    allow_request_limit: true
    request_limit_max: 10
    match: {domain: allowed}
    key_by: attr:k
  - id: fixed
    capacity: 3
    refill_per_second: 0.0001
    match: {domain: fixed}
    key_by: attr:k
  - id: window
    algorithm: fixed_window
    limit: 3
    window: 1h
    allow_request_limit: true
    request_limit_max: 1
    match: {domain: window}
    key_by: attr:k
`

// A descriptor's limit replaces the rule's only under a rule with
// allow_request_limit, and only up to its request_limit_max; otherwise the
// rule's limit decides and the ignored limit is counted by reason.
func TestDescriptorLimit(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte(requestLimitRules))
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
	limit := func(n uint32, unit typev3.RateLimitUnit) *ratelimitv3.RateLimitDescriptor_RateLimitOverride {
		return &ratelimitv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: n, Unit: unit}
	}
	tests := []struct {
		name, domain, key string
		limit             *ratelimitv3.RateLimitDescriptor_RateLimitOverride
		admitted          int
		reported          uint32 // current_limit's requests_per_unit of the last answer
		ignored           string // the reason counted once per request, or ""
	}{
		{name: "no limit sent", domain: "allowed", key: "a", admitted: 3},
		{name: "honoured", domain: "allowed", key: "b", limit: limit(6, typev3.RateLimitUnit_MINUTE), admitted: 6, reported: 6},
		{name: "at the ceiling", domain: "allowed", key: "c", limit: limit(10, typev3.RateLimitUnit_SECOND), admitted: 10, reported: 10},
		{name: "above the ceiling", domain: "allowed", key: "d", limit: limit(11, typev3.RateLimitUnit_SECOND), admitted: 3, ignored: IgnoredAboveMax},
		{name: "not allowed", domain: "fixed", key: "e", limit: limit(6, typev3.RateLimitUnit_MINUTE), admitted: 3, ignored: IgnoredNotAllowed},
		{name: "no unit", domain: "allowed", key: "f", limit: limit(6, typev3.RateLimitUnit_UNKNOWN), admitted: 3, ignored: IgnoredInvalid},
		{name: "a window rule", domain: "window", key: "g", limit: limit(5, typev3.RateLimitUnit_HOUR), admitted: 5, reported: 5},
		{name: "a window rule above the ceiling", domain: "window", key: "h", limit: limit(5, typev3.RateLimitUnit_SECOND), admitted: 3, ignored: IgnoredAboveMax},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := map[string]float64{}
			for _, r := range []string{IgnoredNotAllowed, IgnoredAboveMax, IgnoredInvalid} {
				before[r] = testutil.ToFloat64(s.ignored[r])
			}
			const sent = 12
			admitted := 0
			var last *rlsv3.RateLimitResponse
			for range sent {
				d := envoyDesc("k", tt.key)
				d.Limit = tt.limit
				resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: tt.domain, Descriptors: []*ratelimitv3.RateLimitDescriptor{d}})
				if err != nil {
					t.Fatal(err)
				}
				if resp.GetOverallCode() == rlsv3.RateLimitResponse_OK {
					admitted++
				}
				last = resp
			}
			if admitted != tt.admitted {
				t.Errorf("%d of %d admitted, want %d", admitted, sent, tt.admitted)
			}
			if got := last.GetStatuses()[0].GetCurrentLimit().GetRequestsPerUnit(); tt.reported != 0 && got != tt.reported {
				t.Errorf("current_limit %d requests per unit, want %d", got, tt.reported)
			}
			for r, was := range before {
				want := was
				if r == tt.ignored {
					want += sent
				}
				if got := testutil.ToFloat64(s.ignored[r]); got != want {
					t.Errorf("ignored{reason=%q} = %v, want %v", r, got, want)
				}
			}
		})
	}
}

// A unit multiplier stretches the unit: 10 per 2 minutes is under a
// ceiling of 0.1 per second, 10 a minute is not.
func TestDescriptorLimitMultiplier(t *testing.T) {
	r, err := rules.ParseRule([]byte("id: r\ncapacity: 3\nrefill_per_second: 1\nallow_request_limit: true\nrequest_limit_max: 0.1\n"), rules.SourceAdmin)
	if err != nil {
		t.Fatal(err)
	}
	set, err := rules.Build([]*rules.Rule{r})
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
	for _, tt := range []struct {
		multiplier uint32
		want       float64
	}{{2, 10}, {1, 3}} {
		c := e.NewCheck()
		it, err := c.AddRule("r", "k", 1)
		if err != nil {
			t.Fatal(err)
		}
		l := &ratelimitv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 10, Unit: typev3.RateLimitUnit_MINUTE, UnitMultiplier: wrapperspb.UInt32(tt.multiplier)}
		s.useLimit(1, l, c.Enforced())
		if got := it.Limit().Capacity; got != tt.want {
			t.Errorf("10 per %d minutes: capacity %v, want %v", tt.multiplier, got, tt.want)
		}
	}
}
