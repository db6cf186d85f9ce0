package bucket

import (
	"context"
	"fmt"
	"hash/maphash"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

type fakeClock struct{ us atomic.Int64 }

func (c *fakeClock) now() time.Time          { return time.UnixMicro(c.us.Load()) }
func (c *fakeClock) advance(d time.Duration) { c.us.Add(d.Microseconds()) }

func TestMemoryConcurrentExact(t *testing.T) {
	m := NewMemory()
	lim := Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 1e-6}
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d, err := m.Take(context.Background(), Request{Rule: "r", Key: "k", Limit: lim, Cost: 1})
			if err != nil {
				t.Error(err)
			}
			if d.Allowed {
				admitted.Add(1)
			}
		}()
	}
	wg.Wait()
	if got := admitted.Load(); got != 10 {
		t.Fatalf("admitted %d of 50, want exactly 10", got)
	}
}

func TestMemoryKeysAndRulesAreSeparate(t *testing.T) {
	c := &fakeClock{}
	c.us.Store(t0)
	m := NewMemory(WithClock(c.now))
	lim := Limit{Algorithm: FixedWindow, Capacity: 1, Window: time.Minute}
	for _, req := range []Request{{Rule: "a", Key: "k"}, {Rule: "b", Key: "k"}, {Rule: "a", Key: "j"}} {
		req.Limit, req.Cost = lim, 1
		if d, _ := m.Take(context.Background(), req); !d.Allowed {
			t.Fatalf("%+v: first request refused", req)
		}
		if d, _ := m.Take(context.Background(), req); d.Allowed {
			t.Fatalf("%+v: second request allowed", req)
		}
	}
}

func TestMemoryExpiresIdleBuckets(t *testing.T) {
	c := &fakeClock{}
	c.us.Store(t0)
	m := NewMemory(WithClock(c.now))
	lim := Limit{Algorithm: TokenBucket, Capacity: 2, RefillPerSecond: 1}
	ctx := context.Background()
	for i := range 100 {
		if d, _ := m.Take(ctx, Request{Rule: "r", Key: fmt.Sprint(i), Limit: lim, Cost: 1}); !d.Allowed {
			t.Fatalf("key %d refused", i)
		}
	}
	if n := m.Len(); n != 100 {
		t.Fatalf("Len = %d, want 100", n)
	}
	// Rejections store nothing.
	if d, _ := m.Take(ctx, Request{Rule: "r", Key: "big", Limit: lim, Cost: 2}); !d.Allowed {
		t.Fatal("cost 2 refused on a full bucket")
	}
	c.advance(memorySweepInterval + time.Second)
	// Touch every shard once, so each one sweeps.
	touched, added := map[uint64]bool{}, 0
	for i := 0; len(touched) < memoryShards; i++ {
		key := fmt.Sprint("x", i)
		if sh := maphash.String(m.seed, key) % memoryShards; !touched[sh] {
			touched[sh] = true
			added++
			_, _ = m.Take(ctx, Request{Rule: "other", Key: key, Limit: lim, Cost: 1})
		}
	}
	if n := m.Len(); n != added {
		t.Fatalf("after the sweep Len = %d, want %d (only the new buckets)", n, added)
	}
}

func BenchmarkLimitTake(b *testing.B) {
	for _, alg := range []Limit{
		{Algorithm: TokenBucket, Capacity: 1e9, RefillPerSecond: 1e6},
		{Algorithm: GCRA, Capacity: 1e9, RefillPerSecond: 1e6},
		{Algorithm: SlidingWindow, Capacity: 1e12, Window: time.Minute},
		{Algorithm: FixedWindow, Capacity: 1e12, Window: time.Minute},
	} {
		b.Run(string(alg.Algorithm), func(b *testing.B) {
			var st State
			now := t0
			b.ReportAllocs()
			for b.Loop() {
				now++
				alg.Take(&st, now, 1)
			}
		})
	}
}

// BenchmarkMemoryTake is one in-memory decision through the Store: the
// embedded default's cost per check.
func BenchmarkMemoryTake(b *testing.B) {
	m := NewMemory()
	ctx := context.Background()
	keys := make([]string, 1024)
	for i := range keys {
		keys[i] = fmt.Sprintf("client-%d", i)
	}
	lim := Limit{Algorithm: TokenBucket, Capacity: 1e9, RefillPerSecond: 1e6}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		_, _ = m.Take(ctx, Request{Rule: "api", Key: keys[i&1023], Limit: lim, Cost: 1})
	}
}

func BenchmarkMemoryTakeParallel(b *testing.B) {
	m := NewMemory()
	keys := make([]string, 1024)
	for i := range keys {
		keys[i] = fmt.Sprintf("client-%d", i)
	}
	lim := Limit{Algorithm: TokenBucket, Capacity: 1e9, RefillPerSecond: 1e6}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		i := 0
		for pb.Next() {
			i++
			_, _ = m.Take(ctx, Request{Rule: "api", Key: keys[i&1023], Limit: lim, Cost: 1})
		}
	})
}

func TestMemoryTakeAllIsAllOrNothing(t *testing.T) {
	c := &fakeClock{}
	c.us.Store(t0)
	m := NewMemory(WithClock(c.now))
	ctx := context.Background()
	small := Limit{Algorithm: TokenBucket, Capacity: 1, RefillPerSecond: 1e-6}
	big := Limit{Algorithm: SlidingLog, Capacity: 10, Window: time.Hour}
	reqs := []Request{{Rule: "small", Key: "k", Limit: small, Cost: 1}, {Rule: "big", Key: "other", Limit: big, Cost: 1}}
	d, _ := m.TakeAll(ctx, reqs)
	if !d[0].Allowed || !d[1].Allowed || d[1].Remaining != 9 {
		t.Fatalf("first: %+v", d)
	}
	d, _ = m.TakeAll(ctx, reqs)
	if d[0].Allowed || !d[1].Allowed {
		t.Fatalf("second: %+v; want small refused, big would allow", d)
	}
	// big spent nothing on the refused check.
	if got, _ := m.Take(ctx, Request{Rule: "big", Key: "other", Limit: big, Cost: 1}); got.Remaining != 8 {
		t.Fatalf("big after a refused multi-check: remaining %v, want 8", got.Remaining)
	}
}

// TestMemoryLoweredCapacity: a key drained under a large capacity is
// refused under the lowered one for (cost + capacity) / rate + DebtHorizon
// at most, by
// Take and by TakeAll alike (TakeAll decides on copies; the clamp is kept).
func TestMemoryLoweredCapacity(t *testing.T) {
	for _, multi := range []bool{false, true} {
		t.Run(map[bool]string{false: "Take", true: "TakeAll"}[multi], func(t *testing.T) {
			c := &fakeClock{}
			c.us.Store(t0)
			m := NewMemory(WithClock(c.now))
			ctx := context.Background()
			old := Request{Rule: "r", Key: "k", Limit: Limit{Algorithm: TokenBucket, Capacity: 1000, RefillPerSecond: 1}, Cost: 1000}
			if d, _ := m.Take(ctx, old); !d.Allowed {
				t.Fatal("drain refused")
			}
			lowered := old
			lowered.Limit.Capacity, lowered.Cost = 10, 1
			other := Request{Rule: "other", Key: "k", Limit: Limit{Algorithm: FixedWindow, Capacity: 1e6, Window: time.Hour}, Cost: 1}
			take := func() Decision {
				if !multi {
					d, _ := m.Take(ctx, lowered)
					return d
				}
				ds, _ := m.TakeAll(ctx, []Request{lowered, other})
				return ds[0]
			}
			c.advance(time.Second)
			if d := take(); d.Allowed || d.RetryAfter != 21*time.Second {
				t.Fatalf("1 s after the change: %+v, want refused for 21 s", d)
			}
			c.advance(21 * time.Second)
			if d := take(); !d.Allowed {
				t.Fatalf("22 s after the change: %+v, want allowed", d)
			}
		})
	}
}

// TestMemoryCap: a flood of distinct keys never takes more than the cap,
// and every bucket dropped is an eviction (nothing expires here). The
// buckets a new one replaces are the ones nearest their expiry:
// long-lived buckets (an hour's log) outlive a flood of short-lived ones
// (a token bucket full again within a second).
func TestMemoryCap(t *testing.T) {
	c := &fakeClock{}
	c.us.Store(t0)
	m := NewMemory(WithClock(c.now), WithMaxBytes(MinMaxBytes))
	if m.MaxBytes() != MinMaxBytes {
		t.Fatalf("MaxBytes() = %d, want %d", m.MaxBytes(), MinMaxBytes)
	}
	long := Limit{Algorithm: SlidingLog, Capacity: 1, Window: time.Hour}
	short := Limit{Algorithm: TokenBucket, Capacity: 1, RefillPerSecond: 1}
	ctx := context.Background()
	const longKeys, shortKeys = 128, 50_000
	for i := range longKeys {
		if d, _ := m.Take(ctx, Request{Rule: "long", Key: fmt.Sprintf("l%d", i), Limit: long, Cost: 1}); !d.Allowed {
			t.Fatalf("long key %d refused", i)
		}
	}
	for i := range shortKeys {
		req := Request{Rule: "short", Key: fmt.Sprintf("s%d", i), Limit: short, Cost: 1}
		var d Decision
		if i%2 == 0 {
			d, _ = m.Take(ctx, req)
		} else {
			ds, _ := m.TakeAll(ctx, []Request{req})
			d = ds[0]
		}
		if !d.Allowed {
			t.Fatalf("short key %d refused", i)
		}
		if n := m.Bytes(); n > m.MaxBytes() {
			t.Fatalf("%d bytes held after %d short keys, cap %d", n, i+1, m.MaxBytes())
		}
	}
	held := m.Len()
	if got, want := m.Evicted(), uint64(longKeys+shortKeys-held); got != want || got == 0 {
		t.Fatalf("Evicted() = %d, want %d (nothing expired: every bucket dropped was evicted)", got, want)
	}
	kept := 0
	for i := range longKeys {
		// A long key still held refuses its second request.
		if d, _ := m.Take(ctx, Request{Rule: "long", Key: fmt.Sprintf("l%d", i), Limit: long, Cost: 1}); !d.Allowed {
			kept++
		}
	}
	t.Logf("%d buckets in %d bytes (cap %d); %d of %d long-lived buckets kept through %d short-lived ones, %d evictions",
		held, m.Bytes(), m.MaxBytes(), kept, longKeys, shortKeys, m.Evicted())
	if kept < longKeys*95/100 {
		t.Fatalf("only %d of %d long-lived buckets kept: eviction does not prefer the buckets nearest their expiry", kept, longKeys)
	}
}

// TestMemoryCountsLogs: a sliding log counts its entries in the memory of
// the cap, so a few keys with long logs cannot take more than many small
// buckets would.
func TestMemoryCountsLogs(t *testing.T) {
	c := &fakeClock{}
	c.us.Store(t0)
	m := NewMemory(WithClock(c.now), WithMaxBytes(MinMaxBytes))
	lim := Limit{Algorithm: SlidingLog, Capacity: MaxLogCapacity, Window: time.Hour}
	ctx := context.Background()
	for i := range MaxLogCapacity {
		c.advance(time.Microsecond)
		if d, _ := m.Take(ctx, Request{Rule: "r", Key: "k", Limit: lim, Cost: 1}); !d.Allowed {
			t.Fatalf("request %d refused", i)
		}
	}
	if n := m.Bytes(); n < 8*MaxLogCapacity {
		t.Fatalf("a log of %d entries counts %d bytes, want at least %d", MaxLogCapacity, n, 8*MaxLogCapacity)
	}
	for k := range 4_000 {
		for i := range 20 {
			c.advance(time.Microsecond)
			_, _ = m.Take(ctx, Request{Rule: "r", Key: fmt.Sprint("k", k), Limit: lim, Cost: 1})
			if n := m.Bytes(); n > m.MaxBytes() {
				t.Fatalf("%d bytes held at key %d request %d, cap %d", n, k, i, m.MaxBytes())
			}
		}
	}
	if m.Evicted() == 0 {
		t.Fatal("4,000 logs of 20 entries fit in 1 MiB without an eviction: the logs are not counted")
	}
}

// TestMemoryTakeAllSweeps: buckets decided through TakeAll (the engine's
// only call) are swept once expired, as Take's are.
func TestMemoryTakeAllSweeps(t *testing.T) {
	c := &fakeClock{}
	c.us.Store(t0)
	m := NewMemory(WithClock(c.now))
	lim := Limit{Algorithm: TokenBucket, Capacity: 1, RefillPerSecond: 1}
	ctx := context.Background()
	take := func(prefix string) {
		for i := range 1000 {
			if ds, _ := m.TakeAll(ctx, []Request{{Rule: "r", Key: fmt.Sprintf("%s%d", prefix, i), Limit: lim, Cost: 1}}); !ds[0].Allowed {
				t.Fatalf("%s%d refused", prefix, i)
			}
		}
	}
	take("a")
	c.advance(memorySweepInterval + time.Second)
	take("b")
	if n := m.Len(); n != 1000 {
		t.Fatalf("%d buckets held, want 1000: the expired ones were not swept", n)
	}
}

// TestMemoryHeapWithinCap: the memory a Memory counts for its cap is the
// memory it takes. Filled far past a 32 MiB cap with token buckets, then
// with sliding logs, the heap it holds stays within 25% of the cap.
func TestMemoryHeapWithinCap(t *testing.T) {
	const maxBytes = 32 << 20
	for _, c := range []struct {
		name string
		lim  Limit
		cost float64
		key  string
	}{
		{"token bucket, 20-byte keys", Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 0.001}, 1, "user:%015d"},
		{"sliding log of 10, 40-byte keys", Limit{Algorithm: SlidingLog, Capacity: 10, Window: time.Hour}, 1, "api-key:%032d"},
		{"gcra, 500-byte keys", Limit{Algorithm: GCRA, Capacity: 10, RefillPerSecond: 0.001}, 1, "%0500d"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			m := NewMemory(WithMaxBytes(maxBytes))
			ctx := context.Background()
			for i := range 400_000 {
				req := Request{Rule: "rule", Key: fmt.Sprintf(c.key, i), Limit: c.lim, Cost: c.cost}
				for range int(min(c.lim.Capacity, 10)) / 5 {
					_, _ = m.TakeAll(ctx, []Request{req})
				}
			}
			runtime.GC()
			runtime.ReadMemStats(&after)
			heap := int64(after.HeapAlloc) - int64(before.HeapAlloc)
			t.Logf("%d buckets, counted %d bytes (cap %d), heap %d bytes (%.0f B a bucket), %d evictions",
				m.Len(), m.Bytes(), m.MaxBytes(), heap, float64(heap)/float64(m.Len()), m.Evicted())
			if m.Evicted() == 0 {
				t.Fatal("the cap was never reached")
			}
			if heap > maxBytes*5/4 {
				t.Fatalf("the store holds %d bytes of heap for a cap of %d", heap, maxBytes)
			}
			runtime.KeepAlive(m)
		})
	}
}

// TestSlidingLogUndoOfASpendGone: an undo of a sliding log's spend that
// has left the window gives nothing back, and never removes the entries
// other requests logged since (undo.lua does the same).
func TestSlidingLogUndoOfASpendGone(t *testing.T) {
	var now atomic.Int64
	m := NewMemory(WithClock(func() time.Time { return time.UnixMicro(now.Load()) }))
	ctx := context.Background()
	lim := Limit{Algorithm: SlidingLog, Capacity: 2, Window: time.Second}
	req := Request{Rule: "r", Key: "k", Limit: lim, Cost: 1}
	take := func(atMs int64) Decision {
		t.Helper()
		now.Store(1_000_000_000 + atMs*1000)
		d, err := m.Take(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	first := take(0)
	if !first.Allowed || first.At == 0 {
		t.Fatalf("first = %+v, want allowed with its instant", first)
	}
	take(1200)
	take(1400) // the log: 1.2 s and 1.4 s; 0 s has left the window
	now.Store(1_000_000_000 + 1500*1000)
	if err := m.Undo(ctx, []Request{req}, time.UnixMicro(first.At)); err != nil {
		t.Fatal(err)
	}
	if d := take(1600); d.Allowed {
		t.Fatal("a sliding log of 2 in 1 s admitted 3 in [0.6 s, 1.6 s]: the undo of a spend gone removed another request's entry")
	}
}
