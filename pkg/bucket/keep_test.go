package bucket

import (
	"context"
	"testing"
	"time"
)

// The keeps of reserve {critical: 0.2, default: 0.05} for the classes
// critical, default and sheddable: what each leaves for those above it.
const (
	keepCritical  = 0
	keepDefault   = 0.2
	keepSheddable = 0.25
)

// TestTakeKeeping spends a bucket of 100 by class: sheddable passes while
// more than 25 are left after its spend, default while 20 are, critical
// down to zero; a refusal that critical would have passed is Reserved.
func TestTakeKeeping(t *testing.T) {
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(string(alg), func(t *testing.T) {
			l := Limit{Algorithm: alg, Capacity: 100, RefillPerSecond: 1}
			var st State
			spend := func(keep float64) (n int, last Decision) {
				for {
					d := l.TakeKeeping(&st, t0, 1, keep)
					if !d.Allowed {
						return n, d
					}
					n++
				}
			}
			for _, tc := range []struct {
				name     string
				keep     float64
				admitted int
				reserved bool
			}{
				{"sheddable", keepSheddable, 75, true},
				{"default", keepDefault, 5, true},
				{"sheddable again", keepSheddable, 0, true},
				{"critical", keepCritical, 20, false},
				{"default at zero", keepDefault, 0, false},
			} {
				n, d := spend(tc.keep)
				if n != tc.admitted || d.Reserved != tc.reserved {
					t.Fatalf("%s: admitted %d, refusal %+v; want %d admitted, reserved %v", tc.name, n, d, tc.admitted, tc.reserved)
				}
			}
		})
	}
}

// TestTakeKeepingRetry: a reserved refusal's retry is how long until the
// spend fits above what it keeps.
func TestTakeKeepingRetry(t *testing.T) {
	l := Limit{Algorithm: TokenBucket, Capacity: 100, RefillPerSecond: 10}
	var st State
	if d := l.Take(&st, t0, 80); !d.Allowed {
		t.Fatalf("take 80: %+v", d)
	}
	// 20 left: a sheddable cost of 1 needs 26 left, 6 tokens at 10/s.
	d := l.TakeKeeping(&st, t0, 1, keepSheddable)
	if d.Allowed || !d.Reserved || d.RetryAfter != 600*time.Millisecond || d.Remaining != 20 {
		t.Fatalf("sheddable: %+v, want refused, reserved, retry 600ms, 20 left", d)
	}
	if d := l.TakeKeeping(&st, t0+600_000, 1, keepSheddable); !d.Allowed {
		t.Fatalf("sheddable after its retry: %+v", d)
	}
	// Keep is not read by a window algorithm.
	w := Limit{Algorithm: FixedWindow, Capacity: 2, Window: time.Second}
	var ws State
	for i := range 2 {
		if d := w.TakeKeeping(&ws, t0, 1, keepSheddable); !d.Allowed || d.Reserved {
			t.Fatalf("fixed window take %d: %+v", i, d)
		}
	}
}

// TestFits holds Fits to the admission of a request keeping nothing.
func TestFits(t *testing.T) {
	l := Limit{Algorithm: GCRA, Capacity: 3, RefillPerSecond: 7}
	var st State
	for i := range 50 {
		now := t0 + int64(i)*37_000
		keep := []float64{0, 0.1, 0.5}[i%3]
		d := l.TakeKeeping(&st, now, 1, keep)
		probe := st
		want := l.Take(&probe, now, 1).Allowed
		if d.Allowed {
			continue
		}
		if got := d.Reserved; got != want {
			t.Fatalf("step %d: reserved %v, but a critical take allowed = %v", i, got, want)
		}
	}
}

// TestMemoryKeep: the embedded store keeps Request.Keep in Take and
// TakeAll, all or nothing.
func TestMemoryKeep(t *testing.T) {
	ctx := context.Background()
	now := time.Unix(1_764_460_800, 0)
	m := NewMemory(WithClock(func() time.Time { return now }))
	l := Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 1}
	other := Limit{Algorithm: FixedWindow, Capacity: 100, Window: time.Minute}
	if d, _ := m.Take(ctx, Request{Rule: "a", Key: "k", Limit: l, Cost: 7}); !d.Allowed {
		t.Fatalf("take 7: %+v", d)
	}
	if d, _ := m.Take(ctx, Request{Rule: "a", Key: "k", Limit: l, Cost: 1, Keep: 0.25}); d.Allowed || !d.Reserved {
		t.Fatalf("sheddable with 3 left: %+v, want reserved", d)
	}
	ds, _ := m.TakeAll(ctx, []Request{
		{Rule: "w", Key: "k", Limit: other, Cost: 1},
		{Rule: "a", Key: "k", Limit: l, Cost: 1, Keep: 0.25},
	})
	if ds[0].Allowed != true || ds[1].Allowed || !ds[1].Reserved {
		t.Fatalf("take all: %+v", ds)
	}
	if d, _ := m.Take(ctx, Request{Rule: "w", Key: "k", Limit: other, Cost: 100}); !d.Allowed {
		t.Fatalf("the window spent nothing in a refused take all, got %+v", d)
	}
	ds, _ = m.TakeAll(ctx, []Request{{Rule: "a", Key: "k", Limit: l, Cost: 3}})
	if !ds[0].Allowed {
		t.Fatalf("critical take of the last 3: %+v", ds[0])
	}
}
