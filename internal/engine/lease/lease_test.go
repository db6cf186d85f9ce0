package lease

import "testing"

// TestLeaseCycle: the first check of a key takes the batch, the next waits
// for it, then the lease hands out what the batch left, takes back what a
// refused check gave, and Drain returns what is left.
func TestLeaseCycle(t *testing.T) {
	l := New()
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
