package pipeline

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sony/gobreaker/v2"
)

// metrics are those of the sending of calls; the calls' durations and
// failures are counted by the caller, which knows what each call is.
type metrics struct {
	slowReplies prometheus.Counter
	up          prometheus.Gauge

	batchSize          prometheus.Observer
	lingerExpired      prometheus.Counter
	breakersOpen       prometheus.Gauge
	breakerTransitions *prometheus.CounterVec
	tryAgain           prometheus.Counter
	lateWakes          prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
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
	tryAgain := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "limiter_store_try_again_total",
		Help: "Store calls sent again after a short pause because their node answered TRYAGAIN (a slot being migrated).",
	})
	late := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "limiter_sched_late_wakes_total",
		Help: "Times the process went unscheduled for 15 ms or more (a goroutine woke that late): a host whose CPUs are all busy. A check that waited its queue wait then is overload, not a stalled Redis node.",
	})
	for _, c := range []prometheus.Collector{slow, up, batch, linger, open, trans, tryAgain, late} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register store metrics: %w", err)
		}
	}
	for _, st := range []gobreaker.State{gobreaker.StateClosed, gobreaker.StateHalfOpen, gobreaker.StateOpen} {
		trans.WithLabelValues(st.String())
	}
	return &metrics{
		slowReplies: slow, up: up,
		batchSize: batch, lingerExpired: linger, breakersOpen: open, breakerTransitions: trans,
		tryAgain: tryAgain, lateWakes: late,
	}, nil
}
