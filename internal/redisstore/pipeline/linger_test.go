package pipeline

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// TestLinger: while one pipeline to a node is in flight, the calls that
// arrive go out together once it is answered, in one pipeline, instead of
// a lone call on the second connection and the rest after it; and a
// linger that passes first sends what it holds.
func TestLinger(t *testing.T) {
	const later = 20
	for _, tc := range []struct {
		name   string
		linger time.Duration
		pause  time.Duration
		// pipelines the calls went in: the first, then the later ones
		pipelines func(n uint64) bool
		want      string
		expired   bool
	}{
		// The node answers the first pipeline after the pause; the
		// linger (longer) ends when it does.
		{"held-until-answered", 3 * time.Second, time.Second, func(n uint64) bool { return n == 2 }, "2", false},
		// Without a linger the second connection sends the first later
		// call alone, at once: three pipelines at least.
		{"no-linger", 0, 300 * time.Millisecond, func(n uint64) bool { return n >= 3 }, "3 or more", false},
		// A linger shorter than the pause ends first and sends its batch.
		{"linger-passes", 100 * time.Millisecond, time.Second, func(n uint64) bool { return n >= 2 }, "2 or more", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node := redistest.NewNode(t)
			ns, reg := newTestNodes(t, Options{Addrs: []string{node.Addr()}, Mode: ModeStandalone, PipelinesPerNode: 2,
				Linger: tc.linger, Timeout: 8 * time.Second, MaxQueueWait: 5 * time.Second})
			// Both workers connected, and the counts from here on.
			var warm sync.WaitGroup
			for i := range 8 {
				warm.Go(func() { mustIncr(t, ns, "warm"+strconv.Itoa(i), 1) })
			}
			warm.Wait()
			before, sum0 := testenv.SampleCount(t, reg, "limiter_store_pipeline_checks"), testenv.SampleSum(t, reg, "limiter_store_pipeline_checks")
			expired0 := testenv.MetricValue(t, reg, "limiter_store_linger_expired_total")

			unpause := redistest.Pause(t, node.Addr())
			var wg sync.WaitGroup
			call := func(key string) {
				if n, err := incr(context.Background(), ns, key, 1); err != nil || n != 1 {
					t.Errorf("incr(%s) = %v, %v", key, n, err)
				}
			}
			n := ns.node(node.Addr())
			wg.Go(func() { call("first") })
			// The first call is in flight (its pipeline written) before
			// the later ones queue, and the first of them is taken by the
			// other worker before the rest queue: without a linger it goes
			// alone, however fast the rest come.
			testenv.WaitFor(t, "sending the first call", func() bool { return n.inFlight.Load() == 1 })
			wg.Go(func() { call("later0") })
			testenv.WaitFor(t, "taking the first later call", func() bool { return len(n.calls) == 0 && (tc.linger > 0 || n.inFlight.Load() == 2) })
			for i := 1; i < later; i++ {
				wg.Go(func() { call("later" + strconv.Itoa(i)) })
			}
			time.Sleep(tc.pause)
			unpause()
			wg.Wait()
			pipelines := testenv.SampleCount(t, reg, "limiter_store_pipeline_checks") - before
			if calls := testenv.SampleSum(t, reg, "limiter_store_pipeline_checks") - sum0; calls != later+1 {
				t.Errorf("%v calls sent, want %d", calls, later+1)
			}
			if !tc.pipelines(pipelines) {
				t.Errorf("the calls went in %d pipelines, want %s", pipelines, tc.want)
			}
			if expired := testenv.MetricValue(t, reg, "limiter_store_linger_expired_total") - expired0; (expired > 0) != tc.expired {
				t.Errorf("%v lingers expired, want any: %v", expired, tc.expired)
			}
		})
	}
}
