package engine

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
)

// A pinned rule's key whose home region moves at a topology switch takes
// its bucket with it: the first check of the key at its new home, within
// the rule's handoff window after the switch (bucket.Limit.HandoffWindow:
// past it the old bucket is full again), asks the old home what the bucket
// counts (Home.Handoff) and seeds this region's bucket with that
// (bucket.HandoffStore.Seed), once per generation for the region's whole
// fleet, before it decides. Without it a moved key would start from a full
// bucket: a switch could admit one more capacity per moved key.
//
// When the old home cannot answer, the rule's on_failure decides: a
// fail-closed rule refuses the check (the next one asks again), a
// fail-open one starts the key from a full bucket. Only the topology in
// force before this process's last switch (or the file's
// previous_regions) is looked at, and only the last change of a rule's
// home_keys (see rehoming): a key moved twice within its window does not
// hand its first home's bucket off.

// MaxHandoffKeys bounds the moved keys each process remembers as seeded
// after a switch, so that their checks skip the store's Seeded; beyond it a
// moved key's checks ask the store each time, within its window.
const MaxHandoffKeys = 100_000

// seededKeys are the moved keys this process knows are seeded, at most
// MaxHandoffKeys.
type seededKeys struct {
	mu   sync.Mutex
	keys map[bucketKey]struct{}
}

type bucketKey struct{ rule, key string }

func (s *seededKeys) has(rule, key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.keys[bucketKey{rule, key}]
	return ok
}

func (s *seededKeys) add(rule, key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.keys == nil {
		s.keys = make(map[bucketKey]struct{})
	}
	if len(s.keys) < MaxHandoffKeys {
		s.keys[bucketKey{rule, key}] = struct{}{}
	}
}

// rehoming is a change of a pinned rate rule's home_keys: a key it gives
// this region as its home takes its old home's bucket, as at a topology
// switch, within the rule's handoff window from when this process put the
// change in force.
type rehoming struct {
	prev  map[string]string // home_keys before the change
	since time.Time
	// origin names the change for every process of the fleet (the seed
	// record of each change is its own): a digest of the new home_keys.
	origin string
	seeded seededKeys
}

// rehomed is the rehoming of r, replacing the rule of en: a new one when
// r changes a pinned rate rule's home_keys, else en's (still running its
// window).
func rehomed(en *entry, r *rules.Rule) *rehoming {
	if !en.pinned || !r.Pinned() || r.Concurrent() || en.rule.Concurrent() {
		return nil
	}
	if maps.Equal(en.rule.HomeKeys, r.HomeKeys) {
		return en.rehome
	}
	return &rehoming{prev: en.rule.HomeKeys, since: time.Now(), origin: homesDigest(r.HomeKeys)}
}

// homesDigest names a home_keys map by its content: 16 hex digits of a
// SHA-256 of its sorted key=region lines.
func homesDigest(homes map[string]string) string {
	h := sha256.New()
	for _, k := range slices.Sorted(maps.Keys(homes)) {
		fmt.Fprintf(h, "%q=%q\n", k, homes[k])
	}
	return "homes-" + hex.EncodeToString(h.Sum(nil)[:8])
}

// move is a key moved here, within its window: its item, its old home, the
// seed its bucket takes, and the memory of the keys its move seeded.
type move struct {
	it   *Item
	from string
	seed bucket.Seed
	seen *seededKeys
}

// movedIn reports whether it, decided here, is a key moved here from
// another home within its rule's handoff window, and not yet known to be
// seeded: by ts's topology switch, or by a change of its rule's home_keys.
func (e *Engine) movedIn(ts *topoState, it *Item, now time.Time) (move, bool) {
	if !it.e.pinned || ts.topo == nil {
		return move{}, false
	}
	hk := it.Rule.HomeKeys
	rh := it.e.rehome
	if ts.prev == nil && rh == nil {
		return move{}, false
	}
	if ts.topo.Home(it.Key, hk) != e.region {
		return move{}, false
	}
	full := e.handoffWindow(it.e.limit)
	seed := bucket.Seed{Rule: it.Rule.ID, Key: it.Key, Limit: it.e.limit}
	if ts.prev != nil && !now.Before(ts.since) {
		if w := full - now.Sub(ts.since); w > 0 {
			if from := ts.prev.Home(it.Key, hk); from != e.region {
				seed.Generation, seed.TTL = ts.gen, w
				return move{it, from, seed, &ts.seeded}, !ts.seeded.has(it.Rule.ID, it.Key)
			}
		}
	}
	if rh != nil {
		_, before := rh.prev[it.Key]
		_, after := hk[it.Key]
		if w := full - now.Sub(rh.since); w > 0 && (before || after) {
			if from := ts.topo.Home(it.Key, rh.prev); from != e.region {
				seed.Generation, seed.Origin, seed.TTL = 1, rh.origin, w
				return move{it, from, seed, &rh.seeded}, !rh.seeded.has(it.Rule.ID, it.Key)
			}
		}
	}
	return move{}, false
}

// storeFailure is this region's store failing to tell or to seed a moved
// key: the check is decided as when the store fails it (storeFailed), and
// the next check of the key tries the handoff again.
type storeFailure struct{ err error }

func (f storeFailure) Error() string { return "handoff: " + f.err.Error() }
func (f storeFailure) Unwrap() error { return f.err }

// handoff seeds the buckets of the items that c's topology moved here and
// that are not yet seeded, from their old homes, before the store decides
// them. It fails for a fail-closed rule whose old home did not answer
// (ErrUnavailable), and with a storeFailure when this region's store did
// not answer.
func (e *Engine) handoff(ctx context.Context, p *plan, items []*Item) error {
	ts := p.ts
	var moves []move
	now := time.Now()
	for _, it := range items {
		if mv, ok := e.movedIn(ts, it, now); ok {
			moves = append(moves, mv)
		}
	}
	if len(moves) == 0 {
		return nil
	}
	done, err := e.store.Seeded(ctx, seedsOf(moves))
	if err != nil {
		e.m.Handoffs.WithLabelValues(metrics.HandoffStoreError).Add(float64(len(moves)))
		return storeFailure{err}
	}
	// The old homes' counts of the buckets not seeded yet, one call per home.
	byHome := map[string][]move{}
	var homes []string
	for i, mv := range moves {
		if done[i] {
			mv.seen.add(mv.seed.Rule, mv.seed.Key)
			e.m.Handoffs.WithLabelValues(metrics.HandoffAlready).Inc()
			continue
		}
		if byHome[mv.from] == nil {
			homes = append(homes, mv.from)
		}
		byHome[mv.from] = append(byHome[mv.from], mv)
	}
	var todo []move
	for _, home := range homes {
		mvs := byHome[home]
		if err := e.askHandoff(ctx, ts, home, mvs); err != nil {
			e.m.Handoffs.WithLabelValues(metrics.HandoffUnreachable).Add(float64(len(mvs)))
			its := make([]*Item, len(mvs))
			for i, mv := range mvs {
				its[i] = mv.it
			}
			if v, err := e.onFailure(ctx, failure{items: its, where: "old home region " + home + " (handoff)"}, err); v == refused {
				return err
			}
			e.log.Warn("old home region did not hand off moved keys: they start from a full bucket",
				"home", home, "keys", len(mvs), "generation", ts.gen, "err", err)
			for i := range mvs {
				mvs[i].seed.Used = 0
			}
		}
		todo = append(todo, mvs...)
	}
	if len(todo) == 0 {
		return nil
	}
	ok, err := e.store.Seed(ctx, seedsOf(todo))
	if err != nil {
		e.m.Handoffs.WithLabelValues(metrics.HandoffStoreError).Add(float64(len(todo)))
		return storeFailure{err}
	}
	for i, mv := range todo {
		mv.seen.add(mv.seed.Rule, mv.seed.Key)
		if ok[i] {
			e.m.Handoffs.WithLabelValues(metrics.HandoffSeeded).Inc()
		} else {
			e.m.Handoffs.WithLabelValues(metrics.HandoffAlready).Inc()
		}
	}
	return nil
}

func seedsOf(moves []move) []bucket.Seed {
	out := make([]bucket.Seed, len(moves))
	for i, mv := range moves {
		out[i] = mv.seed
	}
	return out
}

// askHandoff asks home, the moves' old home, what their buckets count,
// within the forward timeout (whatever the caller's deadline), and sets
// each move's seed.Used. Its answers are checked: one per move, each
// finite, not below 0 and not above what a bucket can hold.
func (e *Engine) askHandoff(ctx context.Context, ts *topoState, home string, moves []move) error {
	h := ts.homes[home]
	if h == nil {
		h = ts.prevHomes[home] // a region the switch removed
	}
	if h == nil {
		return fmt.Errorf("no client for region %s (not in the topology in force, and this process did not switch from one that had it)", home)
	}
	req := make([]HomeItem, len(moves))
	for i, mv := range moves {
		req[i] = HomeItem{Rule: mv.seed.Rule, Key: mv.seed.Key}
	}
	// Not cut short by the caller giving up: a fail-open key would start
	// from a full bucket for the whole fleet.
	hctx, cancel := e.detached(ctx)
	defer cancel()
	used, err := h.Handoff(hctx, req)
	if err != nil {
		return err
	}
	if len(used) != len(req) {
		return fmt.Errorf("old home answered %d counts for %d keys", len(used), len(req))
	}
	for i, u := range used {
		// A little above the bound: the old home's own float rounding.
		if !(u >= 0) || u > moves[i].seed.Limit.MostUsed()*(1+1e-9)+1e-6 {
			return fmt.Errorf("old home answered %v for rule %s, out of range", u, quote(req[i].Rule))
		}
	}
	for i := range moves {
		moves[i].seed.Used = used[i]
	}
	return nil
}

// longestHandoff is the longest handoff window of set's pinned rate rules,
// and the rule that has it.
func (e *Engine) longestHandoff(set *rules.Set) (time.Duration, string) {
	var w time.Duration
	var rule string
	for _, r := range set.Rules() {
		if r.Pinned() && !r.Concurrent() {
			if hw := e.handoffWindow(r.Bucket()); hw > w {
				w, rule = hw, r.ID
			}
		}
	}
	return w, rule
}

// handoffWindow is l's handoff window, within the cap of
// Options.HandoffMaxWindow.
func (e *Engine) handoffWindow(l bucket.Limit) time.Duration {
	w := l.HandoffWindow()
	if e.handoffMax > 0 {
		w = min(w, e.handoffMax)
	}
	return w
}

// removesRegion reports whether next lacks a region of cur.
func removesRegion(cur, next *region.Topology) bool {
	for _, n := range cur.Names() {
		if !next.Has(n) {
			return true
		}
	}
	return false
}

// Used answers a key's new home region (Home.Handoff): what the buckets of
// items, pinned rules' keys that were homed here, count now. Items name a
// rule and a key; their costs are ignored.
func (e *Engine) Used(ctx context.Context, items []HomeItem) ([]float64, error) {
	t := e.table.Load()
	reqs := make([]bucket.Request, len(items))
	for i, it := range items {
		en := t.byID[it.Rule]
		if en == nil {
			return nil, errUnknownRule(it.Rule)
		}
		if !en.pinned || en.rule.Concurrent() {
			return nil, invalid("rule_id", "rule_id: rule %s is not a pinned rate rule: it has no bucket to hand off", quote(it.Rule))
		}
		if err := bucket.ValidateKey(it.Key); err != nil {
			return nil, invalid("key", "key: %w", err)
		}
		reqs[i] = bucket.Request{Rule: it.Rule, Key: it.Key, Limit: en.limit}
	}
	return e.store.Used(ctx, reqs)
}
