package redisstore

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sony/gobreaker/v2"
)

// op is a kind of store call, the op label of limiter_store_errors_total.
type op int

const (
	opScript  op = iota // a check of one rule
	opMulti             // an all-or-nothing check of one client's rules
	opUndo              // the undo of a refused all-or-nothing check
	opDebit             // other regions' spends
	opRefund            // leased tokens given back
	opAcquire           // leases of concurrency rules taken
	opRelease           // leases given back
	opRenew             // leases extended
	numOps
)

var opNames = [numOps]string{"script", "multi", "undo", "debit", "refund", "acquire", "release", "renew"}

type metrics struct {
	scriptDuration [len(scriptAlgorithms)]prometheus.Observer
	multiDuration  prometheus.Observer
	debitDuration  prometheus.Observer
	leaseDuration  [3]prometheus.Observer // acquire, release, renew
	errors         [numOps]prometheus.Counter
	overloaded     prometheus.Counter
	outcomeUnknown prometheus.Counter
	slowReplies    prometheus.Counter
	up             prometheus.Gauge

	batchSize          prometheus.Observer
	lingerExpired      prometheus.Counter
	breakersOpen       prometheus.Gauge
	breakerTransitions *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	dur := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "limiter_store_script_duration_seconds",
		Help:    "Time of one store script call, round trip included; for coalesced checks and debits, their pipeline.",
		Buckets: []float64{.0001, .00025, .0005, .001, .002, .005, .01, .025, .1},
	}, []string{"script"})
	errs := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "limiter_store_errors_total",
		Help: "Store calls that failed, by operation (checks answered as overloaded are not counted here).",
	}, []string{"op"})
	overloaded := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "limiter_store_overloaded_total",
		Help: "Checks never sent to Redis because they waited in limiterd's own queue past their deadline or the queue cap.",
	})
	unknown := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "limiter_store_outcome_unknown_total",
		Help: "Checks sent to Redis whose reply did not come in time: they may have been applied.",
	})
	slow := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "limiter_store_slow_replies_total",
		Help: "Checks whose reply came after --redis.timeout and before --redis.reply-deadline: decided by Redis and used, counted against the node by its breaker.",
	})
	up := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "limiter_store_up",
		Help: "1 when every Redis primary answered the store's last background probe.",
	})
	batch := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "limiter_store_pipeline_checks",
		Help:    "Checks sent together in one pipeline to one Redis node.",
		Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128},
	})
	linger := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "limiter_store_linger_expired_total",
		Help: "Pipelines sent because their linger (--redis.linger) passed before the pipeline in flight to their node was answered: a node slower to answer than the linger.",
	})
	open := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "limiter_store_breakers_open",
		Help: "Redis nodes whose circuit breaker is open (not called until a probe succeeds).",
	})
	trans := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "limiter_store_breaker_transitions_total",
		Help: "Circuit breaker state changes, by the state entered.",
	}, []string{"state"})
	for _, c := range []prometheus.Collector{dur, errs, overloaded, unknown, slow, up, batch, linger, open, trans} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register store metrics: %w", err)
		}
	}
	for _, st := range []gobreaker.State{gobreaker.StateClosed, gobreaker.StateHalfOpen, gobreaker.StateOpen} {
		trans.WithLabelValues(st.String())
	}
	m := &metrics{
		multiDuration: dur.WithLabelValues("multi"), debitDuration: dur.WithLabelValues("debit"),
		overloaded: overloaded, outcomeUnknown: unknown, slowReplies: slow, up: up,
		batchSize: batch, lingerExpired: linger, breakersOpen: open, breakerTransitions: trans,
	}
	for i, o := range []op{opAcquire, opRelease, opRenew} {
		m.leaseDuration[i] = dur.WithLabelValues(opNames[o])
	}
	for i, a := range scriptAlgorithms {
		m.scriptDuration[i] = dur.WithLabelValues(string(a))
	}
	for o := range numOps {
		m.errors[o] = errs.WithLabelValues(opNames[o])
	}
	return m, nil
}

// failed counts a store call that failed as what f says it was.
func (m *metrics) failed(o op, f failure) {
	switch f {
	case overloaded:
		m.overloaded.Inc()
		return
	case unknown:
		m.outcomeUnknown.Inc()
	}
	m.errors[o].Inc()
}
