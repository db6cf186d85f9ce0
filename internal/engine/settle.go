package engine

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/settlement"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// A settlement names the spend of a check that spent an estimate
// (request.Check.Settle), for Settle with the actual cost (see the
// settlement package for its format and its Book).

// Settlement is the settlement of it, for Settle: not empty only for an
// allowed item of a check that settles, decided in this region's store or
// in its key's home region's. It expires after the rule's settle_within.
// Each call names a new nonce.
func (e *Engine) Settlement(it *request.Item) string {
	return e.settle.Name(it, e.now(), it.Rule.SettleWindow())
}

// Settle replaces the estimate a check spent by its actual cost, once: an
// actual below the estimate gives the difference back to the bucket (never
// more than was spent, nothing of a window gone since), one above it takes
// the extra (into debt, bounded as another region's debits are). A pinned
// rule's key homed in another region is settled there (Home.Settle). For
// a reconciled rule the difference goes to the other regions as a spend
// (negative for a give-back). A Settle again changes nothing and answers
// as the first (Replay); after the rule's settle_within nothing changes
// (Expired). Errors: an *request.InvalidError naming settlement (a
// malformed, altered or foreign one; wrapping request.ErrUnknownRule for a
// rule no longer in force) or actual_cost, ErrNotSettled wrapping the
// store's or the home region's (a Settle again is safe), or the context's.
func (e *Engine) Settle(ctx context.Context, s string, actual float64) (settlement.Result, error) {
	t := e.table.Load()
	ts := e.topo.Use()
	defer ts.Release()
	r, err := e.settle.Settle(ctx, t, s, actual, e.now(), func(en *request.Entry, key string) bucket.Settler {
		return e.settlerOf(ts, en, key)
	})
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

// settlerOf is where a settlement of en's key settles under ts: the key's
// home region for a pinned rule homed elsewhere, else this region's store.
func (e *Engine) settlerOf(ts *homes.State, en *request.Entry, key string) bucket.Settler {
	if !en.Pinned || ts.Topo == nil {
		return e.store
	}
	home := ts.Topo.Home(key, en.Rule.HomeKeys)
	if home == e.region {
		return e.store
	}
	h := ts.Homes[home]
	if h == nil {
		return noSettler{fmt.Errorf("no client of region %s, the home of the key", home)}
	}
	return homeSettler{h: h, timeout: e.fwdTO}
}

// homeSettler settles at a key's home region, within the forward timeout.
type homeSettler struct {
	h       homes.Home
	timeout time.Duration
}

func (s homeSettler) Settle(ctx context.Context, st bucket.Settlement) (bucket.Settled, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	return s.h.Settle(ctx, st)
}

// noSettler settles nothing: err says why.
type noSettler struct{ err error }

func (s noSettler) Settle(context.Context, bucket.Settlement) (bucket.Settled, error) {
	return bucket.Settled{}, s.err
}

// SettleHere settles in this region's store, once, the estimate a pinned
// rule's check from another region spent here (the Peer service's
// Settle): s names the rule, the key, the estimate, the instant this
// region's store spent it, the actual cost and the settlement's id and
// TTL; its Limit is the rule's here. Errors: an *request.InvalidError
// naming the field (an unknown rule wraps request.ErrUnknownRule), or the
// store's.
func (e *Engine) SettleHere(ctx context.Context, s bucket.Settlement) (bucket.Settled, error) {
	en := e.table.Load().ByID[s.Rule]
	switch {
	case en == nil:
		return bucket.Settled{}, request.Invalid("rule_id", "rule_id: %w", request.UnknownRule(s.Rule))
	case en.Rule.Concurrent():
		return bucket.Settled{}, request.Invalid("rule_id", "rule_id: %q is a concurrency rule: nothing to settle", s.Rule)
	case bucket.ValidateKey(s.Key) != nil:
		return bucket.Settled{}, request.Invalid("key", "key: %w", bucket.ValidateKey(s.Key))
	case !(s.Cost > 0) || s.At <= 0:
		return bucket.Settled{}, request.Invalid("estimate", "estimate, spent_at_us: must be above 0, got %v, %d", s.Cost, s.At)
	case s.TTL <= 0 || s.TTL > rules.MaxSettleWithin+time.Minute:
		return bucket.Settled{}, request.Invalid("ttl_ms", "ttl_ms: must be above 0 and at most %v, got %v", rules.MaxSettleWithin+time.Minute, s.TTL)
	}
	if err := bucket.ValidateSettlement(&s); err != nil {
		return bucket.Settled{}, request.Invalid("actual_cost", "actual_cost, id: %w", err)
	}
	s.Limit = en.For(s.Key).Limit
	r, err := e.store.Settle(ctx, s)
	if err == nil && !r.Replay && r.Actual < s.Cost && e.deny != nil {
		e.deny.Forget(s.Rule, s.Key)
	}
	return r, err
}
