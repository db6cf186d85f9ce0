package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/settlement"
)

// A settlement names the spend of a check that spent an estimate
// (request.Check.Settle), for Settle with the actual cost (see the
// settlement package for its format and its Book).

// Settlement is the settlement of it, for Settle: not empty only for an
// allowed item of a check that settles, decided in this region's store.
// It expires after the rule's settle_within. Each call names a new nonce.
func (e *Engine) Settlement(it *request.Item) string {
	return e.settle.Name(it, e.now(), it.Rule.SettleWindow())
}

// Settle replaces the estimate a check spent by its actual cost, once: an
// actual below the estimate gives the difference back to the bucket (never
// more than was spent, nothing of a window gone since), one above it takes
// the extra (into debt, bounded as another region's debits are). For a
// reconciled rule the difference goes to the other regions as a spend
// (negative for a give-back). A Settle again changes nothing and answers
// as the first (Replay); after the rule's settle_within nothing changes
// (Expired). Errors: an *request.InvalidError naming settlement (a
// malformed, altered or foreign one; wrapping request.ErrUnknownRule for a
// rule no longer in force) or actual_cost, ErrNotSettled wrapping the
// store's (a Settle again is safe), or the context's.
func (e *Engine) Settle(ctx context.Context, s string, actual float64) (settlement.Result, error) {
	t := e.table.Load()
	r, err := e.settle.Settle(ctx, t, s, actual, e.now())
	if r.Rule != "" {
		result := metrics.SettleSettled
		switch {
		case err != nil:
			result = metrics.SettleError
		case r.Expired:
			result = metrics.SettleExpired
		case r.Replay:
			result = metrics.SettleReplay
		}
		e.m.Settlements.WithLabelValues(r.Rule, result).Inc()
	}
	var inv *request.InvalidError
	if err != nil && !errors.As(err, &inv) && ctx.Err() == nil {
		return r, fmt.Errorf("%w: %w", ErrNotSettled, err)
	}
	if err != nil || r.Settlement == nil || r.Replay {
		return r, err
	}
	st := r.Settlement
	delta := r.Actual - st.Estimate
	if delta < 0 && e.deny != nil {
		e.deny.Forget(st.Rule, st.Key)
	}
	e.tally.Settled(t.ByID[st.Rule], st.Key, delta)
	return r, nil
}
