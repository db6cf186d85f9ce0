// Package inflight tracks the leases of concurrency rules one instance
// granted and has not seen released or expire, for the gauge
// limiter_concurrency_leases_in_flight: a per-process count, honest
// without asking the store. The engine adds a lease when an Acquire holds
// it, and removes or renews it as Release and Renew see it.
package inflight

import (
	"container/heap"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Bounds of the leases an instance tracks for
// limiter_concurrency_leases_in_flight. Past either, a lease is still
// granted and held in the store, but left out of the gauge: counted as
// untracked (limiter_concurrency_leases_total{event="untracked"} of its
// rule, and limiter_concurrency_untracked_total) and logged. Refusing it
// instead would let one client's flood of keys lock every other client of
// the rule out. A tracked lease costs about 350 B.
const (
	// MaxTrackedLeasesPerRule bounds the leases of one concurrency rule
	// (about 3.5 MB).
	MaxTrackedLeasesPerRule = 10_000
	// MaxTrackedLeases bounds them over every rule (about 35 MB).
	MaxTrackedLeases = 100_000
)

// SweepBatch bounds the expired leases one Add drops: the sweep is spread
// over the Acquires (and a scrape drops every expired one), so no call
// walks the whole table under the lock.
const SweepBatch = 64

// untrackedWarnEvery spaces the warnings that a rule's leases are past
// the bound.
const untrackedWarnEvery = time.Minute

// Rule is what a Tracker needs of a concurrency rule: its id, and its
// lease counters of the events it counts.
type Rule struct {
	ID string
	// Expired counts a lease tracked here that expired unreleased;
	// Untracked one granted but left out past the bounds.
	Expired, Untracked prometheus.Counter
}

// Tracker tracks the leases this instance granted and has not seen
// released or expire (a lease released through another instance counts
// here until its expiry). Leases are kept in a heap by expiry, so a sweep
// touches only expired ones, soonest first. A Tracker is a
// prometheus.Collector of the gauge. Safe for concurrent use.
type Tracker struct {
	mu       sync.Mutex
	leases   map[string]*tracked
	byExpiry expiryHeap
	// count is the leases tracked by rule id (across the versions of a
	// rule a change makes).
	count     map[string]int
	warned    map[string]time.Time
	untracked prometheus.Counter
	log       *slog.Logger
	desc      *prometheus.Desc
	rules     func() []string
}

type tracked struct {
	member  string
	rules   []*Rule
	expires time.Time
	index   int // in byExpiry
}

// New makes a Tracker. rules returns the ids of the concurrency rules in
// force (each has a gauge, 0 included); untracked counts every lease left
// out past the bounds, which log warns of.
func New(rules func() []string, untracked prometheus.Counter, log *slog.Logger) *Tracker {
	return &Tracker{
		leases: make(map[string]*tracked), count: make(map[string]int), warned: make(map[string]time.Time),
		untracked: untracked, log: log, rules: rules,
		desc: prometheus.NewDesc("limiter_concurrency_leases_in_flight",
			"Leases of a concurrency rule this instance granted and has not seen released or expire, by rule.", []string{"rule"}, nil),
	}
}

// Add tracks the lease of member (a lease id's member), held under rules
// until expires. Past the bounds it is left out, counted as untracked.
// Add keeps rules.
func (f *Tracker) Add(member string, rules []*Rule, expires time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := time.Now()
	f.sweep(now, SweepBatch)
	if len(f.leases) >= MaxTrackedLeases {
		f.refuse(now, rules, "", MaxTrackedLeases)
		return
	}
	for _, r := range rules {
		if f.count[r.ID] >= MaxTrackedLeasesPerRule {
			f.refuse(now, rules, r.ID, MaxTrackedLeasesPerRule)
			return
		}
	}
	t := &tracked{member: member, rules: rules, expires: expires}
	for _, r := range rules {
		f.count[r.ID]++
	}
	f.leases[member] = t
	heap.Push(&f.byExpiry, t)
}

// refuse counts a lease of rules left untracked past bound (of rule; ""
// for every rule's), warning at most once a minute per rule.
func (f *Tracker) refuse(now time.Time, rules []*Rule, rule string, bound int) {
	f.untracked.Inc()
	for _, r := range rules {
		r.Untracked.Inc()
	}
	if now.Sub(f.warned[rule]) < untrackedWarnEvery {
		return
	}
	f.warned[rule] = now
	if rule == "" {
		f.log.Warn("leases past the most this instance tracks: they are held, but left out of limiter_concurrency_leases_in_flight",
			"tracked", len(f.leases), "bound", bound)
		return
	}
	f.log.Warn("leases of a rule past the most this instance tracks of one rule: they are held, but left out of limiter_concurrency_leases_in_flight",
		"rule", rule, "tracked", f.count[rule], "bound", bound)
}

// Remove stops tracking a lease; it reports whether it was tracked.
func (f *Tracker) Remove(member string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	t := f.leases[member]
	if t == nil {
		return false
	}
	heap.Remove(&f.byExpiry, t.index)
	f.drop(t)
	return true
}

// Renew moves a tracked lease's expiry to expires.
func (f *Tracker) Renew(member string, expires time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if t := f.leases[member]; t != nil {
		t.expires = expires
		heap.Fix(&f.byExpiry, t.index)
	}
}

// drop forgets t, already out of the heap.
func (f *Tracker) drop(t *tracked) {
	delete(f.leases, t.member)
	for _, r := range t.rules {
		if f.count[r.ID]--; f.count[r.ID] <= 0 {
			delete(f.count, r.ID)
		}
	}
}

// sweep drops up to n leases past their expiry (n < 0: all), soonest
// first, counting them as expired.
func (f *Tracker) sweep(now time.Time, n int) {
	for ; n != 0 && len(f.byExpiry) > 0 && !f.byExpiry[0].expires.After(now); n-- {
		t := heap.Pop(&f.byExpiry).(*tracked)
		for _, r := range t.rules {
			r.Expired.Inc()
		}
		f.drop(t)
	}
}

// Len is the number of leases tracked, expired ones not yet swept
// included.
func (f *Tracker) Len() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.leases)
}

// Describe and Collect make a Tracker a prometheus.Collector: the gauge of
// every concurrency rule in force, 0 included.
func (f *Tracker) Describe(ch chan<- *prometheus.Desc) { ch <- f.desc }

// Collect sweeps every expired lease and reports the gauges.
func (f *Tracker) Collect(ch chan<- prometheus.Metric) {
	f.mu.Lock()
	f.sweep(time.Now(), -1)
	counts := make(map[string]int, len(f.count))
	for id, n := range f.count {
		counts[id] = n
	}
	f.mu.Unlock()
	for _, id := range f.rules() {
		ch <- prometheus.MustNewConstMetric(f.desc, prometheus.GaugeValue, float64(counts[id]), id)
	}
}

// expiryHeap orders tracked leases by expiry (container/heap).
type expiryHeap []*tracked

func (h expiryHeap) Len() int           { return len(h) }
func (h expiryHeap) Less(i, j int) bool { return h[i].expires.Before(h[j].expires) }
func (h expiryHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *expiryHeap) Push(x any) {
	t := x.(*tracked)
	t.index = len(*h)
	*h = append(*h, t)
}
func (h *expiryHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return t
}
