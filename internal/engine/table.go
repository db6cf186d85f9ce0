package engine

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/handoff"
	"github.com/limiterd/limiterd/internal/engine/inflight"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// entry is a rule with what the pipeline needs precomputed.
type entry struct {
	rule *rules.Rule
	// limit is the rule's limit; regional a region's share of a pinned
	// rule, for when the key's home region cannot answer.
	limit, regional bucket.Limit
	reconciled      bool
	// spendBudget is the rule's SpendBudget, for the SpendRecorder.
	spendBudget float64
	pinned      bool
	closed      bool
	// The rule's counters, by result.
	allowed, limited, failed, fallbackAllowed, fallbackLimited, uncertain prometheus.Counter
	shadowAllowed, shadowLimited                                          prometheus.Counter
	// admittedCost sums the tokens admitted here, for global dashboards.
	admittedCost prometheus.Counter
	// denyHits count checks refused by the deny cache; leased those
	// admitted from this instance's lease.
	denyHits, leased prometheus.Counter
	// leases is a concurrency rule's limit, regionalLeases a region's
	// share of a pinned one (its key's home did not answer); lease its
	// lease counters, by event.
	leases, regionalLeases bucket.LeaseLimit
	lease                  map[string]prometheus.Counter
	// tracked is a concurrency rule's counters for the in-flight gauge.
	tracked *inflight.Rule
	// forwarded count checks answered by a key's home region.
	forwardedAllowed, forwardedLimited, forwardedFailed prometheus.Counter
	// rehome is the last change of a pinned rule's home_keys, whose moved
	// keys take their old homes' buckets (see handoff); nil: none.
	rehome *handoff.Rehoming
}

// Rules is the rule set checks starting now are decided with.
func (e *Engine) Rules() *rules.Set { return e.table.Load().set }

// table is an immutable rule set ready for the pipeline.
type table struct {
	set     *rules.Set
	gen     uint64
	regions int
	byID    map[string]*entry
}

// newTable makes the table of set. An entry of old whose rule is the same
// (the same *rules.Rule: the rules source keeps the rules that did not
// change) is taken over as it is, so a change of one rule costs one entry,
// not a metric lookup per rule and result.
func newTable(set *rules.Set, gen uint64, regions int, m *metrics.Metrics, old *table) *table {
	d, f := m.Decisions, m.Forwarded
	t := &table{set: set, gen: gen, regions: regions, byID: make(map[string]*entry, len(set.Rules()))}
	for _, r := range set.Rules() {
		var rehome *handoff.Rehoming
		if old != nil {
			if en := old.byID[r.ID]; en != nil {
				if en.rule == r && old.regions == regions {
					t.byID[r.ID] = en
					continue
				}
				rehome = handoff.Rehomed(en.rule, en.rehome, r)
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
		var tracked *inflight.Rule
		if lease != nil {
			tracked = &inflight.Rule{ID: id, Expired: lease[metrics.EventExpired], Untracked: lease[metrics.EventUntracked]}
		}
		t.byID[id] = &entry{
			leases: r.Leases(), regionalLeases: r.Leases().Share(regions), lease: lease, tracked: tracked,
			rule: r, limit: lim, regional: share(lim, regions, min(1, lim.Capacity)),
			reconciled: r.Reconciled(), spendBudget: r.SpendBudget(), pinned: r.Pinned(), closed: r.OnFailure == rules.FailClosed,
			allowed: d.WithLabelValues(id, metrics.ResultAllowed), limited: d.WithLabelValues(id, metrics.ResultLimited),
			failed:          d.WithLabelValues(id, metrics.ResultError),
			fallbackAllowed: d.WithLabelValues(id, metrics.ResultFallbackAllowed), fallbackLimited: d.WithLabelValues(id, metrics.ResultFallbackLimited),
			uncertain:     d.WithLabelValues(id, metrics.ResultUncertainAllowed),
			shadowAllowed: d.WithLabelValues(id, metrics.ResultShadowAllowed), shadowLimited: d.WithLabelValues(id, metrics.ResultShadowLimited),
			admittedCost: m.AdmittedCost.WithLabelValues(id),
			denyHits:     m.DenyHits.WithLabelValues(id), leased: m.Leased.WithLabelValues(id),
			forwardedAllowed: f.WithLabelValues(id, metrics.ResultAllowed), forwardedLimited: f.WithLabelValues(id, metrics.ResultLimited),
			forwardedFailed: f.WithLabelValues(id, metrics.ResultError),
			rehome:          rehome,
		}

	}
	return t
}

// Invalid counts a request a front door refused as invalid before its
// check was built, by the field at fault (rule_id, key, cost, attributes).
func (e *Engine) Invalid(field string) { e.m.Invalid.WithLabelValues(field).Inc() }

// Observe records the time a front door took to answer one check.
func (e *Engine) Observe(seconds float64) { e.m.Duration.Observe(seconds) }
