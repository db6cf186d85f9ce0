package envoyrls

import (
	"context"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// envoyDesc is a descriptor of key, value pairs.
func envoyDesc(kv ...string) *ratelimitv3.RateLimitDescriptor {
	d := &ratelimitv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

// TestEnvoyAttributes: how a descriptor maps onto attributes and a cost.
func TestEnvoyAttributes(t *testing.T) {
	withHits := func(d *ratelimitv3.RateLimitDescriptor, n uint64) *ratelimitv3.RateLimitDescriptor {
		d.HitsAddend = wrapperspb.UInt64(n)
		return d
	}
	tests := []struct {
		name string
		desc *ratelimitv3.RateLimitDescriptor
		want rules.Attributes
		cost float64
	}{
		{
			name: "well-known keys",
			desc: envoyDesc("remote_address", "2001:db8::1", ":path", "/a/b?c=d", "method", "POST", "api_key", "k", "user", "u", "plan", "pro"),
			want: rules.Attributes{IP: "2001:db8::1", Path: "/a/b", Method: "POST", APIKey: "k", User: "u", Plan: "pro"},
			cost: 2,
		},
		{
			name: "other keys only extra",
			desc: envoyDesc("generic_key", "g", "x-tenant", "t"),
			cost: 2,
		},
		{
			name: "the later of path and :path",
			desc: envoyDesc("path", "/one", ":method", "GET", ":path", "/two"),
			want: rules.Attributes{Path: "/two", Method: "GET"},
			cost: 2,
		},
		{
			name: "descriptor hits_addend",
			desc: withHits(envoyDesc("generic_key", "g"), 7),
			cost: 7,
		},
		{
			name: "descriptor hits_addend 0 keeps the request's",
			desc: withHits(envoyDesc("generic_key", "g"), 0),
			cost: 2,
		},
	}
	// One Attributes for every case, in turn, as one request maps its
	// descriptors: nothing of a descriptor is left for the next.
	a := &rules.Attributes{Domain: "edge", Extra: map[string]string{}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var priority string
			cost, err := envoyAttributes(a, tt.desc, 2, &priority)
			if err != nil {
				t.Fatal(err)
			}
			if a.Domain != "edge" || a.IP != tt.want.IP || a.Path != tt.want.Path || a.Method != tt.want.Method ||
				a.APIKey != tt.want.APIKey || a.User != tt.want.User || a.Plan != tt.want.Plan || cost != tt.cost {
				t.Fatalf("attributes %+v, cost %v; want %+v, cost %v", a, cost, tt.want, tt.cost)
			}
			if len(a.Extra) != len(tt.desc.GetEntries()) {
				t.Fatalf("extra %v, want the %d entries of the descriptor", a.Extra, len(tt.desc.GetEntries()))
			}
			for _, e := range tt.desc.GetEntries() {
				if a.Extra[e.GetKey()] != e.GetValue() {
					t.Fatalf("extra %v lacks %s=%s", a.Extra, e.GetKey(), e.GetValue())
				}
			}
		})
	}
}

// TestEnvoyLimitUnits: a limit is in the unit its window is, or scaled.
func TestEnvoyLimitUnits(t *testing.T) {
	const (
		second = rlsv3.RateLimitResponse_RateLimit_SECOND
		minute = rlsv3.RateLimitResponse_RateLimit_MINUTE
		hour   = rlsv3.RateLimitResponse_RateLimit_HOUR
		day    = rlsv3.RateLimitResponse_RateLimit_DAY
	)
	tests := []struct {
		name     string
		limit    float64
		window   time.Duration
		perUnit  uint32
		wantUnit rlsv3.RateLimitResponse_RateLimit_Unit
	}{
		{"a second", 10, time.Second, 10, second},
		{"a minute", 100, time.Minute, 100, minute},
		{"an hour", 5, time.Hour, 5, hour},
		{"a day", 1000, 24 * time.Hour, 1000, day},
		{"fractional limit rounds down", 2.5, time.Minute, 2, minute},
		{"10s scaled to seconds", 100, 10 * time.Second, 10, second},
		{"90s under 1/s scaled to minutes", 5, 90 * time.Second, 3, minute},
		{"a week scaled to days", 70, 7 * 24 * time.Hour, 10, day},
		{"under 1 a day is 1 a day", 5, 5_000_000 * time.Second, 1, day},
		{"above uint32", 1e12, time.Second, math.MaxUint32, second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			perUnit, unit := envoyLimit(tt.limit, tt.window.Milliseconds())
			if perUnit != tt.perUnit || unit != tt.wantUnit {
				t.Fatalf("envoyLimit(%v per %v) = %d per %v, want %d per %v", tt.limit, tt.window, perUnit, unit, tt.perUnit, tt.wantUnit)
			}
		})
	}
}

// TestRequestBounds: a request over the descriptor, entry or value bounds
// is refused as invalid, naming the field, before anything is matched (one
// request of 100k descriptors once cost 3.8 CPU-seconds).
func TestRequestBounds(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte("rules:\n  - id: r\n    capacity: 10\n    refill_per_second: 1\n    match: {domain: edge}\n    key_by: attr:k\n"))
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(engine.Options{Store: bucket.NewMemory()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(e, Options{QuotaHeaders: true}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	many := func(n int) []*ratelimitv3.RateLimitDescriptor {
		out := make([]*ratelimitv3.RateLimitDescriptor, n)
		for i := range out {
			out[i] = envoyDesc("k", strconv.Itoa(i))
		}
		return out
	}
	wide := envoyDesc()
	for i := range MaxEntries + 1 {
		wide.Entries = append(wide.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: "e" + strconv.Itoa(i), Value: "v"})
	}
	tests := []struct {
		name string
		desc []*ratelimitv3.RateLimitDescriptor
		want codes.Code
	}{
		{"at the descriptor bound", many(MaxDescriptors), codes.OK},
		{"over the descriptor bound", many(MaxDescriptors + 1), codes.InvalidArgument},
		{"over the entry bound", []*ratelimitv3.RateLimitDescriptor{wide}, codes.InvalidArgument},
		{"a value over its bound", []*ratelimitv3.RateLimitDescriptor{envoyDesc("k", strings.Repeat("x", MaxValueBytes+1))}, codes.InvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: tt.desc})
			if status.Code(err) != tt.want {
				t.Fatalf("ShouldRateLimit = %v, want %v", err, tt.want)
			}
		})
	}
}

// TestInvalidNamesTheField: an invalid descriptor is refused with a
// message naming it and its field, whichever descriptor of the request it
// is (the attributes of one are reused for the next).
func TestInvalidNamesTheField(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte("rules:\n  - id: r\n    capacity: 10\n    refill_per_second: 1\n    match: {domain: edge}\n    key_by: ip\n"))
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
	negative := envoyDesc("generic_key", "g")
	negative.IsNegativeHits = true
	ok := envoyDesc("generic_key", "g", "remote_address", "192.0.2.1")
	tests := []struct {
		name   string
		desc   []*ratelimitv3.RateLimitDescriptor
		prefix string
	}{
		{"no entries", []*ratelimitv3.RateLimitDescriptor{ok, {}}, "descriptors[1].entries: "},
		{"empty key", []*ratelimitv3.RateLimitDescriptor{envoyDesc("", "v")}, "descriptors[0].entries[0].key: empty"},
		{"key twice", []*ratelimitv3.RateLimitDescriptor{ok, envoyDesc("a", "1", "b", "2", "a", "3")}, `descriptors[1].entries[2].key: "a" given twice`},
		{"a key of the previous descriptor", []*ratelimitv3.RateLimitDescriptor{ok, envoyDesc("generic_key", "g", "generic_key", "h")}, "descriptors[1].entries[1].key: "},
		{"negative hits", []*ratelimitv3.RateLimitDescriptor{ok, ok, negative}, "descriptors[2].is_negative_hits: "},
		{"bad address", []*ratelimitv3.RateLimitDescriptor{ok, envoyDesc("remote_address", "not-an-ip")}, `descriptors[1]: attributes.ip: "not-an-ip" is not an IP address`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: tt.desc})
			if status.Code(err) != codes.InvalidArgument || !strings.HasPrefix(status.Convert(err).Message(), tt.prefix) {
				t.Fatalf("ShouldRateLimit = %v, want InvalidArgument starting with %q", err, tt.prefix)
			}
		})
	}
	// The same descriptors, valid, still map as before.
	resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{
		ok, envoyDesc("generic_key", "g")}})
	if err != nil || resp.GetStatuses()[0].GetCurrentLimit().GetName() != "r" || resp.GetStatuses()[1].GetCurrentLimit() != nil {
		t.Fatalf("valid: %v, %v; want the rule for the first descriptor only (the second has no address)", resp, err)
	}
}
