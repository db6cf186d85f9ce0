package redisstore

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestDebitEpochs: within one epoch a position at or below the marker's is
// a duplicate; a later epoch (the stream made again, its sequences back at
// 1) is applied; an earlier one is a duplicate. A position without an
// epoch is refused.
func TestDebitEpochs(t *testing.T) {
	node := redistest.NewNode(t)
	s, _ := newTestStore(t, Options{Addrs: []string{node.Addr()}, Timeout: time.Second})
	ctx := context.Background()
	lim := bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 1e9, Window: 1000 * time.Hour}
	for i, tt := range []struct {
		pos     Position
		applied bool
	}{
		{Position{Epoch: 2, Seq: 5}, true},
		{Position{Epoch: 2, Seq: 5}, false},
		{Position{Epoch: 2, Seq: 3}, false},
		{Position{Epoch: 3, Seq: 1}, true},
		{Position{Epoch: 2, Seq: 9}, false},
		{Position{Epoch: 3, Seq: 2}, true},
		{Position{Epoch: 3, Seq: 3}, true},
	} {
		res, err := s.ApplyDebits(ctx, "eu", tt.pos, time.Minute, []ClientDebits{{Key: "k", Debits: []Debit{{Rule: "q", Limit: lim, Amount: 1}}}})
		if err != nil {
			t.Fatal(err)
		}
		if got := res.Applied == 1; got != tt.applied {
			t.Errorf("step %d: %+v applied %v, want %v", i, tt.pos, got, tt.applied)
		}
	}
	res, err := s.ApplyDebits(ctx, "eu", Position{Seq: 4}, time.Minute, []ClientDebits{{Key: "k", Debits: []Debit{{Rule: "q", Limit: lim, Amount: 1}}}})
	if err == nil || res.Applied != 0 || len(res.Failed) != 1 {
		t.Errorf("debit without an epoch: %+v, %v; want refused", res, err)
	}
}

// TestSlot: Slot agrees with the server's CLUSTER KEYSLOT.
func TestSlot(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	rc := redis.NewClient(&redis.Options{Addr: c.Addrs()[0]})
	t.Cleanup(func() { rc.Close() })
	for i := range 200 {
		key := Key("q", fmt.Sprint("client-", i, "{x}"))
		want, err := rc.ClusterKeySlot(context.Background(), key).Result()
		if err != nil {
			t.Fatal(err)
		}
		if got := Slot(key); int64(got) != want {
			t.Fatalf("Slot(%q) = %d, want %d", key, got, want)
		}
	}
}
