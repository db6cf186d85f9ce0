package settlement

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// MaxActualCost bounds the actual cost of a Settle: the largest cost a
// spend record carries to the other regions (gossip.MaxCost).
const MaxActualCost = 1e15

// slack is how long past its expiry a settlement's record is kept: the
// expiry is read on the clock of the process that settles it, which may
// run ahead of the one that made it.
const slack = time.Minute

// Book names the spends of checks that spent an estimate, and settles
// them, each once.
type Book struct {
	key []byte
	// invalid counts the Settles refused as invalid, by field.
	invalid *prometheus.CounterVec
}

// NewBook names settlements with Key(secret), counting those refused as
// invalid in invalid, by field.
func NewBook(secret []byte, invalid *prometheus.CounterVec) *Book {
	return &Book{key: Key(secret), invalid: invalid}
}

// Name is the settlement of it, settled before now + within: not empty
// only for an allowed item decided in a store, this region's or its key's
// home region's (at a known instant). Each call names a new nonce.
func (b *Book) Name(it *request.Item, now time.Time, within time.Duration) string {
	d := it.Decision
	if it.Route != request.RouteStore && it.Route != request.RouteHome || !d.Allowed || d.At <= 0 {
		return ""
	}
	return Name(b.key, Settlement{Rule: it.Rule.ID, Key: it.Key, Estimate: it.Cost, At: d.At,
		Expires: now.Add(within).UnixMilli()})
}

// Result is what a Settle did.
type Result struct {
	// Rule is the settlement's rule, once it is known valid.
	Rule string
	// Settlement is the settlement settled (nil when it expired, or its
	// rule can no longer settle it).
	Settlement *Settlement
	// Settled: by this call, or by an earlier one (Replay). Actual is the
	// cost settled: the first Settle's for a Replay.
	Settled, Replay bool
	Actual          float64
	// Expired: past its expiry, the estimate stands.
	Expired bool
}

// Settle settles the settlement s with actual at now, once, in the store
// where picks for its rule's entry and key (this region's, or the key's
// home region's).
// Errors: an *request.InvalidError naming settlement (for a malformed or
// altered one, or one made with another key, and wrapping
// request.ErrUnknownRule for a rule no longer in force) or actual_cost (not
// finite, negative or above MaxActualCost), or the store's.
func (b *Book) Settle(ctx context.Context, t *request.Table, s string, actual float64, now time.Time,
	where func(en *request.Entry, key string) bucket.Settler) (Result, error) {
	if !(actual >= 0) || math.IsInf(actual, 0) || actual > MaxActualCost {
		b.invalid.WithLabelValues("actual_cost").Inc()
		return Result{}, request.Invalid("actual_cost", "actual_cost: %w: must be finite, >= 0 and at most %g, got %v",
			bucket.ErrInvalidCost, MaxActualCost, actual)
	}
	st, err := Parse(b.key, s)
	if err != nil {
		b.invalid.WithLabelValues("settlement").Inc()
		return Result{}, request.Invalid("settlement", "settlement: %w", err)
	}
	en := t.ByID[st.Rule]
	if en == nil {
		b.invalid.WithLabelValues("settlement").Inc()
		return Result{}, request.Invalid("settlement", "settlement: %w", request.UnknownRule(st.Rule))
	}
	left := time.UnixMilli(st.Expires).Sub(now)
	if left <= 0 {
		return Result{Rule: st.Rule, Expired: true}, nil
	}
	if en.Rule.Concurrent() {
		return Result{Rule: st.Rule}, nil // the rule changed kind: the estimate stands
	}
	res, err := where(en, st.Key).Settle(ctx, bucket.Settlement{
		Request: bucket.Request{Rule: st.Rule, Key: st.Key, Limit: en.For(st.Key).Limit, Cost: st.Estimate},
		At:      st.At, Actual: actual, ID: st.Nonce.String(), TTL: left + slack,
	})
	if err != nil {
		return Result{Rule: st.Rule}, fmt.Errorf("settle: %w", err)
	}
	return Result{Rule: st.Rule, Settlement: st, Settled: true, Replay: res.Replay, Actual: res.Actual}, nil
}
