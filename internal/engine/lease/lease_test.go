package lease

import (
	"fmt"
	"testing"
	"testing/synctest"
)

// TestLeaseCycle: the first check of a key takes the batch, the next waits
// for it, then the lease hands out what the batch left, takes back what a
// refused check gave, and Drain returns what is left.
func TestLeaseCycle(t *testing.T) {
	l := New(0)
	if _, ok, wait, fetch := l.Take("r", "k", 1); ok || wait != nil || !fetch {
		t.Fatalf("first Take: ok %v wait %v fetch %v; want to fetch", ok, wait != nil, fetch)
	}
	_, ok, wait, fetch := l.Take("r", "k", 1)
	if ok || wait == nil || fetch {
		t.Fatalf("Take while fetching: ok %v wait %v fetch %v; want to wait", ok, wait != nil, fetch)
	}
	l.Fetched("r", "k", 4)
	select {
	case <-wait:
	default:
		t.Fatal("Fetched did not wake the waiting check")
	}
	for i := range 4 {
		if left, ok, _, _ := l.Take("r", "k", 1); !ok || left != float64(3-i) {
			t.Fatalf("Take %d: %v, left %v; want allowed with %d left", i, ok, left, 3-i)
		}
	}
	if _, ok, _, fetch := l.Take("r", "k", 1); ok || !fetch {
		t.Fatal("an empty lease handed out a token or did not ask for a batch")
	}
	l.Fetched("r", "k", 2)
	l.GiveBack("r", "k", 1)
	out := l.Drain()
	if len(out) != 1 || out[0].Tokens != 3 || out[0].Rule != "r" || out[0].Key != "k" {
		t.Fatalf("Drain = %+v, want r/k with 3 tokens (2 fetched + 1 given back)", out)
	}
	if out := l.Drain(); len(out) != 0 {
		t.Fatalf("a second Drain = %+v, want nothing", out)
	}
}

// lease takes a batch for (r, key) and leaves tokens in it; it reports
// whether there was room for the lease.
func takeBatch(t *testing.T, l *Leases, key string, tokens float64) bool {
	t.Helper()
	_, ok, wait, fetch := l.Take("r", key, 1)
	switch {
	case !ok && wait == nil && !fetch:
		return false
	case !fetch:
		t.Fatalf("%s: first Take did not fetch (ok %v, wait %v)", key, ok, wait != nil)
	}
	l.Fetched("r", key, tokens)
	return true
}

// TestLeasesSwept: leases past their TTL go at the next sweep (once per
// TTL, by a check of their shard), not at shutdown: 200,000 keys leased
// once leave at most one lease per shard a TTL later.
func TestLeasesSwept(t *testing.T) {
	// In a bubble: its clock moves only as the test moves it, so taking
	// 200,000 leases on a busy machine (longer than a TTL) expires none.
	synctest.Test(t, func(t *testing.T) {
		l := New(1 << 20)
		for i := range 200_000 {
			takeBatch(t, l, fmt.Sprint("k", i), 3)
		}
		if n := l.Len(); n != 200_000 {
			t.Fatalf("%d leases held, want 200000", n)
		}
		l.start = l.start.Add(-2 * TTL) // two TTLs pass
		for i := range 2_000 {          // a few checks in every shard
			takeBatch(t, l, fmt.Sprint("new", i), 3)
		}
		if n := l.Len(); n != 2_000 {
			t.Fatalf("%d leases held after the sweep, want the 2000 new ones", n)
		}
	})
}

// TestLeasesCapped: past its size no key gets a new lease (Take says so,
// and counts it), the keys holding one keep theirs, and room comes back
// once leases expire.
func TestLeasesCapped(t *testing.T) {
	// In a bubble: 10,000 takes on a slow machine can outlast a TTL, and
	// a lease expiring mid-loop would give a later key room.
	synctest.Test(t, func(t *testing.T) {
		l := New(64)
		if l.MaxKeys() != 64 {
			t.Fatalf("MaxKeys() = %d, want 64", l.MaxKeys())
		}
		got := 0
		for i := range 10_000 {
			if takeBatch(t, l, fmt.Sprint("k", i), 3) {
				got++
			}
			if n := l.Len(); n > 64 {
				t.Fatalf("%d leases held after %d keys, cap 64", n, i+1)
			}
		}
		if got > 64 || got == 0 {
			t.Fatalf("%d keys got a lease, want between 1 and 64", got)
		}
		if full := l.Full(); full != uint64(10_000-got) {
			t.Fatalf("Full() = %d, want %d turned away", full, 10_000-got)
		}
		l.start = l.start.Add(-2 * TTL)
		if !takeBatch(t, l, "after", 3) {
			t.Fatal("no lease after every other one expired")
		}
	})
}
