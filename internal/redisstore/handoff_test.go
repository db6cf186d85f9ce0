package redisstore

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestHandoff: a key's bucket handed from one region's cluster to
// another's, through the store's Used, Seeded and Seed, for every
// algorithm: the new home counts what the old one did, once per
// generation, and the record of the seed expires with its TTL.
func TestHandoff(t *testing.T) {
	oldHome, _ := newTestStore(t, Options{Addrs: redistest.NewCluster(t, 3, 0).Addrs()})
	newHome, _ := newTestStore(t, Options{Addrs: redistest.NewCluster(t, 3, 0).Addrs()})
	ctx := context.Background()
	limits := []bucket.Limit{
		{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 1e-3},
		{Algorithm: bucket.GCRA, Capacity: 10, RefillPerSecond: 1e-3},
		{Algorithm: bucket.SlidingWindow, Capacity: 10, Window: time.Hour},
		{Algorithm: bucket.FixedWindow, Capacity: 10, Window: 24 * time.Hour},
		{Algorithm: bucket.SlidingLog, Capacity: 10, Window: time.Hour},
	}
	var reqs []bucket.Request
	for i, l := range limits {
		// Keys on different nodes, taken in parallel.
		r := bucket.Request{Rule: string(l.Algorithm), Key: fmt.Sprintf("client-%d", i), Limit: l, Cost: 1}
		reqs = append(reqs, r)
		// A stale bucket at the new home, of an earlier generation there.
		if d, err := newHome.Take(ctx, r); err != nil || !d.Allowed {
			t.Fatalf("take at the new home: %+v, %v", d, err)
		}
		for range 7 {
			if d, err := oldHome.Take(ctx, r); err != nil || !d.Allowed {
				t.Fatalf("take at the old home: %+v, %v", d, err)
			}
		}
	}
	used, err := oldHome.Used(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	seeds := make([]bucket.Seed, len(reqs))
	for i, r := range reqs {
		// Within a µs-scale refill of 7 (a window may weigh 7 within a
		// millionth, rounded up).
		if math.Abs(used[i]-7) > 1e-3 {
			t.Errorf("%s: the old home counts %v, want 7", r.Rule, used[i])
		}
		seeds[i] = bucket.Seed{Rule: r.Rule, Key: r.Key, Limit: r.Limit, Generation: 5, Used: used[i], TTL: time.Minute}
	}
	if ok, err := newHome.Seeded(ctx, seeds); err != nil || ok[0] || ok[len(ok)-1] {
		t.Fatalf("seeded before Seed: %v, %v", ok, err)
	}
	if ok, err := newHome.Seed(ctx, seeds); err != nil || !allTrue(ok) {
		t.Fatalf("Seed = %v, %v", ok, err)
	}
	// Racing to seed again (another instance): nothing changes.
	again := append([]bucket.Seed(nil), seeds...)
	for i := range again {
		again[i].Used = 0
	}
	if ok, err := newHome.Seed(ctx, again); err != nil || ok[0] || ok[len(ok)-1] {
		t.Fatalf("second Seed of generation 5 = %v, %v", ok, err)
	}
	if ok, err := newHome.Seeded(ctx, seeds); err != nil || !allTrue(ok) {
		t.Fatalf("Seeded after Seed = %v, %v", ok, err)
	}
	for _, r := range reqs {
		// 3 are left (not 9, the stale bucket's, nor 10): the bucket was
		// raised to the old home's count.
		for i := range 4 {
			d, err := newHome.Take(ctx, r)
			if err != nil || d.Allowed != (i < 3) {
				t.Fatalf("%s: take %d at the new home = %+v, %v", r.Rule, i+1, d, err)
			}
		}
		ttl := newHome.Client().PTTL(ctx, SeedKey(bucket.Seed{Rule: r.Rule, Key: r.Key})).Val()
		if ttl <= 0 || ttl > time.Minute {
			t.Errorf("%s: the seed record lives %v, want up to its TTL (1m)", r.Rule, ttl)
		}
	}
	// A later generation seeds again.
	later := append([]bucket.Seed(nil), seeds...)
	for i := range later {
		later[i].Generation, later[i].Used = 6, 0
	}
	if ok, err := newHome.Seeded(ctx, later); err != nil || ok[0] {
		t.Fatalf("seeded at generation 6 = %v, %v", ok, err)
	}
	if ok, err := newHome.Seed(ctx, later); err != nil || !allTrue(ok) {
		t.Fatalf("Seed at generation 6 = %v, %v", ok, err)
	}
	// A seed raises, never lowers: a seed of 0 (an old home refilled)
	// gives back nothing the bucket spent.
	if d, err := newHome.Take(ctx, reqs[0]); err != nil || d.Allowed {
		t.Fatalf("after a seed of 0: %+v, %v; want still refused", d, err)
	}
}

func allTrue(bs []bool) bool {
	for _, b := range bs {
		if !b {
			return false
		}
	}
	return true
}
