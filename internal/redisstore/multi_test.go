package redisstore

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestTakeAll: a check refused by one rule spends nothing from the others,
// whether they count against the same client (one script) or another
// (given back by the undo script), for every algorithm.
func TestTakeAll(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ctx := context.Background()
	s, err := New(ctx, Options{Addrs: c.Addrs(), Timeout: time.Second}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	gate := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 1, RefillPerSecond: 1e-6}
	others := []bucket.Limit{
		{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 1e-6},
		{Algorithm: bucket.GCRA, Capacity: 10, RefillPerSecond: 1e-6},
		{Algorithm: bucket.SlidingWindow, Capacity: 10, Window: time.Hour},
		{Algorithm: bucket.FixedWindow, Capacity: 10, Window: time.Hour},
		{Algorithm: bucket.SlidingLog, Capacity: 10, Window: time.Hour},
	}
	for _, sameClient := range []bool{true, false} {
		for _, other := range others {
			name := string(other.Algorithm) + map[bool]string{true: "/same-client", false: "/other-client"}[sameClient]
			t.Run(name, func(t *testing.T) {
				gateKey, otherKey := "c-"+name, "c-"+name
				if !sameClient {
					otherKey = "d-" + name
				}
				reqs := []bucket.Request{
					{Rule: "other", Key: otherKey, Limit: other, Cost: 2},
					{Rule: "gate", Key: gateKey, Limit: gate, Cost: 1},
				}
				d, err := s.TakeAll(ctx, reqs)
				if err != nil || !d[0].Allowed || !d[1].Allowed || d[0].Remaining != 8 {
					t.Fatalf("first: %+v, %v", d, err)
				}
				d, err = s.TakeAll(ctx, reqs)
				if err != nil || !d[0].Allowed || d[1].Allowed {
					t.Fatalf("second: %+v, %v; want the gate refusing", d, err)
				}
				// The refused check left "other" as it was: 8 left.
				got, err := s.Take(ctx, bucket.Request{Rule: "other", Key: otherKey, Limit: other, Cost: 8})
				if err != nil || !got.Allowed {
					t.Fatalf("8 more tokens of other after a refused check: %+v, %v", got, err)
				}
				got, err = s.Take(ctx, bucket.Request{Rule: "other", Key: otherKey, Limit: other, Cost: 1})
				if err != nil || got.Allowed {
					t.Fatalf("an 11th token of other: %+v, %v; want refused", got, err)
				}
			})
		}
	}
}
