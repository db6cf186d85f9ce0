package engine

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/inflight"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// Decision results, the values of the result label.
const (
	resultAllowed          = "allowed"
	resultLimited          = "limited"
	resultError            = "error"
	resultFallbackAllowed  = "fallback_allowed"
	resultFallbackLimited  = "fallback_limited"
	resultUncertainAllowed = "uncertain_allowed"
	resultShadowAllowed    = "shadow_allowed"
	resultShadowLimited    = "shadow_limited"
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
	rehome *rehoming
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
func newTable(set *rules.Set, gen uint64, regions int, m *metrics, old *table) *table {
	d, f := m.decisions, m.forwarded
	t := &table{set: set, gen: gen, regions: regions, byID: make(map[string]*entry, len(set.Rules()))}
	for _, r := range set.Rules() {
		var rehome *rehoming
		if old != nil {
			if en := old.byID[r.ID]; en != nil {
				if en.rule == r && old.regions == regions {
					t.byID[r.ID] = en
					continue
				}
				rehome = rehomed(en, r)
			}
		}
		lim := r.Bucket()
		m.ruleLimit.WithLabelValues(r.ID).Set(lim.Capacity)
		if !r.Concurrent() {
			m.ruleRate.WithLabelValues(r.ID).Set(SustainedRate(lim))
		}
		id := r.ID
		var lease map[string]prometheus.Counter
		if r.Concurrent() {
			lease = make(map[string]prometheus.Counter, len(leaseEvents))
			for _, ev := range leaseEvents {
				lease[ev] = m.leases.WithLabelValues(id, ev)
			}
			if r.Pinned() {
				for call, results := range forwardedLeaseResults {
					for _, res := range results {
						m.forwardedLeases.WithLabelValues(id, call, res)
					}
				}
			}
		}
		var tracked *inflight.Rule
		if lease != nil {
			tracked = &inflight.Rule{ID: id, Expired: lease[eventExpired], Untracked: lease[eventUntracked]}
		}
		t.byID[id] = &entry{
			leases: r.Leases(), regionalLeases: r.Leases().Share(regions), lease: lease, tracked: tracked,
			rule: r, limit: lim, regional: share(lim, regions, min(1, lim.Capacity)),
			reconciled: r.Reconciled(), spendBudget: r.SpendBudget(), pinned: r.Pinned(), closed: r.OnFailure == rules.FailClosed,
			allowed: d.WithLabelValues(id, resultAllowed), limited: d.WithLabelValues(id, resultLimited),
			failed:          d.WithLabelValues(id, resultError),
			fallbackAllowed: d.WithLabelValues(id, resultFallbackAllowed), fallbackLimited: d.WithLabelValues(id, resultFallbackLimited),
			uncertain:     d.WithLabelValues(id, resultUncertainAllowed),
			shadowAllowed: d.WithLabelValues(id, resultShadowAllowed), shadowLimited: d.WithLabelValues(id, resultShadowLimited),
			admittedCost: m.admittedCost.WithLabelValues(id),
			denyHits:     m.denyHits.WithLabelValues(id), leased: m.leased.WithLabelValues(id),
			forwardedAllowed: f.WithLabelValues(id, resultAllowed), forwardedLimited: f.WithLabelValues(id, resultLimited),
			forwardedFailed: f.WithLabelValues(id, resultError),
			rehome:          rehome,
		}

	}
	return t
}

type metrics struct {
	decisions *prometheus.CounterVec
	forwarded *prometheus.CounterVec
	// forwardedLeases count the lease calls forwarded to the region
	// holding the lease, by rule, call and result.
	forwardedLeases *prometheus.CounterVec
	admittedCost    *prometheus.CounterVec
	denyHits        *prometheus.CounterVec
	leased          *prometheus.CounterVec
	ruleLimit       *prometheus.GaugeVec
	ruleRate        *prometheus.GaugeVec
	invalid         *prometheus.CounterVec
	overloaded      prometheus.Counter
	refunds         *prometheus.CounterVec
	stale           *prometheus.CounterVec
	handoffs        *prometheus.CounterVec
	duration        prometheus.Histogram
	leases          *prometheus.CounterVec
	untracked       prometheus.Counter
	paced           *prometheus.CounterVec
	pacedWait       *prometheus.HistogramVec
}

// Invalid counts a request a front door refused as invalid before its
// check was built, by the field at fault (rule_id, key, cost, attributes).
func (e *Engine) Invalid(field string) { e.m.invalid.WithLabelValues(field).Inc() }

// Observe records the time a front door took to answer one check.
func (e *Engine) Observe(seconds float64) { e.m.duration.Observe(seconds) }

// forget removes the series of a rule no longer in force.
func (m *metrics) forget(rule string) {
	m.pacedWait.DeleteLabelValues(rule)
	for _, v := range []*prometheus.CounterVec{m.decisions, m.forwarded, m.forwardedLeases, m.leases, m.paced} {
		v.DeletePartialMatch(prometheus.Labels{"rule": rule})
	}
	for _, v := range []*prometheus.CounterVec{m.admittedCost, m.denyHits, m.leased} {
		v.DeleteLabelValues(rule)
	}
	m.ruleLimit.DeleteLabelValues(rule)
	m.ruleRate.DeleteLabelValues(rule)
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_decisions_total",
			Help: "Checks decided, by rule and result (uncertain_allowed: the store may have counted it, its reply did not come in time).",
		}, []string{"rule", "result"}),
		forwarded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_forwarded_checks_total",
			Help: "Checks of pinned rules forwarded to the key's home region, by rule and result (error: no answer).",
		}, []string{"rule", "result"}),
		forwardedLeases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_forwarded_lease_calls_total",
			Help: "Lease calls of concurrency rules forwarded to the region holding the lease (a pinned rule's key's home), by rule, call (acquire, release, renew) and result (acquire: allowed, limited; release: released, gone; renew: renewed, gone; error: no answer).",
		}, []string{"rule", "call", "result"}),
		admittedCost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_admitted_cost_total",
			Help: "Tokens admitted by this instance, by rule; summed over every instance of every region it is the global admission.",
		}, []string{"rule"}),
		denyHits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_deny_cache_hits_total",
			Help: "Checks rejected from the deny cache, without a store call, by rule.",
		}, []string{"rule"}),
		leased: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_leased_checks_total",
			Help: "Checks admitted from this instance's leased tokens, without a store call, by rule.",
		}, []string{"rule"}),
		ruleLimit: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_rule_capacity",
			Help: "A rule's capacity: the burst of a bucket, the limit of a window.",
		}, []string{"rule"}),
		ruleRate: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_rule_sustained_rate",
			Help: "A rule's long-run tokens per second: its refill rate, or its limit over its window.",
		}, []string{"rule"}),
		invalid: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_invalid_requests_total",
			Help: "Checks refused as invalid, by the field at fault.",
		}, []string{"field"}),
		overloaded: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_overloaded_checks_total",
			Help: "Checks answered RESOURCE_EXHAUSTED: they waited in this process too long to reach the store (nothing spent).",
		}),
		refunds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_home_refunds_total",
			Help: "Refunds to a key's home region of a pinned rule's spend, when another rule of the check refused, by result.",
		}, []string{"result"}),
		stale: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_topology_stale_total",
			Help: "Forwards a key's home region refused because its topology is newer and homes the key elsewhere, by the region that refused (the check is routed again once when the topology file read again is newer too, else its rule's on_failure decides).",
		}, []string{"peer"}),
		leases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_concurrency_leases_total",
			Help: "Leases of concurrency rules, by rule and event: acquired (fallback_acquired: of them, held in this instance's fallback while the store failed), refused (the limit was reached), released, expired (granted here and neither released nor renewed through this instance in time), renewed, renew_gone (a renewal of a lease already gone), error (a fail-closed refusal or a store failure), untracked (granted, but past the leases this instance tracks for limiter_concurrency_leases_in_flight: inflight.MaxTrackedLeasesPerRule, MaxTrackedLeases).",
		}, []string{"rule", "event"}),
		untracked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_concurrency_untracked_total",
			Help: "Leases granted but left out of limiter_concurrency_leases_in_flight: this instance already tracked the most it tracks, of the rule (10,000) or of all (100,000).",
		}),
		paced: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_paced_checks_total",
			Help: "Paced checks (max_wait_ms > 0) of token bucket and GCRA rules, by rule and result: allowed (a slot reserved within the wait, limiter_paced_wait_seconds has its wait), limited (the next slot is beyond the wait: nothing spent).",
		}, []string{"rule", "result"}),
		pacedWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "limiter_paced_wait_seconds",
			Help:    "The wait answered to allowed paced checks (the caller sends after it), by rule.",
			Buckets: []float64{0, .001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}, []string{"rule"}),
		handoffs: newHandoffMetric(),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "limiter_check_duration_seconds",
			Help:    "Time to decide one check inside limiterd.",
			Buckets: []float64{.00005, .0001, .00025, .0005, .001, .002, .005, .01, .025, .1},
		}),
	}
	for _, c := range []prometheus.Collector{m.decisions, m.forwarded, m.forwardedLeases, m.admittedCost, m.denyHits, m.leased,
		m.ruleLimit, m.ruleRate, m.invalid, m.overloaded, m.refunds, m.stale, m.handoffs, m.duration, m.leases, m.untracked,
		m.paced, m.pacedWait} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, f := range []string{"rule_id", "key", "cost", "attributes", "lease_id", "max_wait_ms", "reservation"} {
		m.invalid.WithLabelValues(f)
	}
	for _, r := range []string{"ok", "error"} {
		m.refunds.WithLabelValues(r)
	}
	for _, r := range handoffResults {
		m.handoffs.WithLabelValues(r)
	}
	return m, nil
}
