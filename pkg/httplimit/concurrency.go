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
// half their length; when a renewal says they are gone (the store lost
// them, or they expired while limiterd was unreachable), the request's
// context is cancelled so the handler stops the work it no longer holds a
// slot for.
//
// A refusal is 429 with Retry-After: for a concurrency rule, the time until
// the soonest lease held expires (a release may free a slot sooner). The
// other answers (503, failing open) are Middleware's. It works for
// endpoints without concurrency rules too: an Acquire matching none is a
// Check.
func Concurrency(c Acquirer, opts Options) func(http.Handler) http.Handler {
	opts = opts.withDefaults()
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			a, cost := opts.attributes(r)
			resp, err := c.AcquireAttributes(r.Context(), a, cost)
			if err != nil {
				if opts.failed(w, r, err) {
					next.ServeHTTP(w, r)
				}
				return
			}
			SetHeaders(w.Header(), checkOf(resp), opts.Now())
			if !resp.GetAllowed() {
				http.Error(w, "too many requests", http.StatusTooManyRequests)
				return
			}
			id := resp.GetLeaseId()
			if id == "" {
				next.ServeHTTP(w, r)
				return
			}
			ctx, cancel := context.WithCancel(r.Context())
			renewed := make(chan struct{})
			go func() {
				defer close(renewed)
				opts.renew(ctx, cancel, c, id, time.Duration(resp.GetLeaseTtlMs())*time.Millisecond)
			}()
			defer func() {
				cancel()
				<-renewed
				rctx, rcancel := context.WithTimeout(context.WithoutCancel(r.Context()), ReleaseTimeout)
				defer rcancel()
				if _, err := c.Release(rctx, id); err != nil {
					opts.Logger.Warn("lease not released: it expires on its own", "path", r.URL.Path, "err", err)
				}
			}()
			next.ServeHTTP(w, r.WithContext(ctx))
		})
	}
}

// renew renews the lease id every half of ttl until ctx ends; when it is
// gone it cancels the request.
func (o *Options) renew(ctx context.Context, cancel context.CancelFunc, c Acquirer, id string, ttl time.Duration) {
	if ttl <= 0 {
		return
	}
	t := time.NewTicker(ttl / 2)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		_, err := c.Renew(ctx, id)
		switch {
		case errors.Is(err, client.ErrLeaseGone):
			o.Logger.Warn("lease gone while the request ran: request cancelled", "id_len", len(id))
			cancel()
			return
		case err != nil && ctx.Err() == nil:
			// Another try at the next tick; the lease holds until its expiry.
			o.Logger.Warn("lease renewal failed", "code", status.Code(err).String(), "err", err)
		}
	}
}

// checkOf is an Acquire's answer as SetHeaders reads a check's.
func checkOf(a *limiterv1.AcquireResponse) *limiterv1.CheckResponse {
	return &limiterv1.CheckResponse{
		Allowed: a.GetAllowed(), Remaining: a.GetRemaining(), Limit: a.GetLimit(),
		RetryAfterMs: a.GetRetryAfterMs(), RuleId: a.GetRuleId(), Statuses: a.GetStatuses(),
	}
}
