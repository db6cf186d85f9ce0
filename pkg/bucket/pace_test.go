package bucket

import (
	"context"
	"errors"
	"testing"
	"time"
)

// A paced leaky bucket: one call per 10 ms, no burst beyond one.
var paced = Limit{Algorithm: GCRA, Capacity: 1, RefillPerSecond: 100}

const p0 = int64(1_700_000_000_000_000) // µs

// TestReserveZeroWaitIsTake: with no wait, a reservation is the check of
// today, step by step.
func TestReserveZeroWaitIsTake(t *testing.T) {
	for _, lim := range []Limit{paced, {Algorithm: TokenBucket, Capacity: 2.5, RefillPerSecond: 0.7}} {
		var a, b State
		now := p0
		for i := range 200 {
			now += int64(i%7) * 1300
			cost := []float64{1, 0.5, 1, 0.25}[i%4]
			want := lim.Take(&a, now, cost)
			got := lim.Reserve(&b, now, cost, 0)
			if got != want || a.a != b.a {
				t.Fatalf("step %d: Reserve(0) = %+v, Take = %+v", i, got, want)
			}
		}
	}
}

// TestReserveSpacesSlots: callers at one instant get slots spaced by the
// rate, exactly, up to the wait; beyond it a refusal spends nothing.
func TestReserveSpacesSlots(t *testing.T) {
	var st State
	for i := range 101 {
		d := paced.Reserve(&st, p0, 1, time.Second)
		if !d.Allowed || d.Wait != time.Duration(i)*10*time.Millisecond {
			t.Fatalf("reservation %d: %+v, want allowed with wait %v", i, d, time.Duration(i)*10*time.Millisecond)
		}
		if d.Reservation != p0*1000+int64(i+1)*10_000_000 {
			t.Fatalf("reservation %d: state %d", i, d.Reservation)
		}
	}
	before := st
	d := paced.Reserve(&st, p0, 1, time.Second)
	if d.Allowed || d.RetryAfter != 10*time.Millisecond || d.Wait != 0 {
		t.Fatalf("beyond the wait: %+v, want refused, retry 10ms", d)
	}
	if st.a != before.a {
		t.Fatalf("a refusal beyond the wait spent: state %d, was %d", st.a, before.a)
	}
	// 10 ms later the same request fits within its wait again.
	if d := paced.Reserve(&st, p0+10_000, 1, time.Second); !d.Allowed || d.Wait != time.Second {
		t.Fatalf("after the retry: %+v", d)
	}
}

// TestReserveAllOneInstant: two rules of one request reserve at the later
// of their slots; the rule whose slot is earlier counts the spend then.
func TestReserveAllOneInstant(t *testing.T) {
	m := NewMemory(WithClock(func() time.Time { return time.UnixMicro(p0) }))
	fast := Limit{Algorithm: GCRA, Capacity: 1, RefillPerSecond: 1000} // 1 ms
	ctx := context.Background()
	req := func(rule string, l Limit) Request {
		return Request{Rule: rule, Key: "k", Limit: l, Cost: 1, MaxWait: time.Second}
	}
	for i := range 3 {
		ds, err := m.TakeAll(ctx, []Request{req("slow", paced), req("fast", fast)})
		if err != nil {
			t.Fatal(err)
		}
		want := time.Duration(i) * 10 * time.Millisecond
		if !ds[0].Allowed || !ds[1].Allowed || ds[0].Wait != want || ds[1].Wait != want {
			t.Fatalf("check %d: %+v, want both allowed with wait %v", i, ds, want)
		}
		// The fast rule is full again 1 ms after the shared slot.
		if got := ds[1].Reservation; got != p0*1000+int64(want)+1_000_000 {
			t.Fatalf("check %d: fast rule's state %d, want slot + 1ms", i, got-p0*1000)
		}
	}
}

// TestUnreserve: a reservation with nothing behind it comes back (the next
// caller gets its slot); one with a reservation stacked behind it does not.
func TestUnreserve(t *testing.T) {
	var st State
	first := paced.Reserve(&st, p0, 1, time.Second)
	second := paced.Reserve(&st, p0, 1, time.Second)
	last := paced.Reserve(&st, p0, 1, time.Second)
	if last.Wait != 20*time.Millisecond {
		t.Fatalf("third wait %v", last.Wait)
	}
	if paced.Unreserve(&st, p0+1, second.Reservation, 1) {
		t.Fatal("gave back a reservation with another stacked behind it")
	}
	if !paced.Unreserve(&st, p0+1, last.Reservation, 1) {
		t.Fatal("the last reservation did not come back")
	}
	if next := paced.Reserve(&st, p0+1, 1, time.Second); next.Wait != 20*time.Millisecond-time.Microsecond {
		t.Fatalf("the next caller waits %v, want the given-back slot (20ms - 1µs)", next.Wait)
	}
	_ = first
}

func TestValidateWait(t *testing.T) {
	window := Limit{Algorithm: FixedWindow, Capacity: 1, Window: time.Second}
	for _, tc := range []struct {
		name string
		lim  Limit
		wait time.Duration
		ok   bool
	}{
		{"zero", window, 0, true},
		{"negative", paced, -time.Millisecond, false},
		{"at the most", paced, MaxWait, true},
		{"above the most", paced, MaxWait + time.Millisecond, false},
		{"a window", window, time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.lim.ValidateWait(tc.wait)
			if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrInvalidWait)) {
				t.Fatalf("ValidateWait(%v) = %v", tc.wait, err)
			}
		})
	}
}
