package limiterd

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// adminPair is two limiterd of one region sharing the admin rules bucket.
func adminPair(t *testing.T) (a, b *Daemon) {
	t.Helper()
	ns := natstest.NewServer(t)
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(adminToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	withAdmin := func(o *Options) { o.NATS.URL, o.Admin.TokenFile = ns.URL(), tokenFile }
	return startDaemon(t, nil, withAdmin), startDaemon(t, nil, withAdmin)
}

// waitYAML polls d's rules until rule's YAML satisfies ok.
func waitYAML(t *testing.T, d *Daemon, rule string, ok func(yaml string) bool) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		for _, r := range d.rules.Current().Rules() {
			if r.ID == rule && ok(string(r.YAML())) {
				return time.Since(start)
			}
		}
		if time.Since(start) > 10*time.Second {
			t.Fatalf("rule %s not as wanted after 10s", rule)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// admitted sends n checks of cost 1 to rule and key and counts the allowed.
func admitted(t *testing.T, client limiterv1.LimiterClient, rule, key string, n int) (int, float64) {
	t.Helper()
	count, limit := 0, 0.0
	for range n {
		resp, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: rule, Key: key, Cost: 1})
		if err != nil {
			t.Fatal(err)
		}
		if resp.Allowed {
			count++
		}
		limit = resp.Limit
	}
	return count, limit
}

// TestAdminOverrides: one override put through one limiterd's admin API
// is in force on the other limiterd for its key only, and deleted the
// same way; the rule's other fields stay.
func TestAdminOverrides(t *testing.T) {
	a, b := adminPair(t)
	adminA := limiterv1.NewAdminClient(dial(t, a.GRPCAddr()))
	clientB := limiterv1.NewLimiterClient(dial(t, b.GRPCAddr()))
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+adminToken)
	if _, err := adminA.PutRule(ctx, &limiterv1.PutRuleRequest{Rule: "id: dyn\ncapacity: 2\nrefill_per_second: 0.000001\nkey_by: user\n"}); err != nil {
		t.Fatal(err)
	}
	waitRule(t, clientB, "dyn", false, time.Now())

	if _, err := adminA.PutOverride(ctx, &limiterv1.PutOverrideRequest{RuleId: "dyn", Key: "acme", Override: `{"capacity": 5}`}); err != nil {
		t.Fatal(err)
	}
	took := waitYAML(t, b, "dyn", func(y string) bool { return strings.Contains(y, "acme") })
	t.Logf("a put override was in force on the other limiterd after %v", took)
	if n, limit := admitted(t, clientB, "dyn", "acme", 8); n != 5 || limit != 5 {
		t.Errorf("acme: %d of 8 admitted, limit %v; want its override's 5", n, limit)
	}
	if n, limit := admitted(t, clientB, "dyn", "other", 8); n != 2 || limit != 2 {
		t.Errorf("other: %d of 8 admitted, limit %v; want the rule's 2", n, limit)
	}
	if y := string(b.rules.Current().Get("dyn").YAML()); !strings.Contains(y, "key_by: user") {
		t.Errorf("the put override lost the rule's other fields:\n%s", y)
	}

	// Over HTTP, with a JSON body: a second key, then the first deleted.
	if code, body := adminHTTP(t, b, "PUT", "/admin/rules/dyn/overrides/big", adminToken, `{"capacity": 9}`); code != http.StatusOK || !strings.Contains(body, `"revision"`) {
		t.Fatalf("HTTP PUT override: %d %s", code, body)
	}
	if code, body := adminHTTP(t, b, "DELETE", "/admin/rules/dyn/overrides/acme", adminToken, ""); code != http.StatusOK {
		t.Fatalf("HTTP DELETE override: %d %s", code, body)
	}
	waitYAML(t, a, "dyn", func(y string) bool { return strings.Contains(y, "big") && !strings.Contains(y, "acme") })
	clientA := limiterv1.NewLimiterClient(dial(t, a.GRPCAddr()))
	if n, limit := admitted(t, clientA, "dyn", "big", 12); n != 9 || limit != 9 {
		t.Errorf("big: %d of 12 admitted, limit %v; want 9", n, limit)
	}
	if _, limit := admitted(t, clientA, "dyn", "acme", 1); limit != 2 {
		t.Errorf("acme after its override was deleted: limit %v, want the rule's 2", limit)
	}
	if _, err := adminA.DeleteOverride(ctx, &limiterv1.DeleteOverrideRequest{RuleId: "dyn", Key: "acme"}); status.Code(err) != codes.NotFound {
		t.Errorf("DeleteOverride of a key without one: %v, want NOT_FOUND", err)
	}
}

// TestAdminOverridesRefused: bad overrides, callers without the admin
// token and a flood of new keys past rules.MaxOverrides are refused, and
// nothing already stored changes.
func TestAdminOverridesRefused(t *testing.T) {
	a, _ := adminPair(t)
	adminA := limiterv1.NewAdminClient(dial(t, a.GRPCAddr()))
	authed := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+adminToken)
	var flood strings.Builder
	flood.WriteString("id: many\ncapacity: 2\nrefill_per_second: 0.000001\noverrides:\n")
	for i := range rules.MaxOverrides {
		fmt.Fprintf(&flood, "  t-%d: {capacity: 3}\n", i)
	}
	for _, rule := range []string{"id: dyn\ncapacity: 2\nrefill_per_second: 0.000001\n", flood.String()} {
		if _, err := adminA.PutRule(authed, &limiterv1.PutRuleRequest{Rule: rule}); err != nil {
			t.Fatal(err)
		}
	}
	waitYAML(t, a, "many", func(string) bool { return true })
	waitYAML(t, a, "dyn", func(string) bool { return true })
	_, before := adminHTTP(t, a, "GET", "/admin/rules", adminToken, "")

	for _, tt := range []struct {
		name, method, path, token, body string
		code                            int
		want                            string
	}{
		{"no token", "PUT", "/admin/rules/dyn/overrides/acme", "", `{"capacity": 5}`, http.StatusUnauthorized, "bearer token"},
		{"wrong token", "PUT", "/admin/rules/dyn/overrides/acme", "wrong-token-wrong-token", `{"capacity": 5}`, http.StatusUnauthorized, "wrong"},
		{"delete without a token", "DELETE", "/admin/rules/many/overrides/t-1", "", "", http.StatusUnauthorized, "bearer token"},
		{"zero capacity", "PUT", "/admin/rules/dyn/overrides/acme", adminToken, `{"capacity": 0}`, http.StatusBadRequest, `overrides["acme"].capacity`},
		{"unknown field", "PUT", "/admin/rules/dyn/overrides/acme", adminToken, `{"capacity": 5, "burst": 9}`, http.StatusBadRequest, `overrides["acme"].burst`},
		{"window of a token bucket", "PUT", "/admin/rules/dyn/overrides/acme", adminToken, `{"window": "1m"}`, http.StatusBadRequest, `overrides["acme"].window`},
		{"not a mapping", "PUT", "/admin/rules/dyn/overrides/acme", adminToken, `[1, 2]`, http.StatusBadRequest, `overrides["acme"]`},
		{"empty", "PUT", "/admin/rules/dyn/overrides/acme", adminToken, ``, http.StatusBadRequest, `overrides["acme"]`},
		{"too large", "PUT", "/admin/rules/dyn/overrides/acme", adminToken, `{"capacity": 5}` + strings.Repeat(" ", 5000), http.StatusBadRequest, "bytes"},
		{"unknown rule", "PUT", "/admin/rules/nope/overrides/acme", adminToken, `{"capacity": 5}`, http.StatusNotFound, "nope"},
		{"a file rule", "PUT", "/admin/rules/tb/overrides/acme", adminToken, `{"capacity": 5}`, http.StatusBadRequest, "rules file"},
		{"past the bound", "PUT", "/admin/rules/many/overrides/one-more", adminToken, `{"capacity": 5}`, http.StatusBadRequest, "too many overrides"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			code, body := adminHTTP(t, a, tt.method, tt.path, tt.token, tt.body)
			if code != tt.code || !strings.Contains(body, tt.want) {
				t.Fatalf("%s %s: %d %q, want %d naming %s", tt.method, tt.path, code, body, tt.code, tt.want)
			}
		})
	}
	// gRPC: the same checks.
	if _, err := adminA.PutOverride(context.Background(), &limiterv1.PutOverrideRequest{RuleId: "dyn", Key: "acme", Override: `{"capacity": 5}`}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("PutOverride without a token: %v", err)
	}
	if _, err := adminA.DeleteOverride(context.Background(), &limiterv1.DeleteOverrideRequest{RuleId: "many", Key: "t-1"}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("DeleteOverride without a token: %v", err)
	}
	// A flood of new keys, each refused.
	for i := range 50 {
		_, err := adminA.PutOverride(authed, &limiterv1.PutOverrideRequest{RuleId: "many", Key: fmt.Sprintf("new-%d", i), Override: `{"capacity": 5}`})
		if status.Code(err) != codes.InvalidArgument {
			t.Fatalf("new override %d past the bound: %v, want INVALID_ARGUMENT", i, err)
		}
	}
	if _, after := adminHTTP(t, a, "GET", "/admin/rules", adminToken, ""); after != before {
		t.Fatal("refused overrides changed the rules")
	}
	// At the bound, an existing key still changes, and a deleted one
	// makes room for one new key.
	if _, err := adminA.PutOverride(authed, &limiterv1.PutOverrideRequest{RuleId: "many", Key: "t-0", Override: `{"capacity": 4}`}); err != nil {
		t.Fatalf("changing an override at the bound: %v", err)
	}
	if _, err := adminA.DeleteOverride(authed, &limiterv1.DeleteOverrideRequest{RuleId: "many", Key: "t-1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := adminA.PutOverride(authed, &limiterv1.PutOverrideRequest{RuleId: "many", Key: "new", Override: `{"capacity": 4}`}); err != nil {
		t.Fatalf("a new override in the room of a deleted one: %v", err)
	}
	waitYAML(t, a, "many", func(y string) bool { return strings.Contains(y, "new:") && !strings.Contains(y, "t-1:") })
	if n := len(a.rules.Current().Get("many").Overrides); n != rules.MaxOverrides {
		t.Fatalf("%d overrides in force, want %d", n, rules.MaxOverrides)
	}
}
