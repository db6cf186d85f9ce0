// Package metrics holds the engine's Prometheus series (the decisions,
// forwards, leases, handoffs, refunds, paced checks and settlements of
// every rule) and the values of their labels. The engine makes them once (New) and counts
// into them; a rule's series go when it leaves the rules in force (Forget).
package metrics

import "github.com/prometheus/client_golang/prometheus"

// Decision results, the values of the result label.
const (
	ResultAllowed          = "allowed"
	ResultLimited          = "limited"
	ResultError            = "error"
	ResultFallbackAllowed  = "fallback_allowed"
	ResultFallbackLimited  = "fallback_limited"
	ResultUncertainAllowed = "uncertain_allowed"
	ResultShadowAllowed    = "shadow_allowed"
	ResultShadowLimited    = "shadow_limited"
)

// Lease events, the values of the event label.
const (
	EventAcquired = "acquired"
	EventRefused  = "refused"
	EventReleased = "released"
	EventExpired  = "expired"
	EventRenewed  = "renewed"
	EventGone     = "renew_gone"
	EventFallback = "fallback_acquired"
	EventError    = "error"
	// EventUntracked: granted, but past the leases this instance tracks
	// (inflight.MaxTrackedLeasesPerRule, MaxTrackedLeases).
	EventUntracked = "untracked"
)

// LeaseEvents are the values of the event label.
var LeaseEvents = []string{EventAcquired, EventRefused, EventReleased, EventExpired, EventRenewed, EventGone, EventFallback, EventError, EventUntracked}

// Forwarded lease calls, the values of the call label.
const (
	CallAcquire = "acquire"
	CallRelease = "release"
	CallRenew   = "renew"
)

// Results of forwarded lease calls besides allowed, limited and error.
const (
	ResultReleased = "released"
	ResultRenewed  = "renewed"
	ResultGone     = "gone"
)

// ForwardedLeaseResults are the results of each forwarded call.
var ForwardedLeaseResults = map[string][]string{
	CallAcquire: {ResultAllowed, ResultLimited, ResultError},
	CallRelease: {ResultReleased, ResultGone, ResultError},
	CallRenew:   {ResultRenewed, ResultGone, ResultError},
}

// Handoff results (limiter_topology_handoffs_total).
const (
	HandoffSeeded      = "seeded"
	HandoffAlready     = "already"
	HandoffUnreachable = "unreachable"
	HandoffStoreError  = "store_error"
)

// HandoffResults are the results limiter_topology_handoffs_total counts.
var HandoffResults = []string{HandoffSeeded, HandoffAlready, HandoffUnreachable, HandoffStoreError}

// Metrics are the engine's series, registered by New.
type Metrics struct {
	Decisions *prometheus.CounterVec
	Forwarded *prometheus.CounterVec
	// ForwardedLeases count the lease calls forwarded to the region
	// holding the lease, by rule, call and result.
	ForwardedLeases *prometheus.CounterVec
	AdmittedCost    *prometheus.CounterVec
	DenyHits        *prometheus.CounterVec
	Leased          *prometheus.CounterVec
	RuleLimit       *prometheus.GaugeVec
	RuleRate        *prometheus.GaugeVec
	Invalid         *prometheus.CounterVec
	Overloaded      prometheus.Counter
	Refunds         *prometheus.CounterVec
	Stale           *prometheus.CounterVec
	Handoffs        *prometheus.CounterVec
	Duration        prometheus.Histogram
	Leases          *prometheus.CounterVec
	// AdaptiveLimit is each adaptive concurrency rule's limit of the key
	// of its latest Acquire through this instance.
	AdaptiveLimit *prometheus.GaugeVec
	Untracked     prometheus.Counter
	Paced         *prometheus.CounterVec
	PacedWait     *prometheus.HistogramVec
	Settlements   *prometheus.CounterVec
	// PriorityDecisions count decided checks and Acquires by priority
	// class and result (PriorityResults).
	PriorityDecisions *prometheus.CounterVec
}

// Results of limiter_priority_decisions_total: a check or an Acquire
// allowed, refused by a limit, or refused only for the reserves its class
// keeps (of a rate rule, or of a concurrency rule's leases).
const (
	PriorityAllowed  = "allowed"
	PriorityLimited  = "limited"
	PriorityReserved = "reserved"
)

// PriorityResults are the results limiter_priority_decisions_total counts.
var PriorityResults = []string{PriorityAllowed, PriorityLimited, PriorityReserved}

// Classes makes the series of limiter_priority_decisions_total for the
// configured classes, so that each reads 0 before its first decision: its
// class label takes no other values.
func (m *Metrics) Classes(names []string) {
	for _, c := range names {
		for _, r := range PriorityResults {
			m.PriorityDecisions.WithLabelValues(c, r)
		}
	}
}

// Settle results, the values of the result label of limiter_settlements_total.
const (
	SettleSettled = "settled"
	SettleReplay  = "replay"
	SettleExpired = "expired"
	SettleError   = "error"
)

// Forget removes the series of a rule no longer in force.
func (m *Metrics) Forget(rule string) {
	m.PacedWait.DeleteLabelValues(rule)
	for _, v := range []*prometheus.CounterVec{m.Decisions, m.Forwarded, m.ForwardedLeases, m.Leases, m.Paced, m.Settlements} {
		v.DeletePartialMatch(prometheus.Labels{"rule": rule})
	}
	for _, v := range []*prometheus.CounterVec{m.AdmittedCost, m.DenyHits, m.Leased} {
		v.DeleteLabelValues(rule)
	}
	m.RuleLimit.DeleteLabelValues(rule)
	m.RuleRate.DeleteLabelValues(rule)
	m.AdaptiveLimit.DeleteLabelValues(rule)
}

// New makes the engine's series and registers them on reg.
func New(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		Decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_decisions_total",
			Help: "Checks decided, by rule and result (uncertain_allowed: the store may have counted it, its reply did not come in time).",
		}, []string{"rule", "result"}),
		Forwarded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_forwarded_checks_total",
			Help: "Checks of pinned rules forwarded to the key's home region, by rule and result (error: no answer).",
		}, []string{"rule", "result"}),
		ForwardedLeases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_forwarded_lease_calls_total",
			Help: "Lease calls of concurrency rules forwarded to the region holding the lease (a pinned rule's key's home), by rule, call (acquire, release, renew) and result (acquire: allowed, limited; release: released, gone; renew: renewed, gone; error: no answer).",
		}, []string{"rule", "call", "result"}),
		AdmittedCost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_admitted_cost_total",
			Help: "Tokens admitted by this instance, by rule; summed over every instance of every region it is the global admission.",
		}, []string{"rule"}),
		DenyHits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_deny_cache_hits_total",
			Help: "Checks rejected from the deny cache, without a store call, by rule.",
		}, []string{"rule"}),
		Leased: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_leased_checks_total",
			Help: "Checks admitted from this instance's leased tokens, without a store call, by rule.",
		}, []string{"rule"}),
		RuleLimit: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_rule_capacity",
			Help: "A rule's capacity: the burst of a bucket, the limit of a window.",
		}, []string{"rule"}),
		AdaptiveLimit: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_concurrency_adaptive_limit",
			Help: "An adaptive concurrency rule's limit of the key of its latest Acquire through this instance, as the store holds it (the rule's starting limit before any).",
		}, []string{"rule"}),
		RuleRate: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_rule_sustained_rate",
			Help: "A rule's long-run tokens per second: its refill rate, or its limit over its window.",
		}, []string{"rule"}),
		Invalid: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_invalid_requests_total",
			Help: "Checks refused as invalid, by the field at fault.",
		}, []string{"field"}),
		Overloaded: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_overloaded_checks_total",
			Help: "Checks answered RESOURCE_EXHAUSTED: they waited in this process too long to reach the store (nothing spent).",
		}),
		Refunds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_home_refunds_total",
			Help: "Refunds to a key's home region of a pinned rule's spend, when another rule of the check refused, by result.",
		}, []string{"result"}),
		Stale: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_topology_stale_total",
			Help: "Forwards a key's home region refused because its topology is newer and homes the key elsewhere, by the region that refused (the check is routed again once when the topology file read again is newer too, else its rule's on_failure decides).",
		}, []string{"peer"}),
		Leases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_concurrency_leases_total",
			Help: "Leases of concurrency rules, by rule and event: acquired (fallback_acquired: of them, held in this instance's fallback while the store failed), refused (the limit was reached), released, expired (granted here and neither released nor renewed through this instance in time), renewed, renew_gone (a renewal of a lease already gone), error (a fail-closed refusal or a store failure), untracked (granted, but past the leases this instance tracks for limiter_concurrency_leases_in_flight: inflight.MaxTrackedLeasesPerRule, MaxTrackedLeases).",
		}, []string{"rule", "event"}),
		Untracked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_concurrency_untracked_total",
			Help: "Leases granted but left out of limiter_concurrency_leases_in_flight: this instance already tracked the most it tracks, of the rule (10,000) or of all (100,000).",
		}),
		Paced: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_paced_checks_total",
			Help: "Paced checks (max_wait_ms > 0) of token bucket and GCRA rules, by rule and result: allowed (a slot reserved within the wait, limiter_paced_wait_seconds has its wait), limited (the next slot is beyond the wait: nothing spent).",
		}, []string{"rule", "result"}),
		PacedWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "limiter_paced_wait_seconds",
			Help:    "The wait answered to allowed paced checks (the caller sends after it), by rule.",
			Buckets: []float64{0, .001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}, []string{"rule"}),
		Settlements: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_settlements_total",
			Help: "Settles of checks' estimates with their actual costs, by rule and result: settled (the difference applied), replay (settled before: nothing changed), expired (past settle_within: the estimate stands), error (the store did not answer).",
		}, []string{"rule", "result"}),
		Handoffs: newHandoffMetric(),
		PriorityDecisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_priority_decisions_total",
			Help: "Checks and Acquires decided, by priority class (one of --priority.classes) and result (reserved: refused only for the reserves of the classes above it).",
		}, []string{"class", "result"}),
		Duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "limiter_check_duration_seconds",
			Help:    "Time to decide one check inside limiterd.",
			Buckets: []float64{.00005, .0001, .00025, .0005, .001, .002, .005, .01, .025, .1},
		}),
	}
	for _, c := range []prometheus.Collector{m.Decisions, m.Forwarded, m.ForwardedLeases, m.AdmittedCost, m.DenyHits, m.Leased,
		m.RuleLimit, m.RuleRate, m.Invalid, m.Overloaded, m.Refunds, m.Stale, m.Handoffs, m.Duration, m.Leases, m.AdaptiveLimit, m.Untracked,
		m.Paced, m.PacedWait, m.Settlements, m.PriorityDecisions} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, f := range []string{"rule_id", "key", "cost", "attributes", "lease_id", "max_wait_ms", "reservation", "settle", "settlement", "actual_cost", "priority", "duration_ms"} {
		m.Invalid.WithLabelValues(f)
	}
	for _, r := range []string{"ok", "error"} {
		m.Refunds.WithLabelValues(r)
	}
	for _, r := range HandoffResults {
		m.Handoffs.WithLabelValues(r)
	}
	return m, nil
}

func newHandoffMetric() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "limiter_topology_handoffs_total",
		Help: "Pinned rules' keys moved here by a topology switch or a change of the rule's home_keys, at their first check within the rule's handoff window, by result: seeded (this instance took the old home's count), already (another instance of the region had), unreachable (the old home did not answer: a fail-open rule's key starts from a full bucket, a fail-closed rule refuses the check), store_error (this region's store failed: the check is decided as on a store failure, and the next one tries again).",
	}, []string{"result"})
}

// Memory is an in-process store's size, as bucket.Memory reports it.
type Memory interface {
	Len() int
	Bytes() int64
	MaxBytes() int64
	Evicted() uint64
}

// MemoryCollectors export the size of an in-process store m (the
// embedded store or the fallback, as label store says): its buckets, their
// memory and its cap, and its evictions.
func MemoryCollectors(m Memory, store string) []prometheus.Collector {
	labels := prometheus.Labels{"store": store}
	return []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "limiter_memory_buckets", ConstLabels: labels,
			Help: "Buckets held by an in-process store (embedded: the store of a limiterd without Redis; fallback: fail-open decisions while the store is down), expired ones not yet swept included.",
		}, func() float64 { return float64(m.Len()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "limiter_memory_bytes", ConstLabels: labels,
			Help: "Memory of the buckets of an in-process store, as counted for its cap (overhead, key, rule id and log of each).",
		}, func() float64 { return float64(m.Bytes()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "limiter_memory_max_bytes", ConstLabels: labels,
			Help: "The cap of limiter_memory_bytes.",
		}, func() float64 { return float64(m.MaxBytes()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "limiter_memory_evictions_total", ConstLabels: labels,
			Help: "Unexpired buckets an in-process store dropped at its cap to make room (the key's next check starts from a fresh bucket).",
		}, func() float64 { return float64(m.Evicted()) }),
	}
}
