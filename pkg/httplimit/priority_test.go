package httplimit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/limiterd/limiterd/pkg/client"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// priorityChecker answers as fakeChecker, keeping the class of the check.
type priorityChecker struct {
	fakeChecker
	class string
}

func (p *priorityChecker) CheckAttributes(ctx context.Context, a *limiterv1.Attributes, cost float64) (*limiterv1.CheckResponse, error) {
	p.class = client.PriorityOf(ctx)
	return p.fakeChecker.CheckAttributes(ctx, a, cost)
}

// classOfPath is an Options.Priority: critical for /checkout, sheddable
// for the rest.
func classOfPath(r *http.Request) string {
	if r.URL.Path == "/checkout" {
		return "critical"
	}
	return "sheddable"
}

// serve answers a GET of path through h.
func serve(h http.Handler, path string) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
	return rec
}

// wantClassRefusals holds h, whose limiterd answers every request
// refused with a retry of 2.5 s, reason RESERVED until limit is called
// and REASON_LIMIT after: /feed, sheddable, is refused 503 with
// Retry-After 3; /checkout, critical, 429. class is the class the last
// request sent.
func wantClassRefusals(t *testing.T, h http.Handler, limit func(), class func() string) {
	t.Helper()
	if rec := serve(h, "/feed"); rec.Code != http.StatusServiceUnavailable || rec.Header().Get("Retry-After") != "3" || class() != "sheddable" {
		t.Fatalf("reserved refusal: %d, Retry-After %q, class %q; want 503, 3, sheddable", rec.Code, rec.Header().Get("Retry-After"), class())
	}
	limit()
	if rec := serve(h, "/checkout"); rec.Code != http.StatusTooManyRequests || rec.Header().Get("Retry-After") != "3" || class() != "critical" {
		t.Fatalf("limit refusal: %d, Retry-After %q, class %q; want 429, 3, critical", rec.Code, rec.Header().Get("Retry-After"), class())
	}
}

// TestMiddlewarePriority: the request's class goes with its check, and a
// refusal for the reserve of more important classes is a 503 with
// Retry-After, not a 429.
func TestMiddlewarePriority(t *testing.T) {
	c := &priorityChecker{fakeChecker: fakeChecker{resp: &limiterv1.CheckResponse{
		Allowed: false, Limit: 100, Remaining: 20, RetryAfterMs: 2500, RuleId: "shed", Reason: limiterv1.Reason_RESERVED}}}
	h := Middleware(c, Options{Priority: classOfPath, Logger: quiet})(http.HandlerFunc(okHandler))
	wantClassRefusals(t, h, func() { c.resp.Reason = limiterv1.Reason_REASON_LIMIT }, func() string { return c.class })
}

// priorityAcquirer answers every Acquire with resp, keeping its class.
type priorityAcquirer struct {
	fakeAcquirer
	resp  *limiterv1.AcquireResponse
	class string
}

func (p *priorityAcquirer) AcquireAttributes(ctx context.Context, _ *limiterv1.Attributes, _ float64) (*limiterv1.AcquireResponse, error) {
	p.class = client.PriorityOf(ctx)
	return p.resp, nil
}

// TestConcurrencyPriority: Concurrency sends the request's class with its
// Acquire, from the same option as Middleware, and answers a refusal for
// the reserve of more important classes 503 with Retry-After, one at the
// limit 429.
func TestConcurrencyPriority(t *testing.T) {
	a := &priorityAcquirer{resp: &limiterv1.AcquireResponse{Allowed: false, Limit: 20, RetryAfterMs: 2500, RuleId: "inflight", Reason: limiterv1.Reason_RESERVED}}
	h := Concurrency(a, Options{Priority: classOfPath, Logger: quiet})(http.HandlerFunc(okHandler))
	wantClassRefusals(t, h, func() { a.resp.Reason = limiterv1.Reason_REASON_LIMIT }, func() string { return a.class })
	// Without the option, the class is the request context's.
	h = Concurrency(a, Options{Logger: quiet})(http.HandlerFunc(okHandler))
	r := httptest.NewRequest("GET", "/feed", nil)
	h.ServeHTTP(httptest.NewRecorder(), r.WithContext(client.WithPriority(r.Context(), "default")))
	if a.class != "default" {
		t.Fatalf("class without the option: %q, want the context's", a.class)
	}
}
