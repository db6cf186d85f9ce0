package bucket

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestLeasesSteps(t *testing.T) {
	l := LeaseLimit{Limit: 2, TTL: time.Second}
	var s Leases
	now := int64(1_000_000)
	if d := s.Acquire(now, l, "a"); !d.Allowed || d.InFlight != 1 || d.Expires != time.UnixMicro(now+1_000_000) {
		t.Fatalf("first: %+v", d)
	}
	s.Acquire(now+10, l, "b")
	if d := s.Acquire(now+20, l, "c"); d.Allowed || d.RetryAfter != time.Second-20*time.Microsecond {
		t.Fatalf("over the limit: %+v", d)
	}
	if d := s.Acquire(now+30, l, "a"); !d.Allowed || d.InFlight != 2 {
		t.Fatalf("the same member again renews: %+v", d)
	}
	if !s.Release(now+40, l, "b", nil) || s.Release(now+40, l, "b", nil) {
		t.Fatal("release is not idempotent")
	}
	// a expires at exactly now+30+1s: gone at that instant.
	if d := s.Renew(now+30+1_000_000, l, "a"); d.Allowed {
		t.Fatalf("renew at the expiry: %+v", d)
	}
}

func TestLeaseLimitValidate(t *testing.T) {
	for _, l := range []LeaseLimit{{Limit: 0, TTL: time.Second}, {Limit: MaxConcurrency + 1, TTL: time.Second}, {Limit: 1, TTL: time.Second - 1}, {Limit: 1, TTL: MaxLeaseTTL + time.Millisecond}, {Limit: 1, TTL: 1500 * time.Microsecond}} {
		if err := l.Validate(); err == nil {
			t.Errorf("%+v valid", l)
		}
	}
	for _, l := range []LeaseLimit{{Limit: 1, TTL: MinLeaseTTL}, {Limit: MaxConcurrency, TTL: MaxLeaseTTL}} {
		if err := l.Validate(); err != nil {
			t.Errorf("%+v: %v", l, err)
		}
	}
}

// Memory's Acquire is all or nothing across keys in different shards, and
// a lease's memory is given back when it is released or expires.
func TestMemoryLeases(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	var mu sync.Mutex
	m := NewMemory(WithClock(func() time.Time { mu.Lock(); defer mu.Unlock(); return now }))
	ctx := context.Background()
	l := LeaseLimit{Limit: 1, TTL: 2 * time.Second}
	a := []LeaseRequest{{Rule: "r", Key: "a", Limit: l}}
	ab := []LeaseRequest{{Rule: "r", Key: "a", Limit: l}, {Rule: "r", Key: "b", Limit: l}}
	if d, _ := m.Acquire(ctx, a, "m1"); !d[0].Allowed {
		t.Fatal(d)
	}
	d, _ := m.Acquire(ctx, ab, "m2")
	if d[0].Allowed || !d[1].Allowed {
		t.Fatalf("a full, b free: %+v", d)
	}
	// b was not taken: another member gets it.
	if d, _ := m.Acquire(ctx, []LeaseRequest{ab[1]}, "m3"); !d[0].Allowed {
		t.Fatalf("b held by a refused acquire: %+v", d)
	}
	if r, _ := m.Release(ctx, ab, "m3"); r[0] || !r[1] {
		t.Fatalf("release %v", r)
	}
	mu.Lock()
	now = now.Add(2 * time.Second)
	mu.Unlock()
	if d, _ := m.Renew(ctx, a, "m1"); d[0].Allowed {
		t.Fatalf("renew after expiry: %+v", d)
	}
	if b := m.Bytes(); b != 0 {
		t.Fatalf("%d bytes counted with no lease held", b)
	}
	for i := range 100 {
		_, _ = m.Acquire(ctx, []LeaseRequest{{Rule: "r", Key: fmt.Sprint(i), Limit: l}}, "x")
	}
	if m.Bytes() == 0 {
		t.Fatal("leases not counted")
	}
	mu.Lock()
	now = now.Add(time.Minute)
	mu.Unlock()
	_, _ = m.Take(ctx, Request{Rule: "t", Key: "sweep", Limit: Limit{Algorithm: TokenBucket, Capacity: 1, RefillPerSecond: 1}, Cost: 1})
	for i := range memoryShards {
		sh := &m.shards[i]
		sh.mu.Lock()
		sh.sweep(now.UnixMicro())
		sh.mu.Unlock()
	}
	if n := len(m.shards[0].leases); n != 0 {
		t.Fatalf("%d expired lease sets left after a sweep", n)
	}
}

// TestLeasesNeverPushOutBuckets: leases, which are never evicted, have a
// byte budget of their own at a Memory's cap: a shard full of leases does
// not evict the rate buckets written beside them, and past the budget a
// new lease is refused (ErrLeasesFull) instead.
func TestLeasesNeverPushOutBuckets(t *testing.T) {
	m := NewMemory(WithMaxBytes(MinMaxBytes))
	ctx := context.Background()
	ll := LeaseLimit{Limit: MaxConcurrency, TTL: time.Hour}
	// One lease set of the key's shard, past the shard's part of the cap.
	var full error
	for i := range MaxConcurrency {
		if _, err := m.Acquire(ctx, []LeaseRequest{{Rule: "c", Key: "k", Limit: ll}}, fmt.Sprintf("member-%06d", i)); err != nil {
			full = err
			break
		}
	}
	if !errors.Is(full, ErrLeasesFull) {
		t.Fatalf("leases up to %d in one shard of a %d B Memory: %v, want ErrLeasesFull", MaxConcurrency, MinMaxBytes, full)
	}
	one := Limit{Algorithm: TokenBucket, Capacity: 1, RefillPerSecond: 1e-6}
	reqs := []Request{{Rule: "a", Key: "k", Limit: one, Cost: 1}, {Rule: "b", Key: "k", Limit: one, Cost: 1}}
	admitted := 0
	for range 10 {
		if ds, _ := m.TakeAll(ctx, reqs); ds[0].Allowed && ds[1].Allowed {
			admitted++
		}
	}
	if admitted != 1 {
		t.Fatalf("two rules of capacity 1 beside a shard full of leases admitted %d of 10 checks, want 1", admitted)
	}
}

// TestOneCallKeepsItsOwnWrites: at the cap, a call that writes several
// buckets of one shard never evicts one it has just written.
func TestOneCallKeepsItsOwnWrites(t *testing.T) {
	m := NewMemory(WithMaxBytes(MinMaxBytes))
	ctx := context.Background()
	one := Limit{Algorithm: TokenBucket, Capacity: 1, RefillPerSecond: 1e-6}
	// Ten buckets of one key whose rule ids are long enough that together
	// they pass the shard's part of the cap.
	var reqs []Request
	for i := range 10 {
		reqs = append(reqs, Request{Rule: fmt.Sprintf("%04d-%s", i, strings.Repeat("r", int(m.MaxBytes())/memoryShards/8)), Key: "k", Limit: one, Cost: 1})
	}
	if ds, _ := m.TakeAll(ctx, reqs); !ds[0].Allowed {
		t.Fatal("first call refused")
	}
	for i, r := range reqs {
		if d, _ := m.Take(ctx, r); d.Allowed {
			t.Fatalf("rule %d of capacity 1 admitted again after one call spent it: that call evicted its own write", i)
		}
	}
}
