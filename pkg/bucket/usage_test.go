package bucket

import (
	"context"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"
)

// usageLimits are one limit of every algorithm, some with rounding that
// matters (rates that do not divide a second, fractional costs).
var usageLimits = []Limit{
	{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 3},
	{Algorithm: TokenBucket, Capacity: 2.5, RefillPerSecond: 0.7},
	{Algorithm: GCRA, Capacity: 5, RefillPerSecond: 7},
	{Algorithm: GCRA, Capacity: 1000, RefillPerSecond: 660_000},
	{Algorithm: SlidingWindow, Capacity: 12, Window: 3 * time.Second},
	{Algorithm: SlidingLog, Capacity: 6, Window: 2 * time.Second},
	{Algorithm: FixedWindow, Capacity: 8, Window: time.Second},
	{Algorithm: FixedWindow, Capacity: 2.5, Window: 10 * time.Millisecond},
}

// TestUsageHeldToTake steps each limit through a random sequence of takes,
// debits and clock jumps (some back), and before each take asks Usage of
// the same cost. Usage changes nothing (the state is the same after it,
// and a second Usage answers the same); the take that follows passes when
// Usage said it would; a refused take answers exactly what Usage did; an
// allowed one leaves what Usage left less the cost.
func TestUsageHeldToTake(t *testing.T) {
	for i, l := range usageLimits {
		t.Run(string(l.Algorithm), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(i), 26))
			var st State
			now := t0
			scale := int64(l.Capacity / math.Max(l.RefillPerSecond, 1e-9) * 1e6)
			if l.Window > 0 {
				scale = l.Window.Microseconds()
			}
			var allowed, refused int
			for step := range 2000 {
				switch rng.IntN(5) {
				case 0:
				case 1:
					now += rng.Int64N(1000)
				case 2:
					now += rng.Int64N(scale/10 + 1)
				case 3:
					now += rng.Int64N(scale + 1)
				case 4:
					now -= rng.Int64N(50) // the store's clock steps back
				}
				if rng.IntN(10) == 0 {
					l.Debit(&st, now, float64(1+rng.IntN(int(math.Ceil(l.Capacity)))))
					continue
				}
				cost := float64(1 + rng.IntN(int(math.Min(l.Capacity, 3))))
				if l.Algorithm != SlidingLog && rng.IntN(3) == 0 {
					cost = math.Round(l.Capacity*rng.Float64()*1000) / 1000
				}
				cost, err := l.NormalizeCost(cost)
				if err != nil {
					cost = 1
				}
				// A check of a class that keeps a reserve, now and then.
				keep := [...]float64{0, 0, 0.2, 0.25}[rng.IntN(4)]
				before := st
				before.log = slices.Clone(st.log)
				u := l.UsageKeeping(&st, now, cost, keep)
				if !reflect.DeepEqual(st, before) {
					t.Fatalf("step %d: Usage changed the state: %+v, was %+v", step, st, before)
				}
				if again := l.UsageKeeping(&st, now, cost, keep); again != u {
					t.Fatalf("step %d: Usage twice: %+v, then %+v", step, u, again)
				}
				d := l.TakeKeeping(&st, now, cost, keep)
				if d.Allowed != u.Allowed {
					t.Fatalf("step %d at %d cost %v: Usage %+v, Take %+v", step, now, cost, u, d)
				}
				if !d.Allowed {
					refused++
					if d != u {
						t.Fatalf("step %d at %d cost %v: refused Take %+v, Usage %+v", step, now, cost, d, u)
					}
					continue
				}
				allowed++
				if u.RetryAfter != 0 {
					t.Fatalf("step %d: Usage allowed with a retry: %+v", step, u)
				}
				// What is left after the spend is what was left before, less
				// the cost: within a quantum of the arithmetic (1 ns of
				// refill, a millionth of a window's token), and one whole
				// request for GCRA, which reports whole requests.
				slack := 1e-6 * math.Max(1, l.Capacity)
				switch l.Algorithm {
				case TokenBucket:
					slack = math.Max(slack, 2*l.RefillPerSecond/1e9)
				case GCRA:
					slack = 1
				}
				want := math.Max(u.Remaining-cost, 0)
				if l.Algorithm == GCRA {
					want = math.Floor(want)
				}
				if math.Abs(d.Remaining-want) > slack {
					t.Fatalf("step %d at %d cost %v: Take left %v, Usage %v less the cost is %v", step, now, cost, d.Remaining, u.Remaining, want)
				}
			}
			if allowed == 0 || refused == 0 {
				t.Fatalf("one outcome only: %d allowed, %d refused", allowed, refused)
			}
		})
	}
}

// TestMemoryUsage holds Memory's Usage to its Take on the same clock, and
// its LeaseUsage to its leases.
func TestMemoryUsage(t *testing.T) {
	ctx := context.Background()
	now := time.UnixMicro(t0)
	m := NewMemory(WithClock(func() time.Time { return now }))
	l := Limit{Algorithm: TokenBucket, Capacity: 3, RefillPerSecond: 1}
	req := Request{Rule: "r", Key: "k", Limit: l, Cost: 1}
	for i := range 5 {
		us, err := m.Usage(ctx, []Request{req})
		if err != nil {
			t.Fatal(err)
		}
		d, _ := m.Take(ctx, req)
		if us[0].Allowed != d.Allowed || (!d.Allowed && us[0] != d) {
			t.Fatalf("check %d: Usage %+v, Take %+v", i, us[0], d)
		}
	}
	if m.Len() != 1 {
		t.Fatalf("%d buckets, want 1", m.Len())
	}
	if _, err := m.Usage(ctx, []Request{{Rule: "r", Key: "other", Limit: l, Cost: 1}}); err != nil || m.Len() != 1 {
		t.Fatalf("Usage of a new key made a bucket: %d buckets, %v", m.Len(), err)
	}

	ll := LeaseLimit{Limit: 2, TTL: time.Second}
	lr := []LeaseRequest{{Rule: "c", Key: "k", Limit: ll}}
	for _, member := range []string{"a", "b"} {
		if ds, _ := m.Acquire(ctx, lr, member); !ds[0].Allowed {
			t.Fatalf("Acquire %s refused", member)
		}
	}
	u, _ := m.LeaseUsage(ctx, lr)
	if u[0].Allowed || u[0].InFlight != 2 || u[0].RetryAfter != time.Second {
		t.Fatalf("LeaseUsage = %+v, want full, 2 in flight, retry 1s", u[0])
	}
	now = now.Add(time.Second)
	u, _ = m.LeaseUsage(ctx, lr)
	if !u[0].Allowed || u[0].InFlight != 0 {
		t.Fatalf("LeaseUsage once expired = %+v, want none in flight", u[0])
	}
}
