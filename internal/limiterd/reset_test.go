package limiterd

import (
	"bytes"
	"context"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

const resetRulesFile = `rules:
  - id: tenant
    capacity: 2
    refill_per_second: 0.000001
  - id: held
    algorithm: concurrency
    limit: 1
    lease_ttl: 1s
`

// syncBuffer is a log's output read by a test while the daemon writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestAdminResetKey: a reset of another tenant's key without the admin
// token (none, a wrong one, over gRPC and HTTP) is refused and the key
// stays spent; an unknown rule is NOT_FOUND / 404, a bad key or a
// concurrency rule INVALID_ARGUMENT / 400 naming the field, each changing
// nothing; with the token the key is full again at once (its denial
// forgotten), the reset logged with who asked and counted.
func TestAdminResetKey(t *testing.T) {
	dir := t.TempDir()
	tokenFile, rulesFile := filepath.Join(dir, "token"), filepath.Join(dir, "rules.yml")
	if err := os.WriteFile(tokenFile, []byte(adminToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(rulesFile, []byte(resetRulesFile), 0o644); err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	d := startDaemon(t, nil, func(o *Options) {
		o.Admin.TokenFile, o.Rules.File = tokenFile, rulesFile
		o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	})
	ctx := context.Background()
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	adm := limiterv1.NewAdminClient(dial(t, d.GRPCAddr()))
	check := func(key string) bool {
		t.Helper()
		resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "tenant", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetAllowed()
	}
	for range 2 {
		if !check("tenant-b") {
			t.Fatal("a check within the capacity was refused")
		}
	}
	stillSpent := func(after string) {
		t.Helper()
		if check("tenant-b") {
			t.Fatalf("after %s, tenant-b's key is full again", after)
		}
	}
	stillSpent("its spends")

	// Without the admin identity: refused, nothing changes.
	wrong := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer wrong-token-wrong-token")
	for name, c := range map[string]context.Context{"no token": ctx, "a wrong token": wrong} {
		_, err := adm.ResetKey(c, &limiterv1.ResetKeyRequest{RuleId: "tenant", Key: "tenant-b"})
		if status.Code(err) != codes.Unauthenticated {
			t.Fatalf("ResetKey with %s: %v, want Unauthenticated", name, err)
		}
		stillSpent("ResetKey with " + name)
	}
	for _, token := range []string{"", "wrong-token-wrong-token"} {
		if code, msg := adminHTTP(t, d, "POST", "/admin/rules/tenant/keys/tenant-b:reset", token, ""); code != http.StatusUnauthorized {
			t.Fatalf("HTTP reset with token %q: %d %q, want 401", token, code, msg)
		}
		stillSpent("an HTTP reset without the admin token")
	}

	// Bad input: refused naming the field, nothing changes.
	authed := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+adminToken)
	long := strings.Repeat("k", 513)
	for _, tt := range []struct {
		name, rule, key, field string
		code                   codes.Code
		httpCode               int
	}{
		{"unknown rule", "nope", "tenant-b", "nope", codes.NotFound, http.StatusNotFound},
		{"bad rule id", "api.", "tenant-b", "id", codes.InvalidArgument, http.StatusBadRequest},
		{"empty key", "tenant", "", "key", codes.InvalidArgument, http.StatusBadRequest},
		{"long key", "tenant", long, "key", codes.InvalidArgument, http.StatusBadRequest},
		{"concurrency rule", "held", "tenant-b", "rule_id", codes.InvalidArgument, http.StatusBadRequest},
	} {
		_, err := adm.ResetKey(authed, &limiterv1.ResetKeyRequest{RuleId: tt.rule, Key: tt.key})
		if status.Code(err) != tt.code || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("%s: ResetKey = %v, want %v naming %s", tt.name, err, tt.code, tt.field)
		}
		code, msg := adminHTTP(t, d, "POST", "/admin/rules/"+tt.rule+"/keys/"+tt.key+":reset", adminToken, "")
		if code != tt.httpCode || !strings.Contains(msg, tt.field) {
			t.Errorf("%s: HTTP reset = %d %q, want %d naming %s", tt.name, code, msg, tt.httpCode, tt.field)
		}
	}
	stillSpent("refused resets")
	if code, _ := adminHTTP(t, d, "POST", "/admin/rules/tenant/keys/tenant-b:drain", adminToken, ""); code != http.StatusNotFound {
		t.Errorf("an operation other than :reset: %d, want 404", code)
	}

	// With the token: full again at once, over gRPC then HTTP.
	resp, err := adm.ResetKey(authed, &limiterv1.ResetKeyRequest{RuleId: "tenant", Key: "tenant-b"})
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetPropagated() {
		t.Error("a limiterd without NATS says the reset went to the other regions")
	}
	for range 2 {
		if !check("tenant-b") {
			t.Fatal("after ResetKey, a check within the capacity was refused")
		}
	}
	stillSpent("the reset and the capacity spent again")
	if code, msg := adminHTTP(t, d, "POST", "/admin/rules/tenant/keys/tenant-b:reset", adminToken, ""); code != http.StatusOK ||
		!strings.Contains(msg, `"key":"tenant-b"`) {
		t.Fatalf("HTTP reset: %d %q", code, msg)
	}
	if !check("tenant-b") {
		t.Fatal("after the HTTP reset, the key is still refused")
	}

	body := scrape(t, d)
	for _, want := range []string{
		`limiter_admin_resets_total{result="reset"} 2`,
		`limiter_admin_resets_total{result="refused"} 10`,
		`limiter_admin_resets_total{result="failed"} 0`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	if n := strings.Count(logs.String(), `msg="key reset" `); n != 2 || !strings.Contains(logs.String(), "by=admin-token") {
		t.Errorf("%d reset lines naming the admin token, want 2:\n%s", n, logs.String())
	}
	if strings.Contains(logs.String(), "tenant-b") {
		t.Error("the log names the client's key")
	}
}
