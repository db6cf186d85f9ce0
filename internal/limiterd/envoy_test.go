package limiterd

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

const envoyRulesFile = "testdata/envoy_rules.yml"

// envoyDesc is a descriptor of key, value pairs.
func envoyDesc(kv ...string) *ratelimitv3.RateLimitDescriptor {
	d := &ratelimitv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

// envoyHeader returns the values of the response header name.
func envoyHeader(resp *rlsv3.RateLimitResponse, name string) []string {
	var out []string
	for _, h := range resp.GetResponseHeadersToAdd() {
		if h.GetKey() == strings.ToLower(name) {
			out = append(out, h.GetValue())
		}
	}
	return out
}

// envoyIntHeader returns the one integer value of a response header.
func envoyIntHeader(t *testing.T, resp *rlsv3.RateLimitResponse, name string) int64 {
	t.Helper()
	vs := envoyHeader(resp, name)
	if len(vs) != 1 {
		t.Fatalf("header %s: %q, want one value; headers %v", name, vs, resp.GetResponseHeadersToAdd())
	}
	n, err := strconv.ParseInt(vs[0], 10, 64)
	if err != nil {
		t.Fatalf("header %s: %v", name, err)
	}
	return n
}

// TestEnvoyRateLimitService drives the Envoy rate limit service with
// go-control-plane's client against a limiterd on a real Redis Cluster,
// with the quota headers (--envoy.quota-headers).
func TestEnvoyRateLimitService(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	d := startDaemon(t, c.Addrs(), func(o *Options) {
		o.Rules.File = envoyRulesFile
		o.Server.EnvoyQuotaHeaders = true
	})
	client := rlsv3.NewRateLimitServiceClient(dial(t, d.GRPCAddr()))
	ctx := context.Background()
	call := func(t *testing.T, req *rlsv3.RateLimitRequest) *rlsv3.RateLimitResponse {
		t.Helper()
		resp, err := client.ShouldRateLimit(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.GetStatuses()) != len(req.GetDescriptors()) {
			t.Fatalf("%d statuses for %d descriptors: %v", len(resp.GetStatuses()), len(req.GetDescriptors()), resp)
		}
		return resp
	}
	edge := func(hits uint32, descs ...*ratelimitv3.RateLimitDescriptor) *rlsv3.RateLimitRequest {
		return &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: descs, HitsAddend: hits}
	}

	t.Run("ok then over limit", func(t *testing.T) {
		desc := envoyDesc("generic_key", "per-ip", "remote_address", "192.0.2.1")
		wantLimit := &rlsv3.RateLimitResponse_RateLimit{Name: "envoy-ip", RequestsPerUnit: 3, Unit: rlsv3.RateLimitResponse_RateLimit_MINUTE}
		for i := range 3 {
			before := time.Now()
			resp := call(t, edge(0, desc))
			after := time.Now()
			st := resp.GetStatuses()[0]
			if resp.GetOverallCode() != rlsv3.RateLimitResponse_OK || st.GetCode() != rlsv3.RateLimitResponse_OK ||
				!proto.Equal(st.GetCurrentLimit(), wantLimit) || st.GetLimitRemaining() != uint32(2-i) {
				t.Fatalf("check %d: %v; want OK, limit %v, %d remaining", i, resp, wantLimit, 2-i)
			}
			if reset := st.GetDurationUntilReset().AsDuration(); reset <= 0 || reset > 2*time.Minute {
				t.Fatalf("check %d: duration_until_reset %v", i, reset)
			}
			if got := envoyIntHeader(t, resp, "RateLimit-Limit"); got != 3 {
				t.Errorf("check %d: RateLimit-Limit %d", i, got)
			}
			if got := envoyIntHeader(t, resp, "X-RateLimit-Limit"); got != 3 {
				t.Errorf("check %d: X-RateLimit-Limit %d", i, got)
			}
			if got := envoyIntHeader(t, resp, "RateLimit-Remaining"); got != int64(2-i) {
				t.Errorf("check %d: RateLimit-Remaining %d", i, got)
			}
			if got := envoyIntHeader(t, resp, "X-RateLimit-Remaining"); got != int64(2-i) {
				t.Errorf("check %d: X-RateLimit-Remaining %d", i, got)
			}
			reset := envoyIntHeader(t, resp, "RateLimit-Reset")
			if reset < 1 || reset > 120 {
				t.Errorf("check %d: RateLimit-Reset %d, want seconds in [1, 120]", i, reset)
			}
			if at := envoyIntHeader(t, resp, "X-RateLimit-Reset"); at < before.Unix() || at > after.Unix()+reset+1 {
				t.Errorf("check %d: X-RateLimit-Reset %d, want a Unix time in [%d, %d]", i, at, before.Unix(), after.Unix()+reset+1)
			}
			if v := envoyHeader(resp, "Retry-After"); v != nil {
				t.Errorf("check %d: Retry-After %q on an allowed request", i, v)
			}
		}
		resp := call(t, edge(0, desc))
		st := resp.GetStatuses()[0]
		if resp.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT || st.GetCode() != rlsv3.RateLimitResponse_OVER_LIMIT ||
			!proto.Equal(st.GetCurrentLimit(), wantLimit) || st.GetLimitRemaining() != 0 {
			t.Fatalf("4th check: %v; want OVER_LIMIT with 0 remaining", resp)
		}
		// A sliding window frees a request within two windows.
		if retry := envoyIntHeader(t, resp, "Retry-After"); retry < 1 || retry > 120 {
			t.Errorf("4th check: Retry-After %d, want whole seconds in [1, 120]", retry)
		}
		if got := envoyIntHeader(t, resp, "RateLimit-Remaining"); got != 0 {
			t.Errorf("4th check: RateLimit-Remaining %d", got)
		}
		// Another client address has its own limit.
		if resp := call(t, edge(0, envoyDesc("generic_key", "per-ip", "remote_address", "192.0.2.2"))); resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
			t.Fatalf("another address: %v", resp)
		}
	})

	t.Run("one descriptor over spends nothing on the others", func(t *testing.T) {
		perKey := envoyDesc("generic_key", "per-key", "api_key", "k-both")
		perIP := envoyDesc("generic_key", "per-ip", "remote_address", "192.0.2.20")
		for i := range 3 {
			if resp := call(t, edge(0, perIP)); resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
				t.Fatalf("per-ip check %d: %v", i, resp)
			}
		}
		for i := range 3 {
			resp := call(t, edge(0, perKey, perIP))
			key, ip := resp.GetStatuses()[0], resp.GetStatuses()[1]
			if resp.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT ||
				key.GetCode() != rlsv3.RateLimitResponse_OK || key.GetCurrentLimit().GetName() != "envoy-key" || key.GetLimitRemaining() != 5 ||
				ip.GetCode() != rlsv3.RateLimitResponse_OVER_LIMIT || ip.GetCurrentLimit().GetName() != "envoy-ip" {
				t.Fatalf("both, check %d: %v; want OVER_LIMIT by the per-ip descriptor, 5 left for the key", i, resp)
			}
			// The headers are those of the refusing descriptor.
			if got := envoyIntHeader(t, resp, "RateLimit-Limit"); got != 3 {
				t.Fatalf("both, check %d: RateLimit-Limit %d, want the per-ip limit 3", i, got)
			}
			envoyIntHeader(t, resp, "Retry-After")
		}
		// The statuses follow the descriptors' order.
		resp := call(t, edge(0, perIP, perKey))
		if resp.GetStatuses()[0].GetCode() != rlsv3.RateLimitResponse_OVER_LIMIT || resp.GetStatuses()[1].GetCode() != rlsv3.RateLimitResponse_OK {
			t.Fatalf("reversed: %v", resp)
		}
		// Nothing was spent from the api key's bucket: all 5 are left.
		for i := range 5 {
			resp := call(t, edge(0, perKey))
			if st := resp.GetStatuses()[0]; resp.GetOverallCode() != rlsv3.RateLimitResponse_OK || st.GetLimitRemaining() != uint32(4-i) {
				t.Fatalf("per-key check %d after the refused ones: %v; want OK with %d left", i, resp, 4-i)
			}
		}
		if resp := call(t, edge(0, perKey)); resp.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT {
			t.Fatalf("6th per-key check: %v; want OVER_LIMIT", resp)
		}
	})

	t.Run("a rule two descriptors match is spent once", func(t *testing.T) {
		desc := envoyDesc("generic_key", "per-key", "api_key", "k-twice")
		resp := call(t, edge(0, desc, envoyDesc("generic_key", "per-key", "api_key", "k-twice", "path", "/x")))
		for i, st := range resp.GetStatuses() {
			if st.GetCode() != rlsv3.RateLimitResponse_OK || st.GetLimitRemaining() != 4 {
				t.Fatalf("status %d: %v; want OK with 4 left", i, resp)
			}
		}
	})

	t.Run("hits_addend is the cost", func(t *testing.T) {
		desc := envoyDesc("generic_key", "per-user", "user", "u-cost")
		steps := []struct {
			hits      uint32
			code      rlsv3.RateLimitResponse_Code
			remaining uint32
		}{
			{4, rlsv3.RateLimitResponse_OK, 6},
			{7, rlsv3.RateLimitResponse_OVER_LIMIT, 6},
			{0, rlsv3.RateLimitResponse_OK, 5}, // 0 means 1
			{5, rlsv3.RateLimitResponse_OK, 0},
		}
		for i, s := range steps {
			resp := call(t, edge(s.hits, desc))
			if st := resp.GetStatuses()[0]; resp.GetOverallCode() != s.code || st.GetLimitRemaining() != s.remaining {
				t.Fatalf("step %d (hits_addend %d): %v; want %v with %d left", i, s.hits, resp, s.code, s.remaining)
			}
		}
		// A descriptor's own hits_addend overrides the request's.
		own := envoyDesc("generic_key", "per-user", "user", "u-own")
		own.HitsAddend = wrapperspb.UInt64(3)
		resp := call(t, edge(1, own, envoyDesc("generic_key", "per-user", "user", "u-other")))
		if resp.GetStatuses()[0].GetLimitRemaining() != 7 || resp.GetStatuses()[1].GetLimitRemaining() != 9 {
			t.Fatalf("descriptor hits_addend: %v; want 7 and 9 left", resp)
		}
	})

	t.Run("no matching rule", func(t *testing.T) {
		for _, req := range []*rlsv3.RateLimitRequest{
			edge(0, envoyDesc("generic_key", "nothing", "remote_address", "192.0.2.30")),
			// Rule attributes of domain edge in another domain.
			{Domain: "nowhere", Descriptors: []*ratelimitv3.RateLimitDescriptor{envoyDesc("generic_key", "per-ip", "remote_address", "192.0.2.1")}},
		} {
			for range 5 {
				resp := call(t, req)
				if st := resp.GetStatuses()[0]; resp.GetOverallCode() != rlsv3.RateLimitResponse_OK || st.GetCode() != rlsv3.RateLimitResponse_OK ||
					st.GetCurrentLimit() != nil || len(resp.GetResponseHeadersToAdd()) != 0 {
					t.Fatalf("%v: %v; want OK without a limit or headers", req, resp)
				}
			}
		}
		// The domain selects the rules: the other domain has its own.
		resp := call(t, &rlsv3.RateLimitRequest{Domain: "internal", Descriptors: []*ratelimitv3.RateLimitDescriptor{envoyDesc("generic_key", "per-ip", "remote_address", "192.0.2.1")}})
		if name := resp.GetStatuses()[0].GetCurrentLimit().GetName(); resp.GetOverallCode() != rlsv3.RateLimitResponse_OK || name != "envoy-other-domain" {
			t.Fatalf("domain internal: %v", resp)
		}
		resp, err := client.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "edge"})
		if err != nil || resp.GetOverallCode() != rlsv3.RateLimitResponse_UNKNOWN || len(resp.GetStatuses()) != 0 {
			t.Fatalf("no descriptors: %v, %v; want UNKNOWN", resp, err)
		}
	})

	t.Run("invalid", func(t *testing.T) {
		negative := envoyDesc("generic_key", "per-key", "api_key", "k")
		negative.IsNegativeHits = true
		tests := []struct {
			name string
			req  *rlsv3.RateLimitRequest
			// prefix is how the message must start.
			prefix string
		}{
			{"empty domain", &rlsv3.RateLimitRequest{Descriptors: []*ratelimitv3.RateLimitDescriptor{envoyDesc("generic_key", "per-key")}}, "domain:"},
			{"no entries", edge(0, envoyDesc("generic_key", "per-key"), &ratelimitv3.RateLimitDescriptor{}), "descriptors[1].entries:"},
			{"empty key", edge(0, envoyDesc("", "v")), "descriptors[0].entries[0].key:"},
			{"key twice", edge(0, envoyDesc("generic_key", "a", "generic_key", "b")), "descriptors[0].entries[1].key:"},
			{"negative hits", edge(0, negative), "descriptors[0].is_negative_hits:"},
			{"bad address", edge(0, envoyDesc("generic_key", "per-ip", "remote_address", "not-an-ip")), "descriptors[0]: attributes."},
			{"cost above the capacity", edge(11, envoyDesc("generic_key", "per-user", "user", "u-big")), "descriptors[0]: cost: rule \"envoy-user\""},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				_, err := client.ShouldRateLimit(ctx, tt.req)
				if status.Code(err) != codes.InvalidArgument || !strings.HasPrefix(status.Convert(err).Message(), tt.prefix) {
					t.Fatalf("ShouldRateLimit = %v, want InvalidArgument starting with %q", err, tt.prefix)
				}
			})
		}
	})
}

// TestEnvoyStoreDown: with Redis stopped, a descriptor of a fail-closed
// rule makes the whole request UNAVAILABLE (Envoy's failure_mode_deny then
// decides), while fail-open rules still answer from the local bucket. The
// daemon has the default options: answers without quota headers.
func TestEnvoyStoreDown(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	d := startDaemon(t, c.Addrs(), func(o *Options) {
		o.Rules.File = envoyRulesFile
		o.RedisTuning.Timeout = 200 * time.Millisecond
	})
	client := rlsv3.NewRateLimitServiceClient(dial(t, d.GRPCAddr()))
	ctx := context.Background()
	login := envoyDesc("generic_key", "login", "remote_address", "192.0.2.40")
	perKey := envoyDesc("generic_key", "per-key", "api_key", "k-down")
	req := func(descs ...*ratelimitv3.RateLimitDescriptor) *rlsv3.RateLimitRequest {
		return &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: descs}
	}
	if resp, err := client.ShouldRateLimit(ctx, req(login)); err != nil || resp.GetOverallCode() != rlsv3.RateLimitResponse_OK ||
		resp.GetStatuses()[0].GetCurrentLimit().GetName() != "envoy-login" || len(resp.GetResponseHeadersToAdd()) != 0 {
		t.Fatalf("before the outage: %v, %v; want OK by envoy-login, without headers", resp, err)
	}
	c.StopAll()
	for _, tt := range []struct {
		name string
		req  *rlsv3.RateLimitRequest
	}{
		{"fail-closed alone", req(login)},
		{"fail-closed with a fail-open", req(perKey, login)},
	} {
		if _, err := client.ShouldRateLimit(ctx, tt.req); status.Code(err) != codes.Unavailable {
			t.Fatalf("%s with the store down: %v, want Unavailable", tt.name, err)
		}
	}
	resp, err := client.ShouldRateLimit(ctx, req(perKey))
	if err != nil || resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
		t.Fatalf("fail-open rule with the store down: %v, %v; want OK from the local bucket", resp, err)
	}
}
