package engine

import (
	"context"
	"fmt"
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
		k := handoff.Key{Rule: it.Rule, Key: it.Key, Limit: it.Entry.Limit, Rehome: it.Entry.Rehome}
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
		if err := e.askHandoff(ctx, ts, g.From, g.Moves); err != nil {
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

// askHandoff asks home, the moves' old home, what their buckets count,
// within the forward timeout (whatever the caller's deadline), and sets
// each move's seed.Used (handoff.SetUsed checks the answer).
func (e *Engine) askHandoff(ctx context.Context, ts *homes.State, home string, moves []handoff.Move) error {
	h := ts.Homes[home]
	if h == nil {
		h = ts.PrevHomes[home] // a region the switch removed
	}
	if h == nil {
		return fmt.Errorf("no client for region %s (not in the topology in force, and this process did not switch from one that had it)", home)
	}
	req := make([]homes.Item, len(moves))
	for i, mv := range moves {
		req[i] = homes.Item{Rule: mv.Seed.Rule, Key: mv.Seed.Key}
	}
	// Not cut short by the caller giving up: a fail-open key would start
	// from a full bucket for the whole fleet.
	hctx, cancel := e.detached(ctx)
	defer cancel()
	used, err := h.Handoff(hctx, req)
	if err != nil {
		return err
	}
	return handoff.SetUsed(moves, used)
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
		reqs[i] = bucket.Request{Rule: it.Rule, Key: it.Key, Limit: en.Limit}
	}
	return e.store.Used(ctx, reqs)
}
