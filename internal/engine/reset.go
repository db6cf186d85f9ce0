package engine

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// ErrNotHome: a reset of a key of a pinned rule whose home is another
// region. Only the home holds the key's bucket; the reset must be asked
// there (the error names the home).
var ErrNotHome = errors.New("the key's home is another region")

// ResetRecorder carries a key's reset to the other regions, ordered
// before the spends admitted after it (gossip.Accumulator).
type ResetRecorder interface {
	Reset(rule, key string, atMicros int64)
}

// ResetKey puts the bucket of key under the rule ruleID back to full in
// this region's store and in this instance's fallback, forgets this
// instance's denial of it, and, for a
// reconciled rule when Options.Resets is set, records the reset for the
// other regions; propagated reports that last step. Errors: an
// *request.InvalidError naming rule_id (an unknown rule, wrapping
// request.ErrUnknownRule; a concurrency rule, wrapping
// request.ErrConcurrencyRule, whose leases their holders release) or key;
// ErrNotHome for a pinned rule's key homed elsewhere; the store's error,
// and then nothing was reset.
//
// The reset is exact here. Spends this instance admitted before it are
// forgiven in every region; the other instances' spends not yet published,
// and what the other regions admitted before they applied the reset, still
// count after it there. Other instances' denials of the key last until
// their retry time at the latest.
func (e *Engine) ResetKey(ctx context.Context, ruleID, key string) (propagated bool, err error) {
	en := e.table.Load().ByID[ruleID]
	switch {
	case en == nil:
		return false, request.Invalid("rule_id", "rule_id: %w", request.UnknownRule(ruleID))
	case en.Rule.Concurrent():
		return false, request.Invalid("rule_id", "rule_id: %q: %w: its leases are released by their holders, not reset",
			ruleID, request.ErrConcurrencyRule)
	}
	if err := bucket.ValidateKey(key); err != nil {
		return false, request.Invalid("key", "key: %w", err)
	}
	if ts := e.topo.Load(); en.Rule.Pinned() && ts.Topo != nil {
		if home := ts.Topo.Home(key, en.Rule.HomeKeys); home != e.region {
			return false, fmt.Errorf("%w: rule %q: reset the key in %s", ErrNotHome, ruleID, home)
		}
	}
	// The store first: when it fails nothing is reset anywhere. A spend
	// recorded between the store's reset and the recorder's is forgiven
	// in the other regions too, like those before it.
	if err := e.store.Reset(ctx, []bucket.Request{{Rule: ruleID, Key: key}}); err != nil {
		return false, err
	}
	// The fallback's share of the key too: it decides while the store is
	// down. It never fails.
	_ = e.fallback.Reset(ctx, []bucket.Request{{Rule: ruleID, Key: key}})
	if e.deny != nil {
		e.deny.Forget(ruleID, key)
	}
	if e.resets != nil && en.Rule.Reconciled() {
		e.resets.Reset(ruleID, key, time.Now().UnixMicro())
		propagated = true
	}
	return propagated, nil
}
