package apply

import "github.com/prometheus/client_golang/prometheus"

// Metrics are what Appliers record, by source region. Make them with
// NewMetrics; they are safe for concurrent use.
type Metrics struct {
	Overshoot  *prometheus.HistogramVec
	Applied    *prometheus.CounterVec
	Duplicates *prometheus.CounterVec
	Refilled   *prometheus.CounterVec
	Replays    *prometheus.CounterVec
	Skipped    *prometheus.CounterVec
	Invalid    *prometheus.CounterVec
	Deferred   *prometheus.CounterVec
	Retried    *prometheus.CounterVec
	Rejected   prometheus.Counter
	Lag        *prometheus.HistogramVec
}

// NewMetrics makes the metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		Overshoot: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "limiter_overshoot_tokens",
			Help:    "For each key debited with another region's spends, by how much the admissions known here exceed the rule's limit right after (0: within it): the cross-region overshoot, by rule and source region.",
			Buckets: []float64{0, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10000},
		}, []string{"rule", "source_region"}),
		Applied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_spends_applied_total",
			Help: "Clients debited with another region's spends, by source region.",
		}, []string{"source_region"}),
		Duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_spends_duplicates_total",
			Help: "Clients whose debit was skipped because the message was applied already.",
		}, []string{"source_region"}),
		Refilled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_spends_refilled_total",
			Help: "Clients whose spends from another region had refilled by the time they arrived: debited as of their last admission, they changed nothing, and nothing was written.",
		}, []string{"source_region"}),
		Replays: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_spend_replays_total",
			Help: "Spend messages skipped because the same flush (instance, sequence, part) was applied from an earlier stream message.",
		}, []string{"source_region"}),
		Skipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_spends_skipped_total",
			Help: "Spend entries of rules this region does not have or does not reconcile.",
		}, []string{"source_region"}),
		Invalid: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_spends_invalid_total",
			Help: "Spend entries skipped because a field was invalid (a cost above the maximum, a bad rule id or key); the other entries of their message are applied.",
		}, []string{"source_region"}),
		Deferred: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_spends_deferred_total",
			Help: "Clients' debits put in the retry stream, their Redis node having failed or their slot's earlier debits waiting there.",
		}, []string{"source_region"}),
		Retried: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_spends_retried_total",
			Help: "Clients debited from the retry stream, by source region.",
		}, []string{"source_region"}),
		Rejected: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_spend_messages_rejected_total",
			Help: "Spend messages that were malformed, oversized or misaddressed, and terminated.",
		}),
		Lag: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "limiter_reconcile_lag_seconds",
			Help:    "From a spend's admission in its source region to its debit here (the source's clock).",
			Buckets: []float64{.05, .1, .25, .5, .75, 1, 1.5, 2, 3, 5, 10, 30, 60, 300},
		}, []string{"source_region"}),
	}
	for _, c := range []prometheus.Collector{m.Overshoot, m.Applied, m.Duplicates, m.Refilled, m.Replays, m.Skipped, m.Invalid, m.Deferred, m.Retried, m.Rejected, m.Lag} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// AddSource makes the counters of a source region.
func (m *Metrics) AddSource(src string) {
	m.Applied.WithLabelValues(src)
	m.Duplicates.WithLabelValues(src)
	m.Refilled.WithLabelValues(src)
	m.Replays.WithLabelValues(src)
	m.Skipped.WithLabelValues(src)
	m.Invalid.WithLabelValues(src)
	m.Deferred.WithLabelValues(src)
	m.Retried.WithLabelValues(src)
}
