package httplimit

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/pkg/client"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// fakeChecker answers every check with resp or err and keeps the last
// attributes.
type fakeChecker struct {
	resp *limiterv1.CheckResponse
	err  error
	got  *limiterv1.Attributes
	cost float64
}

func (f *fakeChecker) CheckAttributes(_ context.Context, a *limiterv1.Attributes, cost float64) (*limiterv1.CheckResponse, error) {
	f.got, f.cost = a, cost
	return f.resp, f.err
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func okHandler(w http.ResponseWriter, _ *http.Request) {
	w.WriteHeader(http.StatusOK)
	_, _ = io.WriteString(w, "served")
}

func TestMiddlewareResponses(t *testing.T) {
	unreachable := fmt.Errorf("%w: %w", client.ErrUnreachable, status.Error(codes.Unavailable, "connection refused"))
	tests := []struct {
		name       string
		resp       *limiterv1.CheckResponse
		err        error
		failClosed bool
		code       int
		served     bool
		headers    map[string]string // "": absent
	}{
		{
			name: "allowed: served with the quota headers",
			resp: &limiterv1.CheckResponse{Allowed: true, Limit: 100, Remaining: 99, ResetAfterMs: 100, RuleId: "api", WindowMs: 10_000},
			code: 200, served: true,
			headers: map[string]string{"RateLimit-Limit": "100", "RateLimit-Remaining": "99", "RateLimit-Reset": "1",
				"RateLimit-Policy": `"api";q=100;w=10`, "Retry-After": ""},
		},
		{
			name: "over the limit: 429 with Retry-After rounded up",
			resp: &limiterv1.CheckResponse{Allowed: false, Limit: 100, RetryAfterMs: 100, ResetAfterMs: 10_000, RuleId: "api"},
			code: 429,
			headers: map[string]string{"Retry-After": "1", "RateLimit-Remaining": "0", "RateLimit-Reset": "10",
				"X-RateLimit-Limit": "100"},
		},
		{
			name: "fail-closed rule undecided: 503, not 429",
			err:  status.Error(codes.Unavailable, "store unavailable and the rule fails closed"),
			code: 503, headers: map[string]string{"Retry-After": "", "RateLimit-Limit": ""},
		},
		{
			name:       "fail-closed rule undecided, FailClosed: 503 too",
			err:        status.Error(codes.Unavailable, "store unavailable and the rule fails closed"),
			failClosed: true, code: 503,
		},
		{
			name: "limiterd unreachable: fails open by default",
			err:  unreachable, code: 200, served: true,
			headers: map[string]string{"RateLimit-Limit": "", "Retry-After": ""},
		},
		{
			name: "limiterd unreachable, FailClosed: 503",
			err:  unreachable, failClosed: true, code: 503,
		},
		{
			name: "limiterd too slow: fails open",
			err:  fmt.Errorf("%w: %w", client.ErrUnreachable, status.Error(codes.DeadlineExceeded, "deadline")),
			code: 200, served: true,
		},
		{
			name: "invalid check: fails open",
			err:  status.Error(codes.InvalidArgument, `attributes.ip: "300.1.1.1" is not an IP address`), code: 200, served: true,
		},
		{
			name: "invalid check, FailClosed: 503",
			err:  status.Error(codes.InvalidArgument, `attributes.ip: "300.1.1.1" is not an IP address`), failClosed: true, code: 503,
		},
		{
			name: "no rule matched: served, no quota headers",
			resp: &limiterv1.CheckResponse{Allowed: true}, code: 200, served: true,
			headers: map[string]string{"RateLimit-Limit": "", "RateLimit": ""},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeChecker{resp: tt.resp, err: tt.err}
			h := Middleware(f, Options{FailClosed: tt.failClosed, Logger: quiet})(http.HandlerFunc(okHandler))
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest("GET", "/api/orders", nil))
			if rec.Code != tt.code {
				t.Fatalf("status %d, want %d", rec.Code, tt.code)
			}
			if served := rec.Body.String() == "served"; served != tt.served {
				t.Fatalf("served = %v (body %q), want %v", served, rec.Body.String(), tt.served)
			}
			for name, want := range tt.headers {
				if got := rec.Header().Get(name); got != want {
					t.Errorf("%s = %q, want %q", name, got, want)
				}
			}
		})
	}
}

type ctxKey struct{}

// TestMiddlewareAttributes: the identity comes from the authenticated
// request (here its context), never from a header the client sends; the
// IP from the connection unless the proxy in front is trusted.
func TestMiddlewareAttributes(t *testing.T) {
	f := &fakeChecker{resp: &limiterv1.CheckResponse{Allowed: true}}
	opts := Options{
		Identity: func(r *http.Request) Identity {
			user, _ := r.Context().Value(ctxKey{}).(string)
			return Identity{User: user, APIKey: "key-of-" + user}
		},
		Plan:   func(*http.Request) string { return "pro" },
		Extra:  func(*http.Request) map[string]string { return map[string]string{"tenant": "t1"} },
		Cost:   func(*http.Request) float64 { return 2 },
		Logger: quiet,
	}
	h := Middleware(f, opts)(http.HandlerFunc(okHandler))
	r := httptest.NewRequest("POST", "/api/orders?x=1", nil)
	r.RemoteAddr = "198.51.100.7:4321"
	r.Header.Set("X-Forwarded-For", "203.0.113.9")
	r.Header.Set("X-Api-Key", "chosen-by-the-client")
	r = r.WithContext(context.WithValue(r.Context(), ctxKey{}, "alice"))
	h.ServeHTTP(httptest.NewRecorder(), r)
	want := &limiterv1.Attributes{User: "alice", ApiKey: "key-of-alice", Ip: "198.51.100.7", Path: "/api/orders",
		Method: "POST", Plan: "pro", Extra: map[string]string{"tenant": "t1"}}
	if f.got.String() != want.String() || f.cost != 2 {
		t.Fatalf("attributes %v cost %v, want %v cost 2", f.got, f.cost, want)
	}

	// Without Identity: no identity at all, whatever the headers say.
	h = Middleware(f, Options{Logger: quiet})(http.HandlerFunc(okHandler))
	h.ServeHTTP(httptest.NewRecorder(), r)
	if f.got.GetUser() != "" || f.got.GetApiKey() != "" || f.cost != 0 {
		t.Fatalf("default options: %v cost %v, want no identity and cost 0", f.got, f.cost)
	}
}

func TestClientIP(t *testing.T) {
	proxies := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")}
	tests := []struct {
		name    string
		remote  string
		xff     []string
		trusted []netip.Prefix
		want    string
	}{
		{"peer", "198.51.100.7:1234", nil, nil, "198.51.100.7"},
		{"peer ignores X-Forwarded-For", "198.51.100.7:1234", []string{"203.0.113.9"}, nil, "198.51.100.7"},
		{"IPv6 peer", "[2001:db8::1]:443", nil, nil, "2001:db8::1"},
		{"IPv4-mapped peer", "[::ffff:192.0.2.1]:443", nil, nil, "192.0.2.1"},
		{"unparsable peer", "@unix", nil, nil, ""},
		{"untrusted peer: header ignored", "198.51.100.7:1", []string{"203.0.113.9"}, proxies, "198.51.100.7"},
		{"trusted proxy", "10.1.2.3:1", []string{"203.0.113.9"}, proxies, "203.0.113.9"},
		{"client's own claims left of the real client are ignored", "10.1.2.3:1", []string{"1.2.3.4, 203.0.113.9"}, proxies, "203.0.113.9"},
		{"chain of trusted proxies", "10.1.2.3:1", []string{"203.0.113.9, 10.9.9.9", "fd00::5"}, proxies, "203.0.113.9"},
		{"only proxies: the farthest", "10.1.2.3:1", []string{"10.2.2.2"}, proxies, "10.2.2.2"},
		{"no header: the proxy", "10.1.2.3:1", nil, proxies, "10.1.2.3"},
		{"malformed entry stops the walk", "10.1.2.3:1", []string{"203.0.113.9, junk, 10.4.4.4"}, proxies, "10.4.4.4"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", "/", nil)
			r.RemoteAddr = tt.remote
			for _, v := range tt.xff {
				r.Header.Add("X-Forwarded-For", v)
			}
			ip := RemoteAddrIP
			if tt.trusted != nil {
				ip = ForwardedIP(tt.trusted...)
			}
			if got := ip(r); got != tt.want {
				t.Fatalf("client IP %q, want %q", got, tt.want)
			}
		})
	}
}

func TestRefused(t *testing.T) {
	answered := status.Error(codes.Unavailable, "fails closed")
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"limiterd's UNAVAILABLE", answered, true},
		{"wrapped, still limiterd's", fmt.Errorf("check: %w", answered), true},
		{"unreachable", fmt.Errorf("%w: %w", client.ErrUnreachable, answered), false},
		{"other code", status.Error(codes.Internal, "x"), false},
		{"plain error", io.EOF, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Refused(tt.err); got != tt.want {
				t.Fatalf("Refused(%v) = %v, want %v", tt.err, got, tt.want)
			}
		})
	}
}

var _ Checker = (*client.Client)(nil)

func TestNowOption(t *testing.T) {
	f := &fakeChecker{resp: &limiterv1.CheckResponse{Allowed: true, Limit: 1, ResetAfterMs: 5000, RuleId: "x"}}
	at := time.Unix(1_700_000_000, 0)
	h := Middleware(f, Options{Logger: quiet, Now: func() time.Time { return at }})(http.HandlerFunc(okHandler))
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
	if got := rec.Header().Get("X-RateLimit-Reset"); got != "1700000005" {
		t.Fatalf("X-RateLimit-Reset %q, want 1700000005", got)
	}
}
