package pipeline

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// A check that waited its whole queue wait while its node's pipelines got
// no reply is blamed on the node (ErrNodeStalled), and the rule's
// on_failure decides it. But on a host whose CPUs are all busy, this
// process's own goroutines, the reader of those replies among them, may
// not run for that long: the node did nothing wrong, and the check is
// limiterd's overload (bucket.ErrOverloaded), as one that waited behind
// other checks. schedWatch tells the two apart: a goroutine that wakes
// every schedEvery and notes when it woke schedLate late or more.
const (
	schedEvery = 10 * time.Millisecond
	schedLate  = 15 * time.Millisecond
)

// schedWatch notes when this process was last not scheduled on time.
type schedWatch struct {
	// woke is when the watch last woke, and late when it last woke
	// schedLate late or more (ns since the Unix epoch; 0: never).
	woke, late atomic.Int64
	// lateWakes counts the late wakes.
	lateWakes prometheus.Counter
}

func newSchedWatch(now time.Time, lateWakes prometheus.Counter) *schedWatch {
	w := &schedWatch{lateWakes: lateWakes}
	w.woke.Store(now.UnixNano())
	return w
}

// run wakes every schedEvery until ctx ends.
func (w *schedWatch) run(ctx context.Context) {
	t := time.NewTicker(schedEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			w.observe(time.Now())
		}
	}
}

// observe records a wake at now.
func (w *schedWatch) observe(now time.Time) {
	ns := now.UnixNano()
	if ns-w.woke.Swap(ns) >= int64(schedEvery+schedLate) {
		w.late.Store(ns)
		w.lateWakes.Inc()
	}
}

// starvedSince reports whether this process went unscheduled for
// schedLate or more at some time from queued (ns since the Unix epoch) to
// now: the watch woke late since then, or has not woken for that long.
func (w *schedWatch) starvedSince(queued int64, now time.Time) bool {
	return w.late.Load() >= queued || now.UnixNano()-w.woke.Load() >= int64(schedEvery+schedLate)
}
