package limiterd

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// TestTopLimitedAcrossTheFleet: two limiterd instances of a region share
// a Redis Cluster; the keys each refused are merged over both by the
// admin API (gRPC and HTTP), which refuses callers without the token, an
// unknown rule and a bad limit, naming them.
func TestTopLimitedAcrossTheFleet(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(adminToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	start := func(name string) *Daemon {
		return startDaemon(t, c.Addrs(), func(o *Options) { o.Region.Instance, o.Admin.TokenFile = name, tokenFile })
	}
	a, b := start("top-a"), start("top-b")
	checks := func(d *Daemon, key string, n int) {
		client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
		for range n {
			if _, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "tb", Key: key}); err != nil {
				t.Fatal(err)
			}
		}
	}
	// tb holds 10 per key, shared by both through Redis.
	checks(a, "hot", 15) // 5 refused on a
	checks(b, "hot", 13) // 13 on b
	checks(a, "cool", 11)
	for _, d := range []*Daemon{a, b} {
		if err := d.top.Load().Write(context.Background()); err != nil {
			t.Fatal(err)
		}
	}

	code, body := adminHTTP(t, a, "GET", "/admin/rules/tb/top?limit=5", adminToken, "")
	if code != http.StatusOK {
		t.Fatalf("GET top: %d %s", code, body)
	}
	var got struct {
		Keys []struct {
			Key          string
			Count, Error uint64
		}
		Instances int
		Partial   string
	}
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	if got.Instances != 2 || got.Partial != "" || len(got.Keys) != 2 ||
		got.Keys[0].Key != "hot" || got.Keys[0].Count != 18 || got.Keys[1].Key != "cool" || got.Keys[1].Count != 1 {
		t.Fatalf("GET top = %s, want hot 18 and cool 1 over 2 instances", body)
	}

	admin := limiterv1.NewAdminClient(dial(t, b.GRPCAddr()))
	authed := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+adminToken)
	resp, err := admin.TopLimited(authed, &limiterv1.TopLimitedRequest{RuleId: "tb", Limit: 1})
	if err != nil || len(resp.Keys) != 1 || resp.Keys[0].Key != "hot" || resp.Keys[0].Count != 18 || resp.Instances != 2 {
		t.Fatalf("TopLimited from b = %v, %v; want hot 18 over 2 instances", resp, err)
	}
	for _, tt := range []struct {
		name  string
		ctx   context.Context
		req   *limiterv1.TopLimitedRequest
		code  codes.Code
		names string
	}{
		{"no token", context.Background(), &limiterv1.TopLimitedRequest{RuleId: "tb"}, codes.Unauthenticated, "token"},
		{"unknown rule", authed, &limiterv1.TopLimitedRequest{RuleId: "nope"}, codes.NotFound, "nope"},
		{"bad rule id", authed, &limiterv1.TopLimitedRequest{RuleId: "a..b"}, codes.InvalidArgument, "a..b"},
		{"limit too high", authed, &limiterv1.TopLimitedRequest{RuleId: "tb", Limit: 5000}, codes.InvalidArgument, "limit"},
	} {
		if _, err := admin.TopLimited(tt.ctx, tt.req); status.Code(err) != tt.code || !strings.Contains(err.Error(), tt.names) {
			t.Errorf("%s: %v, want %v naming %q", tt.name, err, tt.code, tt.names)
		}
	}
	for path, want := range map[string]int{
		"/admin/rules/tb/top?limit=abc": http.StatusBadRequest,
		"/admin/rules/nope/top":         http.StatusNotFound,
	} {
		if code, msg := adminHTTP(t, a, "GET", path, adminToken, ""); code != want {
			t.Errorf("GET %s: %d %q, want %d", path, code, msg, want)
		}
	}
	if code, _ := adminHTTP(t, a, "GET", "/admin/rules/tb/top", "", ""); code != http.StatusUnauthorized {
		t.Errorf("GET top without the token: %d, want 401", code)
	}
}
