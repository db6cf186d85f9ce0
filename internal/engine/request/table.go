package request

import (
	"math"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/handoff"
	"github.com/limiterd/limiterd/internal/engine/inflight"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// Limits are what a key is decided against under a rule.
type Limits struct {
	// Limit is the key's limit: its override's, or the rule's; Regional a
	// region's share of it for a pinned rule, for when the key's home
	// region cannot answer.
	Limit, Regional bucket.Limit
	// Leases is a concurrency rule's limit of the key, RegionalLeases a
	// region's share of a pinned one (its key's home did not answer).
	Leases, RegionalLeases bucket.LeaseLimit
}

// NewLimits are the limits of l, with the share of each of regions.
func NewLimits(l bucket.Limit, regions int) Limits {
	return Limits{Limit: l, Regional: Share(l, regions, min(1, l.Capacity))}
}

// newLeaseLimits are the limits of a concurrency rule's key: l, its lease
// limit ll, and their shares of each of regions.
func newLeaseLimits(l bucket.Limit, ll bucket.LeaseLimit, regions int) Limits {
	kl := NewLimits(l, regions)
	kl.Leases, kl.RegionalLeases = ll, ll.Share(regions)
	return kl
}

// Entry is a rule in force with what the engine's stages need
// precomputed.
type Entry struct {
	Rule *rules.Rule
	// Limits are the rule's: those of every key without an override.
	Limits
	// Overrides are the limits of the keys the rule overrides; nil for a
	// rule without overrides.
	Overrides  map[string]*Limits
	Reconciled bool
	// SpendBudget is the rule's SpendBudget, for the engine's
	// SpendRecorder.
	SpendBudget float64
	Pinned      bool
	Closed      bool
	// The rule's counters, by result.
	Allowed, Limited, Failed, FallbackAllowed, FallbackLimited, Uncertain prometheus.Counter
	ShadowAllowed, ShadowLimited                                          prometheus.Counter
	// AdmittedCost sums the tokens admitted here, for global dashboards.
	AdmittedCost prometheus.Counter
	// DenyHits count checks refused by the deny cache; Leased those
	// admitted from this instance's lease.
	DenyHits, Leased prometheus.Counter
	// Lease is a concurrency rule's lease counters, by event.
	Lease map[string]prometheus.Counter
	// AdaptiveLimit is an adaptive concurrency rule's limit of the key
	// its latest Acquire here held (nil for another rule).
	AdaptiveLimit prometheus.Gauge
	// Tracked is a concurrency rule's counters for the in-flight gauge.
	Tracked *inflight.Rule
	// Forwarded count checks answered by a key's home region.
	ForwardedAllowed, ForwardedLimited, ForwardedFailed prometheus.Counter
	// Rehome is the last change of a pinned rule's home_keys, whose moved
	// keys take their old homes' buckets (see the handoff package); nil:
	// none.
	Rehome *handoff.Rehoming
	// Keeps are what a check of each priority class (by its index in the
	// table's Classes) keeps of the rule's capacity for the classes above
	// it (rules.Classes.Keeps); nil when the rule keeps no reserve.
	Keeps []float64
}

// Keep is what a check of class (an index of the table's Classes) keeps
// of the rule's capacity: 0 when the rule keeps no reserve.
func (en *Entry) Keep(class int) float64 {
	if class < len(en.Keeps) {
		return en.Keeps[class]
	}
	return 0
}

// For returns the limits of key: its override's, or the rule's. It
// allocates nothing.
func (en *Entry) For(key string) *Limits {
	if en.Overrides != nil {
		if l, ok := en.Overrides[key]; ok {
			return l
		}
	}
	return &en.Limits
}

// Table is an immutable rule set ready for the engine's stages: its rules
// by id, generation Gen, decided with the shares of Regions regions, for
// checks of the priority classes Classes.
type Table struct {
	Set     *rules.Set
	Gen     uint64
	Regions int
	ByID    map[string]*Entry
	Classes *rules.Classes
}

// DefaultClass is the index of the class of a check that names none.
func (t *Table) DefaultClass() int { return t.Classes.Index("") }

// NewTable makes the table of set, for checks of the priority classes
// classes (nil: rules.DefaultClasses). An entry of old whose rule is the
// same (the same *rules.Rule: the rules source keeps the rules that did
// not change) is taken over as it is, so a change of one rule costs one
// entry, not a metric lookup per rule and result.
func NewTable(set *rules.Set, gen uint64, regions int, classes *rules.Classes, m *metrics.Metrics, old *Table) *Table {
	d, f := m.Decisions, m.Forwarded
	if classes == nil {
		classes = rules.DefaultClassList()
	}
	t := &Table{Set: set, Gen: gen, Regions: regions, ByID: make(map[string]*Entry, len(set.Rules())), Classes: classes}
	for _, r := range set.Rules() {
		var rehome *handoff.Rehoming
		if old != nil {
			if en := old.ByID[r.ID]; en != nil {
				if en.Rule == r && old.Regions == regions && old.Classes == classes {
					t.ByID[r.ID] = en
					continue
				}
				rehome = handoff.Rehomed(en.Rule, en.Rehome, r)
			}
		}
		lim := r.Bucket()
		m.RuleLimit.WithLabelValues(r.ID).Set(lim.Capacity)
		if !r.Concurrent() {
			m.RuleRate.WithLabelValues(r.ID).Set(SustainedRate(lim))
		}
		id := r.ID
		var lease map[string]prometheus.Counter
		if r.Concurrent() {
			lease = make(map[string]prometheus.Counter, len(metrics.LeaseEvents))
			for _, ev := range metrics.LeaseEvents {
				lease[ev] = m.Leases.WithLabelValues(id, ev)
			}
			if r.Pinned() {
				for call, results := range metrics.ForwardedLeaseResults {
					for _, res := range results {
						m.ForwardedLeases.WithLabelValues(id, call, res)
					}
				}
			}
		}
		var adaptive prometheus.Gauge
		if a := r.Leases().Adaptive; r.Concurrent() && a.On() {
			adaptive = m.AdaptiveLimit.WithLabelValues(id)
			adaptive.Set(float64(min(a.Max, max(a.Min, r.Leases().Limit))))
		} else {
			m.AdaptiveLimit.DeleteLabelValues(id)
		}
		var tracked *inflight.Rule
		if lease != nil {
			tracked = &inflight.Rule{ID: id, Expired: lease[metrics.EventExpired], Untracked: lease[metrics.EventUntracked]}
		}
		var overrides map[string]*Limits
		if o := r.OverrideLimits(); len(o) > 0 {
			overrides = make(map[string]*Limits, len(o))
			for k, l := range o {
				kl := newLeaseLimits(l, r.LeasesFor(k), regions)
				overrides[k] = &kl
			}
		}
		t.ByID[id] = &Entry{
			Lease: lease, Tracked: tracked, AdaptiveLimit: adaptive,
			Rule: r, Limits: newLeaseLimits(lim, r.Leases(), regions), Overrides: overrides,
			Reconciled: r.Reconciled(), SpendBudget: r.SpendBudget(), Pinned: r.Pinned(), Closed: r.OnFailure == rules.FailClosed,
			Allowed: d.WithLabelValues(id, metrics.ResultAllowed), Limited: d.WithLabelValues(id, metrics.ResultLimited),
			Failed:          d.WithLabelValues(id, metrics.ResultError),
			FallbackAllowed: d.WithLabelValues(id, metrics.ResultFallbackAllowed), FallbackLimited: d.WithLabelValues(id, metrics.ResultFallbackLimited),
			Uncertain:     d.WithLabelValues(id, metrics.ResultUncertainAllowed),
			ShadowAllowed: d.WithLabelValues(id, metrics.ResultShadowAllowed), ShadowLimited: d.WithLabelValues(id, metrics.ResultShadowLimited),
			AdmittedCost: m.AdmittedCost.WithLabelValues(id),
			DenyHits:     m.DenyHits.WithLabelValues(id), Leased: m.Leased.WithLabelValues(id),
			ForwardedAllowed: f.WithLabelValues(id, metrics.ResultAllowed), ForwardedLimited: f.WithLabelValues(id, metrics.ResultLimited),
			ForwardedFailed: f.WithLabelValues(id, metrics.ResultError),
			Rehome:          rehome,
			Keeps:           classes.Keeps(r),
		}

	}
	return t
}

// Share is one of n equal parts of l, for fail-open decisions, for
// requests of cost, at most the rule's capacity (for a share made ahead of
// any request, 1 or the capacity when smaller): 1/n of the
// rate, and of the capacity while that holds at least cost. A smaller part
// is shared by time instead, so that n instances together still admit the
// limit's rate: a window rule holds cost in a window n·cost/capacity times
// as long (a sliding log of 3 a minute over 10 instances: 1 each per 200
// s, not 1 each a minute); a token bucket or GCRA holds a burst of cost,
// refilling at 1/n of the rate.
func Share(l bucket.Limit, n int, cost float64) bucket.Limit {
	if n <= 1 {
		return l
	}
	part := l.Capacity / float64(n)
	if l.Algorithm == bucket.SlidingLog {
		part, cost = math.Floor(part), math.Max(math.Ceil(cost), 1)
	}
	switch l.Algorithm {
	case bucket.TokenBucket, bucket.GCRA:
		l.RefillPerSecond /= float64(n)
		l.Capacity = math.Max(part, cost)
	default:
		if part >= cost {
			l.Capacity = part
			break
		}
		l.Window = time.Duration(math.Ceil(float64(l.Window) * float64(n) * cost / l.Capacity))
		l.Capacity = cost
	}
	return l
}

// SustainedRate is a limit's long-run tokens per second.
func SustainedRate(l bucket.Limit) float64 {
	if l.Algorithm == bucket.TokenBucket || l.Algorithm == bucket.GCRA {
		return l.RefillPerSecond
	}
	return l.Capacity / l.Window.Seconds()
}
