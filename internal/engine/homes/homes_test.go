package homes

import (
	"testing"
	"time"
)

// TestRetireWaitsForUsers: a retired state's callback runs once, when its
// last use ends.
func TestRetireWaitsForUsers(t *testing.T) {
	ts := NewState(nil, nil)
	ts.Use()
	ts.Use()
	n := 0
	ts.Retire(func() { n++ })
	ts.Release()
	if n != 0 {
		t.Fatal("retired while in use")
	}
	ts.Release()
	if n != 1 {
		t.Fatalf("retire callback ran %d times after the last use, want 1", n)
	}
}

// TestCurrentUse: a call uses the state in force from its start to its
// end, a newer one put in force meanwhile.
func TestCurrentUse(t *testing.T) {
	var c Current
	a, b := NewState(nil, nil), NewState(nil, nil)
	c.Store(a)
	used := c.Use()
	if used != a {
		t.Fatal("Use did not return the state in force")
	}
	n := 0
	c.Swap(b).Retire(func() { n++ })
	if n != 0 {
		t.Fatal("the replaced state retired while a call used it")
	}
	used.Release()
	if n != 1 || c.Use() != b {
		t.Fatalf("after the call: retired %d times, want 1, and the newer state in force", n)
	}
}

// TestHoldPrevious: a state keeps the one it replaced in use until its
// time has passed or StopHolding.
func TestHoldPrevious(t *testing.T) {
	prev, next := NewState(nil, nil), NewState(nil, nil)
	next.HoldPrevious(prev, time.Hour)
	n := 0
	prev.Retire(func() { n++ })
	if n != 0 {
		t.Fatal("the previous state retired while held")
	}
	next.StopHolding()
	next.StopHolding()
	if n != 1 {
		t.Fatalf("retire callback ran %d times after StopHolding, want 1", n)
	}
}
