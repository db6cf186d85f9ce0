package httplimit_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/client"
	"github.com/limiterd/limiterd/pkg/httplimit"
)

const rulesYAML = `rules:
  - id: api
    capacity: 3
    refill_per_second: 0.01
    key_by: user
    match:
      path: /api/**
  - id: login
    capacity: 5
    refill_per_second: 0.01
    key_by: ip
    on_failure: closed
    match:
      path: /login
`

type userKey struct{}

// TestEndToEnd: a handler wrapped by the middleware, checking through a
// real client against a real in-process limiterd on a Redis Cluster.
func TestEndToEnd(t *testing.T) {
	cluster := redistest.NewCluster(t, 3, 0)
	rules := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(rules, []byte(rulesYAML), 0o600); err != nil {
		t.Fatal(err)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	o := limiterd.DefaultOptions()
	o.Server.GRPCAddress, o.Server.HTTPAddress, o.Rules.File = "127.0.0.1:0", "127.0.0.1:0", rules
	o.Redis.Addrs, o.RedisTuning.Timeout, o.Logger = cluster.Addrs(), 100*time.Millisecond, quiet
	d, err := limiterd.New(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	stop := sync.OnceFunc(func() { d.Stop(context.Background()) })
	t.Cleanup(stop)
	c, err := client.New(d.GRPCAddr(), client.WithTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })

	app := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	limited := httplimit.Middleware(c, httplimit.Options{
		Identity: func(r *http.Request) httplimit.Identity {
			u, _ := r.Context().Value(userKey{}).(string)
			return httplimit.Identity{User: u}
		},
		Logger: quiet,
	})(app)
	// A stand-in for the authentication middleware: the user name comes
	// from the basic auth user, as if the password had been checked.
	auth := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, _, ok := r.BasicAuth(); ok {
			r = r.WithContext(context.WithValue(r.Context(), userKey{}, u))
		}
		limited.ServeHTTP(w, r)
	})
	srv := httptest.NewServer(auth)
	t.Cleanup(srv.Close)

	get := func(path, user string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		if user != "" {
			req.SetBasicAuth(user, "secret")
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}

	for i := range 3 {
		resp := get("/api/orders", "alice")
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d", i, resp.StatusCode)
		}
		h := resp.Header
		if h.Get("RateLimit-Limit") != "3" || h.Get("RateLimit-Remaining") != strconv.Itoa(2-i) ||
			h.Get("X-RateLimit-Limit") != "3" || h.Get("RateLimit-Policy") != `"api";q=3;w=300` ||
			h.Get("RateLimit") == "" || h.Get("Retry-After") != "" {
			t.Fatalf("request %d headers: %v", i, h)
		}
		reset, _ := strconv.ParseInt(h.Get("X-RateLimit-Reset"), 10, 64)
		if now := time.Now().Unix(); reset < now || reset > now+301 {
			t.Fatalf("X-RateLimit-Reset %d is not a Unix time within the window", reset)
		}
	}
	resp := get("/api/orders", "alice")
	ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	if resp.StatusCode != http.StatusTooManyRequests || ra < 1 || ra > 100 || resp.Header.Get("RateLimit-Remaining") != "0" {
		t.Fatalf("4th request: %d, headers %v; want 429 with Retry-After in [1, 100]", resp.StatusCode, resp.Header)
	}
	// Another user has their own bucket; an unmatched path no limit.
	if resp := get("/api/orders", "bob"); resp.StatusCode != 200 || resp.Header.Get("RateLimit-Remaining") != "2" {
		t.Fatalf("bob: %d %v", resp.StatusCode, resp.Header)
	}
	if resp := get("/health", ""); resp.StatusCode != 200 || resp.Header.Get("RateLimit-Limit") != "" {
		t.Fatalf("/health: %d %v", resp.StatusCode, resp.Header)
	}
	if resp := get("/login", ""); resp.StatusCode != 200 || resp.Header.Get("RateLimit-Limit") != "5" {
		t.Fatalf("/login: %d %v", resp.StatusCode, resp.Header)
	}

	// The store goes away: the fail-closed login rule is a 503, the
	// fail-open api rule still serves (decided locally).
	cluster.StopAll()
	if resp := get("/login", ""); resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("/login with the store down: %d, want 503", resp.StatusCode)
	}
	if resp := get("/api/orders", "carol"); resp.StatusCode != 200 {
		t.Fatalf("/api/orders with the store down: %d, want 200", resp.StatusCode)
	}
	// limiterd itself goes away: fail open by default.
	stop()
	if resp := get("/login", ""); resp.StatusCode != 200 || resp.Header.Get("RateLimit-Limit") != "" {
		t.Fatalf("/login with limiterd down: %d %v, want 200 without quota headers", resp.StatusCode, resp.Header)
	}
}
