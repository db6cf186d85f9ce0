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

// TestDebitRefilled: a spend is debited as of its last admission. One that
// refilled before it arrived writes nothing, not even the client's marker:
// the long tail of clients seen in one region costs the others a read.
// Against the store's clock, on a real cluster, both through one call per
// client and through a batch.
func TestDebitRefilled(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	s, _ := newTestStore(t, Options{Addrs: c.Addrs(), Timeout: time.Second})
	ctx := context.Background()
	tb := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 100, RefillPerSecond: 100.0 / 60}
	fixed := bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 100, Window: time.Second}
	// A window long enough that the instant a case reads now falls in
	// the window of the script's own clock, milliseconds later.
	hour := bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 100, Window: time.Hour}
	sec := int64(time.Second / time.Microsecond)
	const unknown = -1 // the spend's instant is not known: at 0
	tests := []struct {
		name    string
		lim     bucket.Limit
		amount  float64
		ago     int64 // µs before the apply the spend was admitted
		present bool  // a check here wrote the bucket first
		applied bool
	}{
		// 1 token refills in 0.6 s.
		{"absent, refilled", tb, 1, 2 * sec, false, false},
		{"absent, admitted just now", tb, 1, 0, false, true},
		{"absent, not yet refilled", tb, 3, sec, false, true},
		{"absent, unknown instant", tb, 1, unknown, false, true},
		// 20 tokens refill in 12 s: longer than an absent key is known full
		// (10 s), however long ago they were admitted.
		{"absent, beyond what an absent key tells", tb, 20, 30 * sec, false, true},
		{"present, spent here after it", tb, 1, 2 * sec, true, true},
		{"window ended", fixed, 5, 2 * sec, false, false},
		{"window current", hour, 5, 0, false, true},
	}
	for batch := range 2 {
		for i, tt := range tests {
			key := fmt.Sprintf("client-%d-%d", batch, i)
			if batch == 1 {
				key = "{" + key + "}"
			}
			rule := "r-" + string(tt.lim.Algorithm)
			if tt.present {
				if d, err := s.Take(ctx, bucket.Request{Rule: rule, Key: key, Limit: tt.lim, Cost: 1}); err != nil || !d.Allowed {
					t.Fatalf("%s: Take = %+v, %v", tt.name, d, err)
				}
			}
			// The instant is taken as each case runs: one taken once for all
			// would age past a case's margin on a slow machine.
			var at int64
			if tt.ago != unknown {
				at = time.Now().UnixMicro() - tt.ago
			}
			clients := []ClientDebits{{Key: key, Debits: []Debit{{Rule: rule, Limit: tt.lim, Amount: tt.amount, At: at}}}}
			if batch == 1 {
				// A batch: a client in the same slot beside it.
				clients = append(clients, ClientDebits{Key: key + "-other", Debits: []Debit{{Rule: rule, Limit: tt.lim, Amount: 1}}})
			}
			res, err := s.ApplyDebits(ctx, "eu", Position{Epoch: 1, Seq: uint64(10 + i)}, time.Minute, clients)
			if err != nil {
				t.Fatal(err)
			}
			k := clients[0].Key
			exists, err := s.Client().Exists(ctx, Key(rule, k), PartitionMarkerKey(k, "eu", 0)).Result()
			if err != nil {
				t.Fatal(err)
			}
			if tt.applied {
				if res.Applied != len(clients) || res.Refilled != 0 || exists != 2 {
					t.Errorf("batch %d, %s: %+v, %d of the bucket and marker exist; want applied, both written", batch, tt.name, res, exists)
				}
				continue
			}
			if res.Refilled != 1 || res.Applied != len(clients)-1 || exists != 0 {
				t.Errorf("batch %d, %s: %+v, %d of the bucket and marker exist; want refilled, nothing written", batch, tt.name, res, exists)
			}
		}
	}
}
