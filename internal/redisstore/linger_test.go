package redisstore

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestLinger: while one pipeline to a node is in flight, the checks that
// arrive go out together once it is answered, in one pipeline, instead of
// a lone check on the second connection and the rest after it; and a
// linger that passes first sends what it holds.
func TestLinger(t *testing.T) {
	const later = 20
	for _, tc := range []struct {
		name   string
		linger time.Duration
		pause  time.Duration
		// pipelines the checks went in: the first, then the later ones
		pipelines func(n uint64) bool
		want      string
		expired   bool
	}{
		// The node answers the first pipeline after the pause; the
		// linger (longer) ends when it does.
		{"held-until-answered", 3 * time.Second, time.Second, func(n uint64) bool { return n == 2 }, "2", false},
		// Without a linger the second connection sends the first later
		// check alone, at once: three pipelines at least.
		{"no-linger", 0, 300 * time.Millisecond, func(n uint64) bool { return n >= 3 }, "3 or more", false},
		// A linger shorter than the pause ends first and sends its batch.
		{"linger-passes", 100 * time.Millisecond, time.Second, func(n uint64) bool { return n >= 2 }, "2 or more", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node := redistest.NewNode(t)
			s, reg := newTestStore(t, Options{Addrs: []string{node.Addr()}, Mode: ModeStandalone, PipelinesPerNode: 2,
				Linger: tc.linger, Timeout: 8 * time.Second, MaxQueueWait: 5 * time.Second})
			// Both workers connected, and the counts from here on.
			var warm sync.WaitGroup
			for i := range 8 {
				warm.Go(func() { mustTake(t, s, "warm"+strconv.Itoa(i), 1) })
			}
			warm.Wait()
			before, sum0 := sampleCount(t, reg, "limiter_store_pipeline_checks"), sampleSum(t, reg, "limiter_store_pipeline_checks")
			expired0 := metricValue(t, reg, "limiter_store_linger_expired_total")

			unpause := pause(t, node.Addr())
			var wg sync.WaitGroup
			take := func(key string) {
				d, err := s.Take(context.Background(), bucket.Request{Rule: "r", Key: key, Limit: testLimit, Cost: 1})
				if err != nil || !d.Allowed {
					t.Errorf("Take(%s) = %+v, %v", key, d, err)
				}
			}
			n := s.node(node.Addr())
			wg.Go(func() { take("first") })
			// The first check is in flight (its pipeline written) before
			// the later ones queue, and the first of them is taken by the
			// other worker before the rest queue: without a linger it goes
			// alone, however fast the rest come.
			waitFor(t, "sending the first check", func() bool { return n.inFlight.Load() == 1 })
			wg.Go(func() { take("later0") })
			waitFor(t, "taking the first later check", func() bool { return len(n.calls) == 0 && (tc.linger > 0 || n.inFlight.Load() == 2) })
			for i := 1; i < later; i++ {
				wg.Go(func() { take("later" + strconv.Itoa(i)) })
			}
			time.Sleep(tc.pause)
			unpause()
			wg.Wait()
			pipelines := sampleCount(t, reg, "limiter_store_pipeline_checks") - before
			if checks := sampleSum(t, reg, "limiter_store_pipeline_checks") - sum0; checks != later+1 {
				t.Errorf("%v checks sent, want %d", checks, later+1)
			}
			if !tc.pipelines(pipelines) {
				t.Errorf("the checks went in %d pipelines, want %s", pipelines, tc.want)
			}
			if expired := metricValue(t, reg, "limiter_store_linger_expired_total") - expired0; (expired > 0) != tc.expired {
				t.Errorf("%v lingers expired, want any: %v", expired, tc.expired)
			}
		})
	}
}

// TestArgsCacheBound: the cache of check arguments keeps at most
// maxCachedArgs (costs come from clients: distinct ones cannot grow it), and
// what it returns past the bound is still right.
func TestArgsCacheBound(t *testing.T) {
	var c argsCache
	lim := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 2.5}
	for i := range maxCachedArgs + 100 {
		a := c.get(lim, float64(i+1))
		if want := strconv.Itoa(i + 1); a[0] != "10" || a[1] != "2.5" || a[2] != want {
			t.Fatalf("args for cost %d: %v", i+1, a)
		}
	}
	if n := len(c.m); n != maxCachedArgs {
		t.Fatalf("%d entries cached, want the bound %d", n, maxCachedArgs)
	}
	w := bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 5, Window: 1500 * time.Millisecond}
	if a := c.get(w, 1); a[0] != "5" || a[1] != "1500000" || a[2] != "1" {
		t.Fatalf("window args: %v", a)
	}
}
