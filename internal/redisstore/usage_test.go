package redisstore

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestStoreUsage reads buckets of every algorithm and a lease set through
// the store: a key never checked is not made, a refused check answers what
// Usage did just before, and the leases held are counted.
func TestStoreUsage(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ctx := context.Background()
	s, err := New(ctx, Options{Addrs: c.Addrs(), Timeout: time.Second}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	limits := []bucket.Limit{
		{Algorithm: bucket.TokenBucket, Capacity: 3, RefillPerSecond: 0.001},
		{Algorithm: bucket.GCRA, Capacity: 3, RefillPerSecond: 0.001},
		{Algorithm: bucket.SlidingWindow, Capacity: 3, Window: time.Hour},
		{Algorithm: bucket.SlidingLog, Capacity: 3, Window: time.Hour},
		{Algorithm: bucket.FixedWindow, Capacity: 3, Window: 24 * time.Hour},
	}
	var reqs []bucket.Request
	for _, l := range limits {
		reqs = append(reqs, bucket.Request{Rule: "u-" + string(l.Algorithm), Key: "client", Limit: l, Cost: 1})
	}
	us, err := s.Usage(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i, u := range us {
		if !u.Allowed || u.Remaining != 3 || u.ResetAfter != 0 {
			t.Errorf("%s: fresh usage %+v, want allowed, 3 left, reset 0", limits[i].Algorithm, u)
		}
		if n, _ := s.Client().Exists(ctx, Key(reqs[i].Rule, reqs[i].Key)).Result(); n != 0 {
			t.Errorf("%s: usage made the key", limits[i].Algorithm)
		}
	}
	for i, r := range reqs {
		for range 3 {
			if d, err := s.Take(ctx, r); err != nil || !d.Allowed {
				t.Fatalf("%s: Take = %+v, %v", limits[i].Algorithm, d, err)
			}
		}
	}
	us, err = s.Usage(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range reqs {
		d, err := s.Take(ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		u := us[i]
		// The clock moved between the two calls: the refill of a token
		// bucket is tiny, a window's reset a few µs shorter.
		if u.Allowed || d.Allowed || u.Remaining > 0.01 || d.Remaining > 0.01 || u.RetryAfter <= 0 ||
			d.RetryAfter > u.RetryAfter || u.RetryAfter-d.RetryAfter > time.Second {
			t.Errorf("%s: usage %+v, then check %+v", limits[i].Algorithm, u, d)
		}
	}

	ll := bucket.LeaseLimit{Limit: 2, TTL: time.Minute}
	lr := []bucket.LeaseRequest{{Rule: "uc", Key: "client", Limit: ll}, {Rule: "uc", Key: "other", Limit: ll}}
	if _, err := s.Acquire(ctx, lr[:1], "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Acquire(ctx, lr[:1], "b"); err != nil {
		t.Fatal(err)
	}
	lu, err := s.LeaseUsage(ctx, lr)
	if err != nil {
		t.Fatal(err)
	}
	if lu[0].Allowed || lu[0].InFlight != 2 || lu[0].RetryAfter <= 0 || lu[0].RetryAfter > time.Minute {
		t.Errorf("full lease set: %+v", lu[0])
	}
	if !lu[1].Allowed || lu[1].InFlight != 0 || !lu[1].Expires.IsZero() {
		t.Errorf("empty lease set: %+v", lu[1])
	}
	if n, _ := s.Client().Exists(ctx, LeaseKey("uc", "other")).Result(); n != 0 {
		t.Errorf("lease usage made the key")
	}
	// Keeping half of a limit of 4 with 2 held: refused for the reserve,
	// retried when the soonest expires; keeping a quarter: allowed.
	wide := bucket.LeaseLimit{Limit: 4, TTL: time.Minute}
	lu, err = s.LeaseUsage(ctx, []bucket.LeaseRequest{{Rule: "uc", Key: "client", Limit: wide, Keep: 0.5}, {Rule: "uc", Key: "client", Limit: wide, Keep: 0.25}})
	if err != nil {
		t.Fatal(err)
	}
	if lu[0].Allowed || !lu[0].Reserved || lu[0].InFlight != 2 || lu[0].Limit != 4 || lu[0].RetryAfter <= 0 || lu[0].RetryAfter > time.Minute {
		t.Errorf("keeping half of 4 with 2 held: %+v", lu[0])
	}
	if !lu[1].Allowed || lu[1].Reserved || lu[1].RetryAfter != 0 {
		t.Errorf("keeping a quarter of 4 with 2 held: %+v", lu[1])
	}
}
