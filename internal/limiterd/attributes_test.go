package limiterd

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

func statusOf(resp *limiterv1.CheckResponse, rule string) *limiterv1.RuleStatus {
	for _, s := range resp.GetStatuses() {
		if s.GetRuleId() == rule {
			return s
		}
	}
	return nil
}

// TestAttributeChecks: every matching rule is checked against its own key,
// all or nothing; shadow rules refuse nothing; IPv6 clients share their /64.
func TestAttributeChecks(t *testing.T) {
	for _, store := range []string{"redis", "memory"} {
		t.Run(store, func(t *testing.T) {
			var addrs []string
			if store == "redis" {
				addrs = redistest.NewCluster(t, 3, 0).Addrs()
			}
			d := startDaemon(t, addrs)
			client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
			ctx := context.Background()
			check := func(a *limiterv1.Attributes) *limiterv1.CheckResponse {
				t.Helper()
				resp, err := client.Check(ctx, &limiterv1.CheckRequest{Attributes: a})
				if err != nil {
					t.Fatal(err)
				}
				return resp
			}
			a := &limiterv1.Attributes{ApiKey: "k1", Ip: "2001:db8:1:2::1", Path: "/api/orders"}
			for i := range 3 {
				resp := check(a)
				if !resp.Allowed || len(resp.Statuses) != 3 {
					t.Fatalf("check %d: %v", i, resp)
				}
				if i == 1 && !statusOf(resp, "watch").Shadow {
					t.Fatalf("shadow status not marked: %v", resp)
				}
			}
			// Another address of the same /64: the ip rule refuses; the api
			// key rule, which allowed, spends nothing.
			resp := check(&limiterv1.Attributes{ApiKey: "k1", Ip: "2001:db8:1:2:ffff::9", Path: "/api/orders"})
			if resp.Allowed || resp.RuleId != "per-ip" || resp.RetryAfterMs <= 0 || !statusOf(resp, "per-key").Allowed || statusOf(resp, "per-ip").Allowed {
				t.Fatalf("4th check: %v; want refused by per-ip", resp)
			}
			// The api key bucket still has 2: two more through another IP.
			for i := range 2 {
				if resp := check(&limiterv1.Attributes{ApiKey: "k1", Ip: "192.0.2.1", Path: "/api/orders"}); !resp.Allowed {
					t.Fatalf("per-key check %d after the refused one: %v", i, resp)
				}
			}
			if resp := check(&limiterv1.Attributes{ApiKey: "k1", Ip: "192.0.2.2", Path: "/api/orders"}); resp.Allowed || resp.RuleId != "per-key" {
				t.Fatalf("6th per-key check: %v; want refused by per-key", resp)
			}
			// Per-rule cost: a search costs 10 of the user's 100 an hour.
			resp = check(&limiterv1.Attributes{User: "u", Path: "/api/search"})
			if s := statusOf(resp, "search"); !resp.Allowed || s == nil || s.Remaining != 90 || s.WindowMs != 3_600_000 {
				t.Fatalf("search: %v", resp)
			}
			// No matching rule: allowed, nothing to report.
			if resp := check(&limiterv1.Attributes{Path: "/health"}); !resp.Allowed || len(resp.Statuses) != 0 {
				t.Fatalf("unmatched path: %v", resp)
			}
			body := scrape(t, d)
			if !containsNonZero(body, `limiter_decisions_total{result="shadow_limited",rule="watch"}`) {
				t.Error("shadow rejections not counted")
			}
		})
	}
}

func TestAttributeCheckValidation(t *testing.T) {
	d := startDaemon(t, nil)
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	tests := []struct {
		name  string
		req   *limiterv1.CheckRequest
		field string
	}{
		{"rule and attributes", &limiterv1.CheckRequest{RuleId: "tb", Attributes: &limiterv1.Attributes{Path: "/api/x"}}, "rule_id"},
		{"bad ip", &limiterv1.CheckRequest{Attributes: &limiterv1.Attributes{Ip: "300.1.1.1", Path: "/api/x"}}, `attributes.ip: "300.1.1.1" is not an IP address`},
		{"long key", &limiterv1.CheckRequest{Attributes: &limiterv1.Attributes{ApiKey: strings.Repeat("k", 600), Path: "/api/x"}}, "attributes"},
		{"negative cost", &limiterv1.CheckRequest{Cost: -1, Attributes: &limiterv1.Attributes{Path: "/api/x"}}, "cost"},
		{"cost times rule cost above capacity", &limiterv1.CheckRequest{Cost: 11, Attributes: &limiterv1.Attributes{User: "u", Path: "/api/search"}}, "cost: rule \"search\""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := client.Check(context.Background(), tt.req)
			if status.Code(err) != codes.InvalidArgument || !strings.HasPrefix(status.Convert(err).Message(), tt.field) {
				t.Fatalf("Check = %v, want InvalidArgument starting with %q", err, tt.field)
			}
		})
	}
}
