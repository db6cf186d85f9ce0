package limiterd

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/frontdoor/forwardauth"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

const priorityRules = `rules:
  - id: shed
    capacity: 10
    refill_per_second: 0.001
    key_by: global
    reserve: {gold: 0.3, default: 0.2}
    match: {path: /api/**}
`

// classDaemon starts limiterd on its memory store with the rules of yaml
// and the priority classes gold, default and bulk, and a client of it.
func classDaemon(t *testing.T, yaml string) (*Daemon, limiterv1.LimiterClient) {
	t.Helper()
	d := startDaemon(t, nil, func(o *Options) {
		o.Rules.File = writeRules(t, yaml)
		o.Rules.PriorityClasses = []string{"gold", "default", "bulk"}
	})
	return d, limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
}

// answer is limiterd's answer to a check or an Acquire.
type answer interface {
	GetAllowed() bool
	GetReason() limiterv1.Reason
	GetRetryAfterMs() int64
}

// classSteps take a rule of 10 with reserve {gold: 0.3, default: 0.2} in
// turn, each n of it (a check's cost, or n Acquires) as its priority,
// each answered allowed or not, with its reason.
var classSteps = []struct {
	priority string
	n        int
	allowed  bool
	reason   limiterv1.Reason
}{
	{"bulk", 5, true, limiterv1.Reason_REASON_UNSPECIFIED},
	{"bulk", 1, false, limiterv1.Reason_RESERVED},      // keeps gold's 3 and default's 2
	{"", 2, true, limiterv1.Reason_REASON_UNSPECIFIED}, // default keeps gold's 3
	{"critical", 1, false, limiterv1.Reason_RESERVED},  // not configured: default
	{"gold", 3, true, limiterv1.Reason_REASON_UNSPECIFIED},
	{"gold", 1, false, limiterv1.Reason_REASON_LIMIT},
}

// runClassSteps takes classSteps through take, which answers each step's
// decisions, and fails on one that differs from its step; a refusal has
// a retry.
func runClassSteps(t *testing.T, take func(priority string, n int) []answer) {
	t.Helper()
	for i, step := range classSteps {
		for _, resp := range take(step.priority, step.n) {
			if resp.GetAllowed() != step.allowed || resp.GetReason() != step.reason || !step.allowed && resp.GetRetryAfterMs() <= 0 {
				t.Fatalf("step %d (%q, %d): %v; want allowed %v, reason %v", i, step.priority, step.n, resp, step.allowed, step.reason)
			}
		}
	}
}

// wantInvalidPriority fails unless err, the answer to a class name over
// 32 bytes, is INVALID_ARGUMENT naming priority.
func wantInvalidPriority(t *testing.T, err error) {
	t.Helper()
	if status.Code(err) != codes.InvalidArgument || !strings.HasPrefix(status.Convert(err).Message(), "priority") {
		t.Fatalf("an over-long class: %v, want INVALID_ARGUMENT naming priority", err)
	}
}

// wantClassSeries fails unless d's metrics count classSteps' refusals by
// class: bulk's and default's for the reserve, gold's for the limit.
func wantClassSeries(t *testing.T, d *Daemon) {
	t.Helper()
	body := scrape(t, d)
	for _, series := range []string{`limiter_priority_decisions_total{class="bulk",result="reserved"} 1`,
		`limiter_priority_decisions_total{class="default",result="reserved"} 1`, `limiter_priority_decisions_total{class="gold",result="limited"} 1`} {
		if !strings.Contains(body, series) {
			t.Errorf("metrics lack %s", series)
		}
	}
}

// TestPriorityCheck: over gRPC, a check's priority picks what it keeps of
// a rule's reserve, among the classes of --priority.classes; a refusal for
// the reserve alone answers reason RESERVED, one for the limit LIMIT; a
// class name over 32 bytes is INVALID_ARGUMENT naming priority.
func TestPriorityCheck(t *testing.T) {
	d, client := classDaemon(t, priorityRules)
	runClassSteps(t, func(priority string, n int) []answer {
		resp, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "shed", Key: "all", Cost: float64(n), Priority: priority})
		if err != nil {
			t.Fatal(err)
		}
		return []answer{resp}
	})
	_, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "shed", Key: "all", Priority: strings.Repeat("g", 33)})
	wantInvalidPriority(t, err)
	wantClassSeries(t, d)
}

// TestPriorityAcquire: over gRPC, an Acquire's priority picks what it
// keeps of a concurrency rule's reserve: a refusal for the reserve alone
// answers reason RESERVED with a retry, one at the limit LIMIT; a class
// name over 32 bytes is INVALID_ARGUMENT naming priority. GetUsage answers
// as an Acquire of its priority: the leases free for the class.
func TestPriorityAcquire(t *testing.T) {
	d, client := classDaemon(t, `rules:
  - id: inflight
    algorithm: concurrency
    limit: 10
    key_by: global
    reserve: {gold: 0.3, default: 0.2}
    match: {path: /api/**}
`)
	acquire := func(priority, key string, n int) []answer {
		t.Helper()
		out := make([]answer, n)
		for i := range out {
			resp, err := client.Acquire(context.Background(), &limiterv1.AcquireRequest{RuleId: "inflight", Key: key, Priority: priority})
			if err != nil {
				t.Fatal(err)
			}
			out[i] = resp
		}
		return out
	}
	runClassSteps(t, func(priority string, n int) []answer { return acquire(priority, "all", n) })
	// 5 of another key's 10 held: bulk's room (10 - 3 - 2).
	for _, resp := range acquire("bulk", "other", 5) {
		if !resp.GetAllowed() {
			t.Fatalf("bulk lease of other: %v", resp)
		}
	}
	for _, u := range []struct {
		priority  string
		allowed   bool
		remaining float64
	}{{"bulk", false, 0}, {"", true, 2}, {"gold", true, 5}} {
		resp, err := client.GetUsage(context.Background(), &limiterv1.GetUsageRequest{RuleId: "inflight", Key: "other", Priority: u.priority})
		if err != nil {
			t.Fatal(err)
		}
		ru := resp.GetUsages()[0]
		if ru.GetAllowed() != u.allowed || ru.GetRemaining() != u.remaining || ru.GetInFlight() != 5 || ru.GetLimit() != 10 || !u.allowed && ru.GetRetryAfterMs() <= 0 {
			t.Fatalf("usage as %q: %v; want allowed %v, %v left, 5 in flight of 10", u.priority, ru, u.allowed, u.remaining)
		}
	}
	_, err := client.Acquire(context.Background(), &limiterv1.AcquireRequest{RuleId: "inflight", Key: "all", Priority: strings.Repeat("g", 33)})
	wantInvalidPriority(t, err)
	wantClassSeries(t, d)
}

// TestPriorityForwardAuth: forward-auth reads the class from the proxy's
// priority header, and answers a refusal for the reserve alone 503 with
// Retry-After (in nginx mode 403 with the 503 beside it), one for the
// limit 429.
func TestPriorityForwardAuth(t *testing.T) {
	d := startForwardAuth(t, nil, func(o *Options) {
		o.Rules.File = writeRules(t, strings.Replace(priorityRules, "{gold: 0.3, default: 0.2}", "{critical: 0.2, default: 0.1}", 1))
	})
	ask := func(priority, query string) *http.Response {
		t.Helper()
		h := proxyHeaders("alice", "/api/x", "GET", "203.0.113.9")
		if priority != "" {
			h[forwardauth.DefaultPriorityHeader] = priority
		}
		return forwardAuth(t, d, "GET", query, h)
	}
	// Sheddable keeps critical's 2 and default's 1 of the 10.
	for i := range 7 {
		if resp := ask("sheddable", ""); resp.StatusCode != 200 {
			t.Fatalf("sheddable check %d: %d", i, resp.StatusCode)
		}
	}
	if resp := ask("sheddable", ""); resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("sheddable into the reserve: %d %v; want 503 with Retry-After", resp.StatusCode, resp.Header)
	}
	if resp := ask("sheddable", "?mode=nginx"); resp.StatusCode != 403 || resp.Header.Get(forwardauth.StatusHeader) != "503" {
		t.Fatalf("nginx mode: %d %v; want 403 with %s 503", resp.StatusCode, resp.Header, forwardauth.StatusHeader)
	}
	if resp := ask("", ""); resp.StatusCode != 200 {
		t.Fatalf("default: %d", resp.StatusCode)
	}
	for range 2 {
		if resp := ask("critical", ""); resp.StatusCode != 200 {
			t.Fatalf("critical: %d", resp.StatusCode)
		}
	}
	if resp := ask("critical", ""); resp.StatusCode != 429 || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("critical on empty: %d %v; want 429", resp.StatusCode, resp.Header)
	}
}

// TestPriorityClassesFlag: --priority.classes must name default among at
// most 16 valid classes, and a rule's reserve only classes it names.
func TestPriorityClassesFlag(t *testing.T) {
	opts := DefaultOptions()
	opts.Rules.File = writeRules(t, priorityRules)
	opts.Rules.PriorityClasses = []string{"gold", "bulk"}
	if _, err := New(opts); err == nil || !strings.Contains(err.Error(), "--priority.classes:") {
		t.Fatalf("New without default among the classes = %v, want an error naming --priority.classes", err)
	}
	opts.Rules.PriorityClasses = DefaultOptions().Rules.PriorityClasses
	if _, err := New(opts); err == nil || !strings.Contains(err.Error(), "reserve.gold") {
		t.Fatalf("New with a reserve for a class not configured = %v, want an error naming reserve.gold", err)
	}
}
