package bucket

import (
	"context"
	"testing"
	"time"
)

// TestMemorySettleRecords: a settlement's record names it within its key,
// answers a replay while it lasts, and is forgotten (swept) after its TTL.
func TestMemorySettleRecords(t *testing.T) {
	now := time.Now()
	m := NewMemory(WithClock(func() time.Time { return now }))
	ctx := context.Background()
	lim := Limit{Algorithm: FixedWindow, Capacity: 10, Window: time.Hour}
	settle := func(key string, actual float64) Settled {
		t.Helper()
		r, err := m.Settle(ctx, Settlement{Request: Request{Rule: "r", Key: key, Limit: lim, Cost: 2}, At: now.UnixMicro(), Actual: actual, ID: "one", TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	if r := settle("a", 5); r.Replay || r.Actual != 5 {
		t.Fatalf("first = %+v", r)
	}
	if r := settle("b", 3); r.Replay || r.Actual != 3 {
		t.Fatalf("the same id under another key = %+v, want its own first settle", r)
	}
	if r := settle("a", 1); !r.Replay || r.Actual != 5 {
		t.Fatalf("replay = %+v, want a replay of 5", r)
	}
	now = now.Add(time.Minute + memorySweepInterval)
	if _, err := m.Take(ctx, Request{Rule: "r", Key: "a", Limit: lim, Cost: 1}); err != nil { // sweeps the shard
		t.Fatal(err)
	}
	sh := m.shard("a")
	sh.mu.Lock()
	_, kept := sh.settled[settleID{"a", "one"}]
	sh.mu.Unlock()
	if kept {
		t.Fatal("a record kept past its TTL and a sweep")
	}
	if _, err := m.Settle(ctx, Settlement{Request: Request{Rule: "r", Key: "a", Limit: lim, Cost: 1}, Actual: -1, ID: "x", TTL: time.Minute}); err == nil {
		t.Fatal("a negative actual cost settled")
	}
}
