package limiterd

import (
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/frontdoor/forwardauth"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

const usageRules = `rules:
  - id: pinned-usage
    capacity: 10
    refill_per_second: 0.0001
    home: pinned
    home_keys: {hot: b}
    on_failure: closed
  - id: pinned-leases
    algorithm: concurrency
    limit: 4
    lease_ttl: 30s
    home: pinned
    home_keys: {hot: b}
    on_failure: closed
  - id: attr-rate
    capacity: 3
    refill_per_second: 0.0001
    key_by: user
    match: {path: /u/**}
  - id: attr-leases
    algorithm: concurrency
    limit: 2
    lease_ttl: 30s
    key_by: user
    match: {path: /u/**}
`

// TestUsagePinnedThroughAnyRegion: a pinned rule's usage through any
// region answers its key's home's figures (b's, for key hot), for a rate
// rule and a concurrency rule, and spends nothing; a usage by attributes
// answers every rule matched.
func TestUsagePinnedThroughAnyRegion(t *testing.T) {
	s := newRegionStack(t, time.Second, usageRules, func(addrs map[string]string) map[string]string {
		out := map[string]string{}
		for _, n := range []string{"a", "b", "c"} {
			out[n] = topoYAML(1, time.Time{}, addrs, "a", "b", "c")
		}
		return out
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for range 3 {
		resp, err := s.regions["a"].client.Check(ctx, &limiterv1.CheckRequest{RuleId: "pinned-usage", Key: "hot"})
		if err != nil || !resp.GetAllowed() {
			t.Fatalf("check = %v, %v", resp, err)
		}
	}
	if resp, err := s.regions["c"].client.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: "pinned-leases", Key: "hot"}); err != nil || !resp.GetAllowed() {
		t.Fatalf("acquire = %v, %v", resp, err)
	}
	for range 2 { // twice: the first changed nothing
		for _, n := range []string{"a", "b", "c"} {
			resp, err := s.regions[n].client.GetUsage(ctx, &limiterv1.GetUsageRequest{RuleId: "pinned-usage", Key: "hot"})
			if err != nil {
				t.Fatalf("usage through %s: %v", n, err)
			}
			u := resp.GetUsages()[0]
			if math.Abs(u.GetRemaining()-7) > 0.01 || u.GetLimit() != 10 || !u.GetAllowed() || u.GetConcurrency() {
				t.Fatalf("usage through %s = %v, want 7 of 10 left (the home's)", n, u)
			}
			resp, err = s.regions[n].client.GetUsage(ctx, &limiterv1.GetUsageRequest{RuleId: "pinned-leases", Key: "hot"})
			if err != nil {
				t.Fatalf("lease usage through %s: %v", n, err)
			}
			u = resp.GetUsages()[0]
			if !u.GetConcurrency() || u.GetInFlight() != 1 || u.GetRemaining() != 3 || u.GetLimit() != 4 || !u.GetAllowed() {
				t.Fatalf("lease usage through %s = %v, want 1 of 4 held (the home's)", n, u)
			}
		}
	}
	// Only the home holds the key: a non-home region's store was never read
	// into, nor written.
	if n := s.held("b", "pinned-leases", "hot"); n != 1 {
		t.Fatalf("b holds %d leases, want 1", n)
	}
	if n, _ := s.regions["a"].redis.Exists(ctx, redisstore.Key("pinned-usage", "hot")).Result(); n != 0 {
		t.Fatal("a's store holds the pinned key homed in b")
	}
	resp, err := s.regions["b"].client.Check(ctx, &limiterv1.CheckRequest{RuleId: "pinned-usage", Key: "hot"})
	if err != nil || math.Abs(resp.GetRemaining()-6) > 0.01 {
		t.Fatalf("check after the usages = %v, %v; want 6 left", resp, err)
	}

	a := &limiterv1.Attributes{User: "alice", Path: "/u/x"}
	if resp, err := s.regions["a"].client.Acquire(ctx, &limiterv1.AcquireRequest{Attributes: a}); err != nil || !resp.GetAllowed() {
		t.Fatalf("acquire by attributes = %v, %v", resp, err)
	}
	us, err := s.regions["a"].client.GetUsage(ctx, &limiterv1.GetUsageRequest{Attributes: a})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]*limiterv1.RuleUsage{}
	for _, u := range us.GetUsages() {
		got[u.GetRuleId()] = u
	}
	if r, l := got["attr-rate"], got["attr-leases"]; len(got) != 2 || r == nil || l == nil ||
		math.Abs(r.GetRemaining()-2) > 0.01 || l.GetInFlight() != 1 || l.GetRemaining() != 1 {
		t.Fatalf("usage by attributes = %v, want attr-rate 2 of 3 left and attr-leases 1 of 2 held", us.GetUsages())
	}
}

// TestUsageBadInput: GetUsage is validated as Check is, over gRPC and
// HTTP, and /v1/usage is behind forward-auth's secret.
func TestUsageBadInput(t *testing.T) {
	cluster := redistest.NewCluster(t, 3, 0)
	secretFile := testenv.SecretFile(t)
	d := startForwardAuth(t, cluster.Addrs(), func(o *Options) { o.ForwardAuth.SecretFile = secretFile })
	raw, err := os.ReadFile(secretFile)
	if err != nil {
		t.Fatal(err)
	}
	secret := strings.TrimSpace(string(raw))
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	ctx := context.Background()

	grpcTests := []struct {
		name  string
		req   *limiterv1.GetUsageRequest
		code  codes.Code
		field string
	}{
		{"unknown rule", &limiterv1.GetUsageRequest{RuleId: "nope", Key: "k"}, codes.NotFound, "rule_id"},
		{"empty key", &limiterv1.GetUsageRequest{RuleId: "admin", Key: ""}, codes.InvalidArgument, "key"},
		{"cost above capacity", &limiterv1.GetUsageRequest{RuleId: "admin", Key: "k", Cost: 2}, codes.InvalidArgument, "cost"},
		{"rule and attributes", &limiterv1.GetUsageRequest{RuleId: "admin", Key: "k", Attributes: &limiterv1.Attributes{User: "u"}}, codes.InvalidArgument, "attributes"},
	}
	for _, tt := range grpcTests {
		t.Run("grpc "+tt.name, func(t *testing.T) {
			_, err := client.GetUsage(ctx, tt.req)
			if st := status.Convert(err); st.Code() != tt.code || !strings.Contains(st.Message(), tt.field) {
				t.Fatalf("GetUsage = %v, want %v naming %s", err, tt.code, tt.field)
			}
		})
	}

	get := func(t *testing.T, method, query, secret string) (int, map[string]any) {
		t.Helper()
		req, err := http.NewRequest(method, "http://"+d.HTTPAddr()+forwardauth.UsagePath+query, nil)
		if err != nil {
			t.Fatal(err)
		}
		if secret != "" {
			req.Header.Set(forwardauth.SecretHeader, secret)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		var m map[string]any
		_ = json.Unmarshal(body, &m)
		return resp.StatusCode, m
	}
	if resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "per-user", Key: "alice"}); err != nil || !resp.GetAllowed() {
		t.Fatalf("check = %v, %v", resp, err)
	}
	httpTests := []struct {
		name, method, query, secret string
		code                        int
		field                       string
	}{
		{"no secret", "GET", "?rule=per-user&key=alice", "", http.StatusUnauthorized, ""},
		{"wrong secret", "GET", "?rule=per-user&key=alice", strings.Repeat("x", 32), http.StatusUnauthorized, ""},
		{"unknown rule", "GET", "?rule=nope&key=alice", secret, http.StatusNotFound, "rule_id"},
		{"no key", "GET", "?rule=per-user", secret, http.StatusBadRequest, "key"},
		{"cost not a number", "GET", "?rule=per-user&key=alice&cost=x", secret, http.StatusBadRequest, "cost"},
		{"cost above capacity", "GET", "?rule=per-user&key=alice&cost=4", secret, http.StatusBadRequest, "cost"},
		{"post", "POST", "?rule=per-user&key=alice", secret, http.StatusMethodNotAllowed, ""},
		{"ok", "GET", "?rule=per-user&key=alice", secret, http.StatusOK, ""},
	}
	for _, tt := range httpTests {
		t.Run("http "+tt.name, func(t *testing.T) {
			code, m := get(t, tt.method, tt.query, tt.secret)
			if code != tt.code {
				t.Fatalf("status %d, want %d (%v)", code, tt.code, m)
			}
			if tt.field != "" && !strings.Contains(m["error"].(string), tt.field) {
				t.Fatalf("error %q does not name %s", m["error"], tt.field)
			}
			if code != http.StatusOK {
				return
			}
			us := m["usages"].([]any)
			u := us[0].(map[string]any)
			if u["rule_id"] != "per-user" || u["key"] != "alice" || math.Abs(u["remaining"].(float64)-2) > 0.01 || u["limit"].(float64) != 3 {
				t.Fatalf("usage = %v, want 2 of 3 left for per-user alice", u)
			}
		})
	}
}
