package limiterd

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/testenv/natstest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

const adminToken = "s3cret-admin-token-of-the-test"

func adminHTTP(t *testing.T, d *Daemon, method, path, token, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, "http://"+d.HTTPAddr()+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// waitRule polls a daemon until a check of rule stops being NotFound (or,
// with gone, starts being NotFound), and returns how long that took.
func waitRule(t testing.TB, client limiterv1.LimiterClient, rule string, gone bool, start time.Time) time.Duration {
	t.Helper()
	for {
		_, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: rule, Key: "probe"})
		if (status.Code(err) == codes.NotFound) == gone {
			return time.Since(start)
		}
		if time.Since(start) > 10*time.Second {
			t.Fatalf("rule %s (gone %v) not in force after 10s: %v", rule, gone, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestAdminRules: rules put through one limiterd's admin API are in force
// in every limiterd of the region within 5 s; unauthenticated and invalid
// calls change nothing.
func TestAdminRules(t *testing.T) {
	ns := natstest.NewServer(t)
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(adminToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	withAdmin := func(o *Options) { o.NATS.URL, o.Admin.TokenFile = ns.URL(), tokenFile }
	a := startDaemon(t, nil, withAdmin)
	b := startDaemon(t, nil, withAdmin)
	clientB := limiterv1.NewLimiterClient(dial(t, b.GRPCAddr()))
	adminA := limiterv1.NewAdminClient(dial(t, a.GRPCAddr()))
	ctx := context.Background()
	rule := "id: dyn\ncapacity: 2\nrefill_per_second: 0.000001\n"

	// Unauthenticated: refused, nothing stored.
	if _, err := adminA.PutRule(ctx, &limiterv1.PutRuleRequest{Rule: rule}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("PutRule without a token: %v", err)
	}
	bad := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer wrong-token-wrong-token")
	if _, err := adminA.PutRule(bad, &limiterv1.PutRuleRequest{Rule: rule}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("PutRule with a wrong token: %v", err)
	}
	if code, _ := adminHTTP(t, a, "PUT", "/admin/rules/dyn", "", rule); code != http.StatusUnauthorized {
		t.Fatalf("HTTP PUT without a token: %d", code)
	}
	if _, err := clientB.Check(ctx, &limiterv1.CheckRequest{RuleId: "dyn", Key: "k"}); status.Code(err) != codes.NotFound {
		t.Fatalf("an unauthenticated put took effect: %v", err)
	}

	// Invalid: refused naming the field, the rules in force kept.
	_, before := adminHTTP(t, a, "GET", "/admin/rules", adminToken, "")
	for _, tt := range []struct{ body, field string }{
		{"id: dyn\ncapacity: -2\nrefill_per_second: 1\n", "capacity"},
		{"id: dyn\ncapacity: 2\nrefill_per_second: 1\nburst: 3\n", "burst"},
		{"id: tb\ncapacity: 2\nrefill_per_second: 1\n", "rules file"},
	} {
		path := "/admin/rules/" + strings.Fields(tt.body)[1]
		code, msg := adminHTTP(t, a, "PUT", path, adminToken, tt.body)
		if code != http.StatusBadRequest || !strings.Contains(msg, tt.field) {
			t.Fatalf("PUT %q: %d %q, want 400 naming %s", tt.body, code, msg, tt.field)
		}
	}
	if code, msg := adminHTTP(t, a, "PUT", "/admin/rules/other", adminToken, rule); code != http.StatusBadRequest || !strings.Contains(msg, "id") {
		t.Fatalf("PUT with the path's id different from the body's: %d %q", code, msg)
	}
	if _, after := adminHTTP(t, a, "GET", "/admin/rules", adminToken, ""); after != before {
		t.Fatalf("refused puts changed the rules:\n%s\n%s", before, after)
	}

	// Valid: in force on the other instance, measured.
	start := time.Now()
	authed := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+adminToken)
	if _, err := adminA.PutRule(authed, &limiterv1.PutRuleRequest{Rule: rule}); err != nil {
		t.Fatal(err)
	}
	took := waitRule(t, clientB, "dyn", false, start)
	t.Logf("a put rule was in force on the other limiterd after %v", took)
	if took > 5*time.Second {
		t.Errorf("rule propagation took %v, the bound is 5s", took)
	}
	list, err := adminA.ListRules(authed, &limiterv1.ListRulesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, e := range list.Rules {
		found = found || (e.Id == "dyn" && e.Source == "admin")
	}
	if !found || list.Version == "" {
		t.Fatalf("ListRules: %v", list)
	}
	if body := scrape(t, b); !strings.Contains(body, `limiter_rules_version_info{version="`+list.Version+`"} 1`) {
		t.Errorf("the other limiterd does not export version %s", list.Version)
	}

	// Deleted: gone everywhere.
	start = time.Now()
	if code, msg := adminHTTP(t, b, "DELETE", "/admin/rules/dyn", adminToken, ""); code != http.StatusNoContent {
		t.Fatalf("DELETE: %d %s", code, msg)
	}
	waitRule(t, limiterv1.NewLimiterClient(dial(t, a.GRPCAddr())), "dyn", true, start)
	if code, _ := adminHTTP(t, b, "DELETE", "/admin/rules/dyn", adminToken, ""); code != http.StatusNotFound {
		t.Fatalf("second DELETE: %d", code)
	}
}

// TestRulesFileReload: a changed rules file is in force within seconds; a
// bad one is refused and the rules in force stay.
func TestRulesFileReload(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "rules.yml")
	write := func(s string) {
		if err := os.WriteFile(file, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("rules:\n  - id: one\n    capacity: 1\n    refill_per_second: 1\n")
	d := startDaemon(t, nil, func(o *Options) { o.Rules.File = file })
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	start := time.Now()
	write("rules:\n  - id: one\n    capacity: 1\n    refill_per_second: 1\n  - id: two\n    capacity: 1\n    refill_per_second: 1\n")
	t.Logf("file change in force after %v", waitRule(t, client, "two", false, start))

	write("rules:\n  - id: one\n    capacity: -1\n")
	time.Sleep(2500 * time.Millisecond)
	if _, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "two", Key: "k"}); err != nil {
		t.Fatalf("a bad file replaced the rules in force: %v", err)
	}
	if body := scrape(t, d); !containsNonZero(body, `limiter_rules_reloads_total{result="failure",source="file"}`) {
		t.Error("the refused reload is not counted")
	}
}

// TestAdminRefusesBadIDs: an id in the path that is not a rule id (and
// could not be a key of the rules bucket: "api.", ".api", "a..b", "api%20")
// is refused by DELETE and PUT with 400 naming the id, and by the gRPC
// DeleteRule with InvalidArgument, before the bucket is asked.
func TestAdminRefusesBadIDs(t *testing.T) {
	ns := natstest.NewServer(t)
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(adminToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, nil, func(o *Options) { o.NATS.URL, o.Admin.TokenFile = ns.URL(), tokenFile })
	for _, tt := range []struct{ name, path, id string }{
		{"trailing dot", "api.", "api."},
		{"leading dot", ".api", ".api"},
		{"two dots", "a..b", "a..b"},
		{"escaped space", "api%20", "api "},
	} {
		t.Run(tt.name, func(t *testing.T) {
			code, msg := adminHTTP(t, d, "DELETE", "/admin/rules/"+tt.path, adminToken, "")
			if code != http.StatusBadRequest || !strings.Contains(msg, `"`+tt.id+`"`) || !strings.Contains(msg, "id") {
				t.Errorf("DELETE %s: %d %q, want 400 naming the id %q", tt.path, code, msg, tt.id)
			}
			body := "id: " + strconv.Quote(tt.id) + "\ncapacity: 1\nrefill_per_second: 1\n"
			code, msg = adminHTTP(t, d, "PUT", "/admin/rules/"+tt.path, adminToken, body)
			if code != http.StatusBadRequest || !strings.Contains(msg, `"`+tt.id+`"`) {
				t.Errorf("PUT %s: %d %q, want 400 naming the id %q", tt.path, code, msg, tt.id)
			}
			authed := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+adminToken)
			_, err := limiterv1.NewAdminClient(dial(t, d.GRPCAddr())).DeleteRule(authed, &limiterv1.DeleteRuleRequest{Id: tt.id})
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), `"`+tt.id+`"`) {
				t.Errorf("DeleteRule %q: %v, want InvalidArgument naming the id", tt.id, err)
			}
		})
	}
}
