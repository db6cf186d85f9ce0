package httplimit

import (
	"context"
	"errors"
	"net/http"
	"time"

	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/pkg/client"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// Acquirer takes and gives back the leases of concurrency rules;
// *client.Client is one. Renew's error is client.ErrLeaseGone when the
// lease is gone.
type Acquirer interface {
	AcquireAttributes(ctx context.Context, a *limiterv1.Attributes, cost float64) (*limiterv1.AcquireResponse, error)
	Release(ctx context.Context, leaseID string) (bool, error)
	Renew(ctx context.Context, leaseID string) (*limiterv1.RenewResponse, error)
}

// OutcomeReleaser is an Acquirer that reports a request's outcome when it
// releases its lease; *client.Client is one. Concurrency then reports how
// long the handler ran and whether it failed (a status of 500 or more, or
// a panic), which moves the limits of adaptive concurrency rules.
type OutcomeReleaser interface {
	ReleaseOutcome(ctx context.Context, leaseID string, o client.Outcome) (bool, error)
}

// ReleaseTimeout bounds the Release of a request's leases, which runs after
// the handler returned, on a context of its own (the request's may be
// cancelled: the client went away).
const ReleaseTimeout = time.Second

// Concurrency is Middleware for endpoints under concurrency rules ("at most
// 10 in flight per client"): it acquires before the handler, by the
// request's attributes, all or nothing with the rate rules they match, and
// releases when the handler returns, whether it returns normally, panics
// (the release runs, then the panic goes on) or returns because the
// client disconnected. While the handler runs, the leases are renewed at
// half their length, a failed renewal tried again every eighth of it. When
// a renewal says they are gone (the store lost them, or they expired while
// limiterd was unreachable), or their expiry comes with every renewal
// failing (the store then lets the slot go and grants it again), the
// request's context is cancelled, its cause client.ErrLeaseGone or
// ErrLeaseExpired, so the handler stops the work it no longer holds a
// slot for; it is logged and reported to Options.OnLeaseLost. A handler
// that ignores its context keeps running, and its slot may be held twice.
//
// When c is an OutcomeReleaser, the release reports the time from the
// Acquire's answer to the handler's return, and whether the handler
// failed: a status of 500 or more, or a panic.
//
// The Acquire carries the request's priority class (Options.Priority, as
// Middleware's checks). A refusal is 429 with Retry-After: for a
// concurrency rule, the time until the soonest lease held expires (a
// release may free a slot sooner); one only for the reserve a rule keeps
// for more important classes (Reason RESERVED) is 503 with Retry-After.
// The other answers (503, failing open) are Middleware's. It works for
// endpoints without concurrency rules too: an Acquire matching none is a
// Check.
func Concurrency(c Acquirer, opts Options) func(http.Handler) http.Handler {
	opts = opts.withDefaults()
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			a, cost := opts.attributes(r)
			actx := r.Context()
			if opts.Priority != nil {
				actx = client.WithPriority(actx, opts.Priority(r))
			}
			sent := time.Now()
			resp, err := c.AcquireAttributes(actx, a, cost)
			if err != nil {
				if opts.failed(w, r, err) {
					next.ServeHTTP(w, r)
				}
				return
			}
			check := checkOf(resp)
			SetHeaders(w.Header(), check, opts.Now())
			if !resp.GetAllowed() {
				RefuseCheck(w, check)
				return
			}
			id := resp.GetLeaseId()
			if id == "" {
				next.ServeHTTP(w, r)
				return
			}
			start := time.Now()
			sw := &statusWriter{ResponseWriter: w}
			panicked := true
			ctx, cancel := context.WithCancelCause(r.Context())
			renewed := make(chan struct{})
			go func() {
				defer close(renewed)
				opts.renew(ctx, r, cancel, c, id, time.Duration(resp.GetLeaseTtlMs())*time.Millisecond, sent)
			}()
			defer func() {
				cancel(nil)
				<-renewed
				rctx, rcancel := context.WithTimeout(context.WithoutCancel(r.Context()), ReleaseTimeout)
				defer rcancel()
				var err error
				if or, ok := c.(OutcomeReleaser); ok {
					_, err = or.ReleaseOutcome(rctx, id, client.Outcome{Duration: time.Since(start), Failed: panicked || sw.status >= http.StatusInternalServerError})
				} else {
					_, err = c.Release(rctx, id)
				}
				if err != nil {
					opts.Logger.Warn("lease not released: it expires on its own", "path", r.URL.Path, "err", err)
				}
			}()
			next.ServeHTTP(sw, r.WithContext(ctx))
			panicked = false
		})
	}
}

// ErrLeaseExpired is the cause (context.Cause) of a request's context
// cancelled by Concurrency because its lease reached its expiry while every
// renewal failed (limiterd unreachable): the store has let the slot go and
// may grant it to another request, so this one must stop.
var ErrLeaseExpired = errors.New("httplimit: lease expired: every renewal failed until its expiry")

// renewRetries is how many times a failed renewal is tried again within
// half a lease, before the lease's expiry ends the request.
const renewRetries = 4

// renew renews the lease id (of length ttl, taken at granted, a time no
// later than the store's grant) at half its length until ctx ends. A
// failed renewal is tried again every ttl/8; when the lease is gone, or
// its expiry comes with no renewal through, it cancels the request with
// the cause (client.ErrLeaseGone, ErrLeaseExpired): the expiry is reckoned
// on this clock from before the Acquire or Renew was sent, so it comes no
// later than the store's.
func (o *Options) renew(ctx context.Context, r *http.Request, cancel context.CancelCauseFunc, c Acquirer, id string, ttl time.Duration, granted time.Time) {
	if ttl <= 0 {
		return
	}
	expiry, next := granted.Add(ttl), granted.Add(ttl/2)
	lost := func(cause error) {
		o.Logger.Warn("lease lost while the request ran: request cancelled", "path", r.URL.Path, "err", cause)
		cancel(cause)
		if o.OnLeaseLost != nil {
			o.OnLeaseLost(r, cause)
		}
	}
	for {
		t := time.NewTimer(min(time.Until(next), time.Until(expiry)))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		sent := time.Now()
		if !sent.Before(expiry) {
			lost(ErrLeaseExpired)
			return
		}
		rctx, rcancel := context.WithDeadline(ctx, expiry)
		resp, err := c.Renew(rctx, id)
		rcancel()
		switch {
		case ctx.Err() != nil:
			return
		case err == nil:
			if d := time.Duration(resp.GetLeaseTtlMs()) * time.Millisecond; d > 0 {
				ttl = d
			}
			expiry, next = sent.Add(ttl), sent.Add(ttl/2)
		case errors.Is(err, client.ErrLeaseGone):
			lost(err)
			return
		default:
			// Tried again soon: the lease holds until its expiry only.
			o.Logger.Warn("lease renewal failed", "code", status.Code(err).String(), "err", err)
			next = time.Now().Add(ttl / (2 * renewRetries))
		}
	}
}

// checkOf is an Acquire's answer as SetHeaders reads a check's.
func checkOf(a *limiterv1.AcquireResponse) *limiterv1.CheckResponse {
	return &limiterv1.CheckResponse{
		Allowed: a.GetAllowed(), Remaining: a.GetRemaining(), Limit: a.GetLimit(),
		RetryAfterMs: a.GetRetryAfterMs(), RuleId: a.GetRuleId(), Statuses: a.GetStatuses(), Reason: a.GetReason(),
	}
}

// statusWriter records the status a handler writes. Unwrap lets
// http.ResponseController reach the writer's other capabilities (Flush,
// Hijack, deadlines).
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 && code >= http.StatusOK { // not an informational 1xx
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Flush passes a flush on, for handlers that stream.
func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
