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

// TestMiddlewarePriority: the request's class goes with its check, and a
// refusal for the reserve of more important classes is a 503 with
// Retry-After, not a 429.
func TestMiddlewarePriority(t *testing.T) {
	c := &priorityChecker{fakeChecker: fakeChecker{resp: &limiterv1.CheckResponse{
		Allowed: false, Limit: 100, Remaining: 20, RetryAfterMs: 2500, RuleId: "shed", Reason: limiterv1.Reason_RESERVED}}}
	h := Middleware(c, Options{Priority: func(r *http.Request) string {
		if r.URL.Path == "/checkout" {
			return "critical"
		}
		return "sheddable"
	}, Logger: quiet})(http.HandlerFunc(okHandler))
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/feed", nil))
	if rec.Code != http.StatusServiceUnavailable || rec.Header().Get("Retry-After") != "3" || c.class != "sheddable" {
		t.Fatalf("reserved refusal: %d, Retry-After %q, class %q; want 503, 3, sheddable", rec.Code, rec.Header().Get("Retry-After"), c.class)
	}
	c.resp.Reason = limiterv1.Reason_REASON_LIMIT
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/checkout", nil))
	if rec.Code != http.StatusTooManyRequests || c.class != "critical" {
		t.Fatalf("limit refusal: %d, class %q; want 429, critical", rec.Code, c.class)
	}
}
