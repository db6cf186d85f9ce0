package redisstore

import (
	"context"
	"testing"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestStoreKeep: a check that keeps a reserve for higher priority classes
// is refused, as Reserved, once its spend would dip into it, by Take and
// by TakeAll beside a rule that keeps nothing, and spends nothing then.
func TestStoreKeep(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ctx := context.Background()
	s, _ := newTestStore(t, Options{Addrs: c.Addrs()})
	tb := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 100, RefillPerSecond: 0.001}
	win := bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 1000, Window: 3600e9}
	if d, err := s.Take(ctx, bucket.Request{Rule: "k", Key: "c", Limit: tb, Cost: 70, Keep: 0.25}); err != nil || !d.Allowed {
		t.Fatalf("sheddable 70 of 100: %+v, %v", d, err)
	}
	d, err := s.Take(ctx, bucket.Request{Rule: "k", Key: "c", Limit: tb, Cost: 10, Keep: 0.25})
	if err != nil || d.Allowed || !d.Reserved || d.At == 0 {
		t.Fatalf("sheddable 10 of 30: %+v, %v; want refused, reserved", d, err)
	}
	ds, err := s.TakeAll(ctx, []bucket.Request{
		{Rule: "w", Key: "c", Limit: win, Cost: 1},
		{Rule: "k", Key: "c", Limit: tb, Cost: 11, Keep: 0.2},
	})
	if err != nil || !ds[0].Allowed || ds[1].Allowed || !ds[1].Reserved {
		t.Fatalf("default 11 of 30 beside a window: %+v, %v", ds, err)
	}
	ds, err = s.TakeAll(ctx, []bucket.Request{
		{Rule: "w", Key: "c", Limit: win, Cost: 1},
		{Rule: "k", Key: "c", Limit: tb, Cost: 30},
	})
	if err != nil || !ds[0].Allowed || !ds[1].Allowed {
		t.Fatalf("critical 30 of 30: %+v, %v", ds, err)
	}
	if ds[0].Remaining != 999 {
		t.Fatalf("the window counts %v left, want 999: a refused check spent", ds[0].Remaining)
	}
	d, err = s.Take(ctx, bucket.Request{Rule: "k", Key: "c", Limit: tb, Cost: 1, Keep: 0.2})
	if err != nil || d.Allowed || d.Reserved {
		t.Fatalf("default on an empty bucket: %+v, %v; want refused, not reserved", d, err)
	}
}
