package limiterd

import (
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/frontdoor/forwardauth"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

const forwardAuthRules = `rules:
  - id: per-user
    capacity: 3
    refill_per_second: 0.01
    key_by: user
    match:
      path: /api/**
  - id: per-ip
    capacity: 100
    refill_per_second: 1
    key_by: ip
    match:
      path: /api/**
  - id: admin
    capacity: 1
    refill_per_second: 0.001
    key_by: user
    match:
      path: /admin
  - id: login
    capacity: 5
    refill_per_second: 0.01
    key_by: ip
    on_failure: closed
    match:
      path: /login
      methods: [POST]
`

func writeRules(t testing.TB, yaml string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(p, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// forwardAuth sends one forward-auth request as a proxy would.
func forwardAuth(t *testing.T, d *Daemon, method, query string, headers map[string]string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(method, "http://"+d.HTTPAddr()+forwardauth.Path+query, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

func proxyHeaders(user, uri, method, ip string) map[string]string {
	h := map[string]string{}
	for k, v := range map[string]string{"X-Auth-User": user, "X-Forwarded-Uri": uri, "X-Forwarded-Method": method, "X-Forwarded-For": ip} {
		if v != "" {
			h[k] = v
		}
	}
	return h
}

func startForwardAuth(t *testing.T, redis []string, mutate ...func(*Options)) *Daemon {
	t.Helper()
	rules := writeRules(t, forwardAuthRules)
	return startDaemon(t, redis, append([]func(*Options){func(o *Options) {
		o.Rules.File = rules
		o.ForwardAuth.Enabled = true
		o.RedisTuning.Timeout = 100 * time.Millisecond
	}}, mutate...)...)
}

// TestForwardAuth: the decisions and their statuses and headers, through
// a real limiterd on a Redis Cluster, as Traefik (default) and nginx
// (mode=nginx) ask.
func TestForwardAuth(t *testing.T) {
	cluster := redistest.NewCluster(t, 3, 0)
	d := startForwardAuth(t, cluster.Addrs())

	for i := range 3 {
		resp := forwardAuth(t, d, "GET", "", proxyHeaders("alice", "/api/orders?page=2", "GET", "203.0.113.9"))
		h := resp.Header
		if resp.StatusCode != 200 || h.Get("RateLimit-Limit") != "3" || h.Get("RateLimit-Remaining") != strconv.Itoa(2-i) ||
			h.Get("RateLimit-Reset") == "" || h.Get("X-RateLimit-Reset") == "" || h.Get("Retry-After") != "" ||
			h.Get("RateLimit-Policy") != `"per-user";q=3;w=300, "per-ip";q=100;w=100` {
			t.Fatalf("check %d: %d %v", i, resp.StatusCode, h)
		}
	}
	resp := forwardAuth(t, d, "GET", "", proxyHeaders("alice", "/api/orders", "GET", "203.0.113.9"))
	if ra, _ := strconv.Atoi(resp.Header.Get("Retry-After")); resp.StatusCode != 429 || ra < 1 || resp.Header.Get("RateLimit-Limit") != "3" {
		t.Fatalf("4th check: %d %v, want 429 with Retry-After >= 1 and the headers", resp.StatusCode, resp.Header)
	}
	// nginx mode: the same refusal as a 403 with the real status beside it.
	resp = forwardAuth(t, d, "GET", "?mode=nginx", proxyHeaders("alice", "/api/orders", "GET", "203.0.113.9"))
	if resp.StatusCode != 403 || resp.Header.Get(forwardauth.StatusHeader) != "429" || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("nginx mode refusal: %d %v", resp.StatusCode, resp.Header)
	}
	// Allowed in nginx mode: a plain 200.
	resp = forwardAuth(t, d, "GET", "?mode=nginx", proxyHeaders("bob", "/api/orders", "GET", "203.0.113.9"))
	if resp.StatusCode != 200 || resp.Header.Get(forwardauth.StatusHeader) != "" || resp.Header.Get("RateLimit-Remaining") != "2" {
		t.Fatalf("nginx mode, allowed: %d %v", resp.StatusCode, resp.Header)
	}
	// Any method: the proxy's own method does not matter.
	if resp := forwardAuth(t, d, "POST", "", proxyHeaders("carol", "/api/x", "DELETE", "203.0.113.9")); resp.StatusCode != 200 {
		t.Fatalf("POST: %d", resp.StatusCode)
	}
	// A path the upstream could route as another (/api/%2e%2e/admin as
	// /admin) is refused, in nginx mode with the reason beside the status,
	// and spends nothing: /admin then has its whole quota.
	if resp := forwardAuth(t, d, "GET", "", proxyHeaders("dave", "/api/%2e%2e/admin", "GET", "203.0.113.9")); resp.StatusCode != 400 {
		t.Fatalf("dotted path: %d, want 400", resp.StatusCode)
	}
	resp = forwardAuth(t, d, "GET", "?mode=nginx", proxyHeaders("dave", "/api/%2e%2e/admin", "GET", "203.0.113.9"))
	if resp.StatusCode != 403 || resp.Header.Get(forwardauth.StatusHeader) != "400" || !strings.Contains(resp.Header.Get(forwardauth.ErrorHeader), "X-Forwarded-Uri") {
		t.Fatalf("nginx mode, dotted path: %d %v, want 403 saying 400 with the reason", resp.StatusCode, resp.Header)
	}
	for i, want := range []int{200, 429} {
		if resp := forwardAuth(t, d, "GET", "", proxyHeaders("dave", "/admin", "GET", "203.0.113.9")); resp.StatusCode != want {
			t.Fatalf("/admin %d: %d, want %d (the admin rule)", i, resp.StatusCode, want)
		}
	}
	// X-Forwarded-For: the rightmost entry, appended by the proxy, counts;
	// what the client put left of it does not.
	for i := range 5 {
		code := forwardAuth(t, d, "POST", "", proxyHeaders("-", "/login", "POST", "1.1.1."+strconv.Itoa(i)+", 198.51.100.1")).StatusCode
		if code != 200 {
			t.Fatalf("login %d: %d", i, code)
		}
	}
	if code := forwardAuth(t, d, "POST", "", proxyHeaders("-", "/login", "POST", "9.9.9.9, 198.51.100.1")).StatusCode; code != 429 {
		t.Fatalf("6th login from one address: %d, want 429", code)
	}

	// The store goes away: a fail-closed rule is a 503 (in nginx mode a
	// 403 saying 503); a fail-open one still decides.
	cluster.StopAll()
	if resp := forwardAuth(t, d, "GET", "", proxyHeaders("-", "/login", "POST", "198.51.100.2")); resp.StatusCode != 503 {
		t.Fatalf("fail-closed with the store down: %d, want 503", resp.StatusCode)
	}
	resp = forwardAuth(t, d, "GET", "?mode=nginx", proxyHeaders("-", "/login", "POST", "198.51.100.2"))
	if resp.StatusCode != 403 || resp.Header.Get(forwardauth.StatusHeader) != "503" {
		t.Fatalf("fail-closed, nginx mode: %d %v", resp.StatusCode, resp.Header)
	}
	if resp := forwardAuth(t, d, "GET", "", proxyHeaders("erin", "/api/orders", "GET", "198.51.100.2")); resp.StatusCode != 200 {
		t.Fatalf("fail-open with the store down: %d, want 200", resp.StatusCode)
	}
}

// TestForwardAuthBadRequests: a missing or invalid header the proxy should
// have set is a 400 (a 403 saying 400 in nginx mode), never a decision.
func TestForwardAuthBadRequests(t *testing.T) {
	d := startForwardAuth(t, nil)
	tests := []struct {
		name    string
		headers map[string]string
	}{
		{"no identity", proxyHeaders("", "/api/x", "GET", "192.0.2.1")},
		{"no uri", proxyHeaders("u", "", "GET", "192.0.2.1")},
		{"uri not a path", proxyHeaders("u", "api/x", "GET", "192.0.2.1")},
		{"absolute uri", proxyHeaders("u", "http://example.com/api/x", "GET", "192.0.2.1")},
		{"no method", proxyHeaders("u", "/api/x", "", "192.0.2.1")},
		{"no client address", proxyHeaders("u", "/api/x", "GET", "")},
		{"client address not an IP", proxyHeaders("u", "/api/x", "GET", "300.1.1.1")},
		{"empty last address", proxyHeaders("u", "/api/x", "GET", "192.0.2.1, ")},
		{"identity over 512 bytes", proxyHeaders(strings.Repeat("u", 600), "/api/x", "GET", "192.0.2.1")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if resp := forwardAuth(t, d, "GET", "", tt.headers); resp.StatusCode != 400 {
				t.Fatalf("status %d, want 400", resp.StatusCode)
			}
			resp := forwardAuth(t, d, "GET", "?mode=nginx", tt.headers)
			if resp.StatusCode != 403 || resp.Header.Get(forwardauth.StatusHeader) != "400" {
				t.Fatalf("nginx mode: %d %v, want 403 saying 400", resp.StatusCode, resp.Header)
			}
		})
	}
}

func TestForwardAuthOptions(t *testing.T) {
	t.Run("off by default", func(t *testing.T) {
		d := startDaemon(t, nil)
		if code := forwardAuth(t, d, "GET", "", proxyHeaders("u", "/api/x", "GET", "192.0.2.1")).StatusCode; code != 404 {
			t.Fatalf("status %d, want 404", code)
		}
	})
	t.Run("configured headers; none turns one off", func(t *testing.T) {
		d := startForwardAuth(t, nil, func(o *Options) {
			o.ForwardAuth.Headers.User = ""
			o.ForwardAuth.Headers.APIKey = "X-Api-Client"
			o.ForwardAuth.Headers.URI = "X-Original-URI"
			o.ForwardAuth.Headers.Method = "X-Original-Method"
			o.ForwardAuth.Headers.IP = "X-Real-IP"
		})
		h := map[string]string{"X-Api-Client": "k1", "X-Original-URI": "/login", "X-Original-Method": "POST", "X-Real-IP": "192.0.2.1"}
		resp := forwardAuth(t, d, "GET", "", h)
		if resp.StatusCode != 200 || resp.Header.Get("RateLimit-Limit") != "5" {
			t.Fatalf("status %d %v, want 200 under the login rule", resp.StatusCode, resp.Header)
		}
		// The default names are not read any more.
		if code := forwardAuth(t, d, "GET", "", proxyHeaders("u", "/login", "POST", "192.0.2.1")).StatusCode; code != 400 {
			t.Fatalf("default header names: %d, want 400", code)
		}
	})
	t.Run("bad header name refused at start", func(t *testing.T) {
		o := DefaultOptions()
		o.Rules.File, o.ForwardAuth.Enabled, o.ForwardAuth.Headers.User, o.Logger = writeRules(t, forwardAuthRules), true, "X Auth: User", quietLogger()
		_, err := New(o)
		if err == nil || !strings.Contains(err.Error(), "--forward-auth.user-header") {
			t.Fatalf("New = %v, want an error naming --forward-auth.user-header", err)
		}
	})
}
