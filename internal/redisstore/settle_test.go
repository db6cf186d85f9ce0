package redisstore

import (
	"context"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestSettle: on a real cluster, a settle with an actual cost below the
// estimate gives the difference back, one above takes the extra, a
// replay (even with another cost) changes nothing and answers as the
// first, and the record expires with its TTL; the same as the embedded
// store does, for every algorithm.
func TestSettle(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	rs, _ := newTestStore(t, Options{Addrs: c.Addrs(), Timeout: time.Second})
	ctx := context.Background()
	limits := []bucket.Limit{
		{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 1e-6},
		{Algorithm: bucket.GCRA, Capacity: 10, RefillPerSecond: 1e-6},
		{Algorithm: bucket.SlidingWindow, Capacity: 10, Window: time.Hour},
		{Algorithm: bucket.FixedWindow, Capacity: 10, Window: time.Hour},
		{Algorithm: bucket.SlidingLog, Capacity: 10, Window: time.Hour},
	}
	seq := 0
	for _, store := range []struct {
		name string
		s    bucket.Backend
	}{{"redis", rs}, {"memory", bucket.NewMemory()}} {
		for _, lim := range limits {
			for _, tc := range []struct {
				name             string
				estimate, actual float64
				left             float64
			}{
				{"gives back", 6, 2, 8},
				{"takes the extra", 2, 9, 1},
				{"all back", 4, 0, 10},
				{"into debt", 5, 30, 0},
			} {
				t.Run(store.name+"/"+string(lim.Algorithm)+"/"+tc.name, func(t *testing.T) {
					seq++
					req := bucket.Request{Rule: "settle-" + string(lim.Algorithm), Key: "k" + strconv.Itoa(seq), Limit: lim, Cost: tc.estimate}
					d, err := store.s.Take(ctx, req)
					if err != nil || !d.Allowed || d.At <= 0 {
						t.Fatalf("take: %+v, %v", d, err)
					}
					left := func() (float64, bucket.Decision) {
						t.Helper()
						ds, err := store.s.Usage(ctx, []bucket.Request{{Rule: req.Rule, Key: req.Key, Limit: lim, Cost: 1}})
						if err != nil {
							t.Fatal(err)
						}
						return math.Round(ds[0].Remaining*1e6) / 1e6, ds[0]
					}
					set := bucket.Settlement{Request: req, At: d.At, Actual: tc.actual, ID: "id" + strconv.Itoa(seq), TTL: 200 * time.Millisecond}
					got, err := store.s.Settle(ctx, set)
					if err != nil || got.Replay || got.Actual != tc.actual {
						t.Fatalf("Settle = %+v, %v", got, err)
					}
					l, u := left()
					if l != tc.left {
						t.Fatalf("after the settle: %v left, want %v", l, tc.left)
					}
					if tc.actual > 10 && u.Allowed {
						t.Fatalf("after a settle of %v: %+v, want refused (in debt)", tc.actual, u)
					}
					again := set
					again.Actual = 1
					if got, err := store.s.Settle(ctx, again); err != nil || !got.Replay || got.Actual != tc.actual {
						t.Fatalf("replay = %+v, %v; want a replay of %v", got, err, tc.actual)
					}
					if l, _ := left(); l != tc.left {
						t.Fatalf("after the replay: %v left, want %v", l, tc.left)
					}
				})
			}
		}
	}
	t.Run("record expires", func(t *testing.T) {
		req := bucket.Request{Rule: "settle-ttl", Key: "k", Limit: limits[3], Cost: 1}
		d, err := rs.Take(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		// 1 s: a record of 50 ms was gone before a loaded machine read it.
		set := bucket.Settlement{Request: req, At: d.At, Actual: 1, ID: "ttl", TTL: time.Second}
		if _, err := rs.Settle(ctx, set); err != nil {
			t.Fatal(err)
		}
		if ttl, err := rs.Client().PTTL(ctx, SettleKey("k", "ttl")).Result(); err != nil || ttl <= 0 || ttl > time.Second {
			t.Fatalf("record's TTL: %v, %v; want (0, 1s]", ttl, err)
		}
		testenv.WaitFor(t, "the record expired", func() bool {
			n, err := rs.Client().Exists(ctx, SettleKey("k", "ttl")).Result()
			return err == nil && n == 0
		})
	})
}
