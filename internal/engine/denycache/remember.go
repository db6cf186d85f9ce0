package denycache

import (
	"math"
	"time"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// Remember puts in c the refusals of items, some of r's, that this
// region's store or a home region decided, r routed at sent (Now); and,
// when their spends stand (admitted), for allowed ones whose answer shows
// the next check of the same cost must fail, that denial too. (In a
// refused check the allowed ones were given back.) The items it puts are
// marked Remembered. A nil Cache remembers nothing.
func (c *Cache) Remember(r *request.Request, items []*request.Item, sent int64, admitted bool) {
	if c == nil {
		return
	}
	for _, it := range items {
		if it.Route != request.RouteStore && it.Route != request.RouteHome {
			continue
		}
		d := it.Decision
		if !d.Allowed && it.Keep > 0 {
			// Refused above what its class keeps: a more important
			// class may still pass.
			continue
		}
		retry := d.RetryAfter
		if d.Allowed && (it.Batch > 0 || !admitted || r.MaxWait > 0) {
			// The lease holds what the batch left over, or given back;
			// or a reservation, which says nothing of an unpaced check.
			continue
		}
		if !d.Allowed && r.MaxWait > 0 {
			// A paced refusal's retry counts from its wait: an unpaced
			// check of the same cost is refused for the wait longer.
			retry += r.MaxWait
		}
		if d.Allowed {
			var ok bool
			if retry, ok = nextDenial(it.Against, d, it.Cost); !ok {
				continue
			}
		}
		if c.Put(r.Table.Gen, it.Rule.ID, it.Key, it.Cost, sent, retry, d.ResetAfter) {
			it.Remembered = true
		}
	}
}

// nextDenial tells, from an allowed decision, how long another check of the
// same cost is sure to be refused: when fewer tokens remain than it costs, a
// token bucket needs (cost - remaining) / rate, a fixed window its end.
// Other algorithms report too little to be sure.
func nextDenial(l bucket.Limit, d bucket.Decision, cost float64) (time.Duration, bool) {
	if d.Remaining >= cost {
		return 0, false
	}
	switch l.Algorithm {
	case bucket.TokenBucket:
		// The store's arithmetic: whole microseconds, rounded up.
		return time.Duration(math.Ceil((cost-d.Remaining)*1e6/l.RefillPerSecond)) * time.Microsecond, true
	case bucket.FixedWindow:
		return d.ResetAfter, true
	}
	return 0, false
}
