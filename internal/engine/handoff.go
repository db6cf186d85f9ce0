package engine

import (
	"context"
	"time"

	"github.com/limiterd/limiterd/internal/engine/handoff"
	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// The handoff of moved keys (see the handoff package): before the store
// decides a check, the keys a topology switch, or a change of a rule's
// home_keys, moved here take their old homes' buckets.

// storeFailure is this region's store failing to tell or to seed a moved
// key: the check is decided as when the store fails it (storeFailed), and
// the next check of the key tries the handoff again.
type storeFailure struct{ err error }

func (f storeFailure) Error() string { return "handoff: " + f.err.Error() }
func (f storeFailure) Unwrap() error { return f.err }

// handoff seeds the buckets of the items that c's topology moved here and
// that are not yet seeded, from their old homes, before the store decides
// them. An old home that does not answer goes to the failure policy: it
// fails for a fail-closed rule (ErrUnavailable), and a fail-open rule's key
// starts from a full bucket. It fails with a storeFailure when this
// region's store did not answer.
func (e *Engine) handoff(ctx context.Context, p *plan, items []*request.Item) error {
	ts := p.ts
	var moves []handoff.Move
	now := time.Now()
	for i, it := range items {
		if !it.Entry.Pinned || ts.Topo == nil {
			continue
		}
		k := handoff.Key{Rule: it.Rule, Key: it.Key, Limit: it.Limits.Limit, Rehome: it.Entry.Rehome}
		if mv, ok := e.handoffs.MovedIn(ts.Topo, ts.Gen, &ts.Switch, k, now); ok {
			mv.Item = i
			moves = append(moves, mv)
		}
	}
	if len(moves) == 0 {
		return nil
	}
	// The old homes' counts of the buckets not seeded yet, one call per home.
	groups, err := e.handoffs.Pending(ctx, moves)
	if err != nil {
		return storeFailure{err}
	}
	var todo []handoff.Move
	for _, g := range groups {
		if err := e.fwd.Used(ctx, ts, g.From, g.Moves); err != nil {
			e.handoffs.Unreachable(g.Moves)
			its := make([]*request.Item, len(g.Moves))
			for i, mv := range g.Moves {
				its[i] = items[mv.Item]
			}
			if v, err := e.onFailure(ctx, failure{items: its, where: "old home region " + g.From + " (handoff)"}, err); v == refused {
				return err
			}
			e.log.Warn("old home region did not hand off moved keys: they start from a full bucket",
				"home", g.From, "keys", len(g.Moves), "generation", ts.Gen, "err", err)
			for i := range g.Moves {
				g.Moves[i].Seed.Used = 0
			}
		}
		todo = append(todo, g.Moves...)
	}
	if len(todo) == 0 {
		return nil
	}
	if err := e.handoffs.Seed(ctx, todo); err != nil {
		return storeFailure{err}
	}
	return nil
}

// Used answers a key's new home region (Home.Handoff): what the buckets of
// items, pinned rules' keys that were homed here, count now. Items name a
// rule and a key; their costs are ignored.
func (e *Engine) Used(ctx context.Context, items []homes.Item) ([]float64, error) {
	t := e.table.Load()
	reqs := make([]bucket.Request, len(items))
	for i, it := range items {
		en := t.ByID[it.Rule]
		if en == nil {
			return nil, request.UnknownRule(it.Rule)
		}
		if !en.Pinned || en.Rule.Concurrent() {
			return nil, request.Invalid("rule_id", "rule_id: rule %s is not a pinned rate rule: it has no bucket to hand off", request.Quote(it.Rule))
		}
		if err := bucket.ValidateKey(it.Key); err != nil {
			return nil, request.Invalid("key", "key: %w", err)
		}
		reqs[i] = bucket.Request{Rule: it.Rule, Key: it.Key, Limit: en.For(it.Key).Limit}
	}
	return e.store.Used(ctx, reqs)
}
