package lease

import (
	"context"

	"github.com/limiterd/limiterd/internal/engine/denycache"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// The token lease stage's side: a check's items served from the leases.

// Serve hands it.Cost out of this instance's lease of its rule and key.
// When the lease runs short and no other check is taking the next batch,
// it makes this check the one to take it, with the store call of the
// check (its Route stays request.RouteNone, its Batch set); checks that
// arrive meanwhile wait for that batch, and are refused by a denial deny
// (when not nil) learned meanwhile.
func (l *Leases) Serve(ctx context.Context, it *request.Item, deny *denycache.Cache) (bool, error) {
	for {
		left, ok, wait, fetch := l.Take(it.Rule.ID, it.Key, it.Cost)
		switch {
		case ok:
			it.Route = request.RouteLease
			it.Decision = bucket.Decision{Allowed: true, Remaining: left, Limit: it.Limits.Limit.Capacity}
			return true, nil
		case fetch:
			it.Batch = max(it.Rule.Lease, it.Cost)
			return true, nil
		case wait == nil:
			// No room for another lease: this check alone, through the store.
			return true, nil
		default:
			select {
			case <-wait:
			case <-ctx.Done():
				return false, ctx.Err()
			}
			if deny != nil {
				if retry, reset, hit, _ := deny.Get(it.Rule.ID, it.Key, it.Cost); hit {
					it.Route = request.RouteDeny
					it.Decision = bucket.Decision{Limit: it.Limits.Limit.Capacity, RetryAfter: retry, ResetAfter: reset}
					return false, nil
				}
			}
		}
	}
}

// EndBatches ends the lease batches that the items of local, a check's
// decided in the store, took (Serve): each adds what it left over when the
// check was admitted from the store, and wakes the key's checks waiting
// for it. The engine calls it on each return of a check once a batch may
// be taken.
func (l *Leases) EndBatches(local []*request.Item, admitted bool) {
	for _, it := range local {
		if it.Batch > 0 {
			left := 0.0
			if admitted && it.Route == request.RouteStore {
				left = it.Batch - it.Cost
			}
			l.Fetched(it.Rule.ID, it.Key, left)
		}
	}
}
