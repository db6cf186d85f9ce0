// Package handoff hands a pinned rule's bucket to its key's new home
// region. A key whose home moves at a topology switch (Switch) or at a
// change of its rule's home_keys (Rehoming) takes its bucket with it: the
// first check of the key at its new home, within the rule's handoff window
// after the move (bucket.Limit.HandoffWindow: past it the old bucket is
// full again), asks the old home what the bucket counts (homes.Home's
// Handoff) and seeds this region's bucket with that
// (bucket.HandoffStore.Seed), once per generation for the region's whole
// fleet, before it decides. Without it a moved key would start from a full
// bucket: a switch could admit one more capacity per moved key.
//
// This package owns which keys moved here (Handoff.MovedIn), the keys each
// process remembers as seeded (Seeded), the store's side of a handoff
// (Handoff.Pending and Handoff.Seed) and what an old home's answer may be
// (SetUsed). The engine asks the old homes, through its clients of the
// regions, and decides what an old home that cannot answer means (its
// failure policy): a fail-closed rule refuses the check (the next one asks
// again), a fail-open one starts the key from a full bucket. Only the
// topology in force before the process's last switch (or the file's
// previous_regions) is looked at, and only the last change of a rule's
// home_keys: a key moved twice within its window does not hand its first
// home's bucket off.
package handoff

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
)

// MaxKeys bounds the moved keys each process remembers as seeded after a
// switch, so that their checks skip the store's Seeded; beyond it a moved
// key's checks ask the store each time, within its window.
const MaxKeys = 100_000

// Seeded are the moved keys this process knows are seeded, at most
// MaxKeys. The zero value is empty.
type Seeded struct {
	mu   sync.Mutex
	keys map[bucketKey]struct{}
}

type bucketKey struct{ rule, key string }

// Has reports whether the key of rule is known seeded.
func (s *Seeded) Has(rule, key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.keys[bucketKey{rule, key}]
	return ok
}

// Add remembers the key of rule as seeded, unless MaxKeys are.
func (s *Seeded) Add(rule, key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.keys == nil {
		s.keys = make(map[bucketKey]struct{})
	}
	if len(s.keys) < MaxKeys {
		s.keys[bucketKey{rule, key}] = struct{}{}
	}
}

// Len is the number of keys remembered.
func (s *Seeded) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.keys)
}

// Switch is the topology switch that put a topology in force, for the
// keys it moved here: they take their buckets from their homes under Prev,
// within their windows from Since.
type Switch struct {
	// Prev is the topology in force before (nil: none, the first of this
	// process), Since when the new one is.
	Prev  *region.Topology
	Since time.Time
	// Seeded are the keys it moved here whose buckets are seeded.
	Seeded Seeded
}

// Rehoming is a change of a pinned rate rule's home_keys: a key it gives
// this region as its home takes its old home's bucket, as at a topology
// switch, within the rule's handoff window from when this process put the
// change in force.
type Rehoming struct {
	// Prev is home_keys before the change; Since when the change is in
	// force here.
	Prev  map[string]string
	Since time.Time
	// Origin names the change for every process of the fleet (the seed
	// record of each change is its own): see Origin.
	Origin string
	seeded Seeded
}

// Rehomed is the rehoming of r, replacing the rule old whose rehoming was
// oldRehome: a new one when r changes a pinned rate rule's home_keys, else
// oldRehome (still running its window).
func Rehomed(old *rules.Rule, oldRehome *Rehoming, r *rules.Rule) *Rehoming {
	if !old.Pinned() || !r.Pinned() || r.Concurrent() || old.Concurrent() {
		return nil
	}
	if maps.Equal(old.HomeKeys, r.HomeKeys) {
		return oldRehome
	}
	return &Rehoming{Prev: old.HomeKeys, Since: time.Now(), Origin: Origin(r.HomeKeys)}
}

// Origin names a home_keys map by its content: "homes-" and 16 hex digits
// of a SHA-256 of its sorted key=region lines.
func Origin(homes map[string]string) string {
	h := sha256.New()
	for _, k := range slices.Sorted(maps.Keys(homes)) {
		fmt.Fprintf(h, "%q=%q\n", k, homes[k])
	}
	return "homes-" + hex.EncodeToString(h.Sum(nil)[:8])
}

// Key is a pinned rate rule's key a check decides in this region's store.
type Key struct {
	Rule  *rules.Rule
	Key   string
	Limit bucket.Limit
	// Rehome is the rule's last change of home_keys (nil: none).
	Rehome *Rehoming
}

// Move is a key moved here, within its window: the index of its check's
// item (the caller's), its old home, the seed its bucket takes, and the
// memory of the keys its move seeded.
type Move struct {
	Item int
	From string
	Seed bucket.Seed
	seen *Seeded
}

// Handoff is the store's side of the handoffs of one process.
type Handoff struct {
	// Region is this region.
	Region string
	// MaxWindow, when above 0, caps every rule's handoff window.
	MaxWindow time.Duration
	// Store is this region's shared store.
	Store bucket.HandoffStore
	// Results counts the handoffs by result (metrics.Handoff...).
	Results *prometheus.CounterVec
}

// Window is l's handoff window, within MaxWindow.
func (h *Handoff) Window(l bucket.Limit) time.Duration {
	w := l.HandoffWindow()
	if h.MaxWindow > 0 {
		w = min(w, h.MaxWindow)
	}
	return w
}

// Longest is the longest handoff window of set's pinned rate rules (and
// their overrides), and the rule that has it.
func (h *Handoff) Longest(set *rules.Set) (time.Duration, string) {
	var w time.Duration
	var rule string
	for _, r := range set.Rules() {
		if r.Pinned() && !r.Concurrent() {
			if hw := h.Window(r.Bucket()); hw > w {
				w, rule = hw, r.ID
			}
			for _, l := range r.OverrideLimits() {
				if hw := h.Window(l); hw > w {
					w, rule = hw, r.ID
				}
			}
		}
	}
	return w, rule
}

// MovedIn reports whether k, decided here under topo (generation gen, put
// in force by sw), is a key moved here from another home within its rule's
// handoff window, and not yet known to be seeded: by sw, or by a change of
// its rule's home_keys. The move's Item is left to the caller.
func (h *Handoff) MovedIn(topo *region.Topology, gen uint64, sw *Switch, k Key, now time.Time) (Move, bool) {
	hk := k.Rule.HomeKeys
	rh := k.Rehome
	if sw.Prev == nil && rh == nil {
		return Move{}, false
	}
	if topo.Home(k.Key, hk) != h.Region {
		return Move{}, false
	}
	full := h.Window(k.Limit)
	seed := bucket.Seed{Rule: k.Rule.ID, Key: k.Key, Limit: k.Limit}
	if sw.Prev != nil && !now.Before(sw.Since) {
		if w := full - now.Sub(sw.Since); w > 0 {
			if from := sw.Prev.Home(k.Key, hk); from != h.Region {
				seed.Generation, seed.TTL = gen, w
				return Move{From: from, Seed: seed, seen: &sw.Seeded}, !sw.Seeded.Has(k.Rule.ID, k.Key)
			}
		}
	}
	if rh != nil {
		_, before := rh.Prev[k.Key]
		_, after := hk[k.Key]
		if w := full - now.Sub(rh.Since); w > 0 && (before || after) {
			if from := topo.Home(k.Key, rh.Prev); from != h.Region {
				seed.Generation, seed.Origin, seed.TTL = 1, rh.Origin, w
				return Move{From: from, Seed: seed, seen: &rh.seeded}, !rh.seeded.Has(k.Rule.ID, k.Key)
			}
		}
	}
	return Move{}, false
}

// Group is the moves of one old home.
type Group struct {
	From  string
	Moves []Move
}

// Pending asks the store which moves' buckets are seeded (by another
// process of the fleet), remembers those, and returns the others by old
// home, in the order of their first move. Its error is the store's.
func (h *Handoff) Pending(ctx context.Context, moves []Move) ([]Group, error) {
	done, err := h.Store.Seeded(ctx, seedsOf(moves))
	if err != nil {
		h.Results.WithLabelValues(metrics.HandoffStoreError).Add(float64(len(moves)))
		return nil, err
	}
	var groups []Group
	for i, mv := range moves {
		if done[i] {
			mv.seen.Add(mv.Seed.Rule, mv.Seed.Key)
			h.Results.WithLabelValues(metrics.HandoffAlready).Inc()
			continue
		}
		j := slices.IndexFunc(groups, func(g Group) bool { return g.From == mv.From })
		if j < 0 {
			j = len(groups)
			groups = append(groups, Group{From: mv.From})
		}
		groups[j].Moves = append(groups[j].Moves, mv)
	}
	return groups, nil
}

// Unreachable counts moves whose old home did not answer.
func (h *Handoff) Unreachable(moves []Move) {
	h.Results.WithLabelValues(metrics.HandoffUnreachable).Add(float64(len(moves)))
}

// Seed seeds the moves' buckets with their seeds' Used and remembers them
// seeded. Its error is the store's.
func (h *Handoff) Seed(ctx context.Context, moves []Move) error {
	ok, err := h.Store.Seed(ctx, seedsOf(moves))
	if err != nil {
		h.Results.WithLabelValues(metrics.HandoffStoreError).Add(float64(len(moves)))
		return err
	}
	for i, mv := range moves {
		mv.seen.Add(mv.Seed.Rule, mv.Seed.Key)
		if ok[i] {
			h.Results.WithLabelValues(metrics.HandoffSeeded).Inc()
		} else {
			h.Results.WithLabelValues(metrics.HandoffAlready).Inc()
		}
	}
	return nil
}

func seedsOf(moves []Move) []bucket.Seed {
	out := make([]bucket.Seed, len(moves))
	for i, mv := range moves {
		out[i] = mv.Seed
	}
	return out
}

// SetUsed sets each move's Seed.Used to its old home's answer, one count
// per move, once the answer is checked: each finite,
// not below 0 and not above what a bucket can hold.
func SetUsed(moves []Move, used []float64) error {
	if len(used) != len(moves) {
		return fmt.Errorf("old home answered %d counts for %d keys", len(used), len(moves))
	}
	for i, u := range used {
		// A little above the bound: the old home's own float rounding.
		if !(u >= 0) || u > moves[i].Seed.Limit.MostUsed()*(1+1e-9)+1e-6 {
			// (A rule id needs no escaping: %q quotes it.)
			return fmt.Errorf("old home answered %v for rule %q, out of range", u, moves[i].Seed.Rule)
		}
	}
	for i := range moves {
		moves[i].Seed.Used = used[i]
	}
	return nil
}
