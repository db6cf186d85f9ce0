package redisstore

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// resetLimits are a limit of every algorithm that refills too slowly to
// matter during a test.
var resetLimits = []bucket.Limit{
	{Algorithm: bucket.TokenBucket, Capacity: 3, RefillPerSecond: 0.001},
	{Algorithm: bucket.GCRA, Capacity: 3, RefillPerSecond: 0.001},
	{Algorithm: bucket.SlidingWindow, Capacity: 3, Window: time.Hour},
	{Algorithm: bucket.SlidingLog, Capacity: 3, Window: time.Hour},
	{Algorithm: bucket.FixedWindow, Capacity: 3, Window: 24 * time.Hour},
}

// TestReset empties a bucket of every algorithm, on a Redis Cluster and
// on the memory store: after a reset the key takes its whole capacity
// again and no more, the other key of the rule and the key under another
// rule keep what they spent, and a reset of a key never used is harmless.
func TestReset(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ctx := context.Background()
	rs, err := New(ctx, Options{Addrs: c.Addrs(), Timeout: time.Second}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rs.Close() })
	for _, store := range []struct {
		name string
		b    bucket.Backend
	}{{"redis", rs}, {"memory", bucket.NewMemory()}} {
		for _, l := range resetLimits {
			t.Run(store.name+"/"+string(l.Algorithm), func(t *testing.T) {
				req := func(rule, key string) bucket.Request {
					return bucket.Request{Rule: rule, Key: key, Limit: l, Cost: 1}
				}
				rule := "reset-" + string(l.Algorithm)
				drain := func(r bucket.Request) {
					t.Helper()
					for range 3 {
						if d, err := store.b.Take(ctx, r); err != nil || !d.Allowed {
							t.Fatalf("Take %s = %+v, %v; want allowed", r.Key, d, err)
						}
					}
					if d, err := store.b.Take(ctx, r); err != nil || d.Allowed {
						t.Fatalf("Take %s past the capacity = %+v, %v; want refused", r.Key, d, err)
					}
				}
				k, other, elsewhere := req(rule, "k"), req(rule, "other"), req(rule+"-b", "k")
				drain(k)
				drain(other)
				drain(elsewhere)
				if err := store.b.Reset(ctx, []bucket.Request{{Rule: rule, Key: "k"}, {Rule: rule, Key: "never"}}); err != nil {
					t.Fatal(err)
				}
				drain(k)
				for _, r := range []bucket.Request{other, elsewhere} {
					if d, err := store.b.Take(ctx, r); err != nil || d.Allowed {
						t.Fatalf("%s/%s after another key's reset: %+v, %v; want refused", r.Rule, r.Key, d, err)
					}
				}
			})
		}
	}
}

// TestDebitReset: a debit flagged as reset puts the bucket back to full
// before it debits its amount, for every algorithm; delivered again
// (the same position) it neither resets again nor debits again, and a
// later plain debit still counts.
func TestDebitReset(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ctx := context.Background()
	s, err := New(ctx, Options{Addrs: c.Addrs(), Timeout: time.Second}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	for _, l := range resetLimits {
		t.Run(string(l.Algorithm), func(t *testing.T) {
			rule, key := "dr-"+string(l.Algorithm), "k-"+string(l.Algorithm) // a marker per key
			debit := func(seq uint64, amount float64, reset bool) DebitResult {
				t.Helper()
				res, err := s.ApplyDebits(ctx, "eu", Position{Epoch: 7, Seq: seq}, time.Minute,
					[]ClientDebits{{Key: key, Debits: []Debit{{Rule: rule, Limit: l, Amount: amount, Reset: reset}}}})
				if err != nil {
					t.Fatal(err)
				}
				return res
			}
			left := func() float64 {
				t.Helper()
				us, err := s.Usage(ctx, []bucket.Request{{Rule: rule, Key: key, Limit: l, Cost: 1}})
				if err != nil {
					t.Fatal(err)
				}
				return us[0].Remaining
			}
			debit(1, 3, false)
			if got := left(); got > 0.01 {
				t.Fatalf("after a debit of the capacity, %v left; want 0", got)
			}
			if res := debit(2, 1, true); res.Applied != 1 {
				t.Fatalf("reset debit: %+v, want applied", res)
			}
			if got := left(); got < 1.99 || got > 2.01 {
				t.Fatalf("after a reset then a debit of 1, %v left; want 2", got)
			}
			if res := debit(2, 1, true); res.Duplicates != 1 {
				t.Fatalf("the reset delivered again: %+v, want a duplicate", res)
			}
			debit(3, 1, false)
			if got := left(); got < 0.99 || got > 1.01 {
				t.Fatalf("after the redelivered reset and a later debit of 1, %v left; want 1", got)
			}
			if res := debit(3, 1, false); res.Duplicates != 1 {
				t.Fatalf("the later debit delivered again: %+v, want a duplicate", res)
			}
			if got := left(); got < 0.99 || got > 1.01 {
				t.Fatalf("after the later debit delivered again, %v left; want 1", got)
			}
		})
	}
}

// TestDebitResetBatched: resets of many clients of one message go in
// batched calls (several clients of a node in one script) and reset each
// client's bucket alone, once.
func TestDebitResetBatched(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ctx := context.Background()
	s, err := New(ctx, Options{Addrs: c.Addrs(), Timeout: time.Second}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	batched := 0
	s.beforeDebitBatch = func() { batched++ }
	lim := bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 1e9, Window: 1000 * time.Hour}
	clients := func(reset bool, amount float64) []ClientDebits {
		var out []ClientDebits
		for i := range 40 {
			out = append(out, ClientDebits{Key: "b" + strconv.Itoa(i), Debits: []Debit{{Rule: "q", Limit: lim, Amount: amount, Reset: reset && i%2 == 0}}})
		}
		return out
	}
	for seq, step := range []struct {
		reset  bool
		amount float64
	}{{false, 5}, {true, 2}, {true, 2}} {
		pos := Position{Epoch: 9, Seq: uint64(min(seq+1, 2))} // the third is the second delivered again
		res, err := s.ApplyDebits(ctx, "eu", pos, time.Minute, clients(step.reset, step.amount))
		if err != nil {
			t.Fatal(err)
		}
		if seq == 2 && res.Duplicates != 40 {
			t.Fatalf("the resets delivered again: %+v, want 40 duplicates", res)
		}
	}
	if batched != 3 {
		t.Fatalf("%d messages sent in batched calls, want 3", batched)
	}
	for i := range 40 {
		us, err := s.Usage(ctx, []bucket.Request{{Rule: "q", Key: "b" + strconv.Itoa(i), Limit: lim, Cost: 1}})
		if err != nil {
			t.Fatal(err)
		}
		used, want := 1e9-us[0].Remaining, 7.0 // 5, then 2
		if i%2 == 0 {
			want = 2 // reset, then 2
		}
		if used != want {
			t.Errorf("client %d counts %v, want %v", i, used, want)
		}
	}
}
