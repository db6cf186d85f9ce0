package redisstore

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/pkg/bucket"
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
	opHandoff           // buckets handed to a key's new home region
	opUsage             // buckets and leases read without spending
	opReset             // buckets put back to full by an admin
	opSettle            // estimates settled with their actual costs
	numOps
)

var opNames = [numOps]string{"script", "multi", "undo", "debit", "refund", "acquire", "release", "renew", "handoff", "usage", "reset", "settle"}

// metrics are those of the store's operations; those of the sending of
// their scripts to the nodes are the pipeline package's.
type metrics struct {
	scriptDuration [len(scriptAlgorithms)]prometheus.Observer
	multiDuration  prometheus.Observer
	debitDuration  prometheus.Observer
	handoffDur     prometheus.Observer
	usageDur       prometheus.Observer
	settleDur      prometheus.Observer
	leaseDuration  [3]prometheus.Observer // acquire, release, renew
	errors         [numOps]prometheus.Counter
	overloaded     prometheus.Counter
	outcomeUnknown prometheus.Counter
	debitFallbacks prometheus.Counter
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
	fallbacks := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "limiter_store_debit_fallbacks_total",
		Help: "Batched debit calls that failed (a slot moved, a node failing) and whose clients were sent again one call each.",
	})
	for _, c := range []prometheus.Collector{dur, errs, overloaded, unknown, fallbacks} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register store metrics: %w", err)
		}
	}
	m := &metrics{
		multiDuration: dur.WithLabelValues("multi"), debitDuration: dur.WithLabelValues("debit"),
		handoffDur: dur.WithLabelValues("handoff"),
		usageDur:   dur.WithLabelValues("usage"),
		settleDur:  dur.WithLabelValues("settle"),
		overloaded: overloaded, outcomeUnknown: unknown, debitFallbacks: fallbacks,
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

// failed counts a store call of kind o that failed with err as what err
// says it was: never sent (bucket.ErrOverloaded), perhaps applied
// (bucket.ErrOutcomeUnknown, also a store error), or not applied.
func (m *metrics) failed(o op, err error) {
	switch {
	case errors.Is(err, bucket.ErrOverloaded):
		m.overloaded.Inc()
		return
	case errors.Is(err, bucket.ErrOutcomeUnknown):
		m.outcomeUnknown.Inc()
	}
	m.errors[o].Inc()
}
