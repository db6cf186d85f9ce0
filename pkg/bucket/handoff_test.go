package bucket

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

var handoffLimits = []Limit{
	{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 2},
	{Algorithm: TokenBucket, Capacity: 7.5, RefillPerSecond: 0.3},
	{Algorithm: GCRA, Capacity: 10, RefillPerSecond: 2},
	{Algorithm: SlidingWindow, Capacity: 10, Window: 3 * time.Second},
	{Algorithm: FixedWindow, Capacity: 10, Window: 3 * time.Second},
	{Algorithm: SlidingLog, Capacity: 10, Window: 3 * time.Second},
}

// TestHandoffAdmitsNoMore: a bucket seeded with what another counted
// (Used, then Debit into a fresh State) admits no more than that bucket
// would have. A token bucket, a GCRA and a fixed window carry over exactly:
// the two make the same decisions from then on; a sliding window and a
// sliding log never count less. Randomized: 200 histories per limit, with
// debts a debit left and paced reservations.
func TestHandoffAdmitsNoMore(t *testing.T) {
	for _, l := range handoffLimits {
		t.Run(fmt.Sprintf("%s/%v", l.Algorithm, l.Capacity), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, uint64(l.Capacity*10)))
			for run := range 200 {
				var old State
				now := t0 + rng.Int64N(10*sec)
				for range rng.IntN(30) {
					now += rng.Int64N(sec / 2)
					switch n := rng.IntN(10); {
					case n == 0:
						l.Debit(&old, now, rng.Float64()*2*l.Capacity)
					case n == 1 && (l.Algorithm == TokenBucket || l.Algorithm == GCRA):
						l.Reserve(&old, now, 1, time.Duration(rng.Int64N(int64(3*time.Second))))
					default:
						l.Take(&old, now, float64(1+rng.IntN(3)))
					}
				}
				used := l.Used(&old, now)
				if used < 0 || used > l.MostUsed() {
					t.Fatalf("run %d: used %v, want 0 to %v", run, used, l.MostUsed())
				}
				var seeded State
				l.Debit(&seeded, now, used)
				most := math.Inf(1)
				switch l.Algorithm {
				case SlidingWindow, FixedWindow:
					most = l.windowMost()
				case SlidingLog:
					most = float64(l.logMost())
				}
				exact := l.Algorithm == TokenBucket || l.Algorithm == GCRA || l.Algorithm == FixedWindow
				// The same requests to both, from the switch on.
				for i := range 40 {
					now += rng.Int64N(sec / 3)
					// A debit stops at the debt bound: beyond it both refuse.
					if got, held := l.Used(&seeded, now), math.Min(l.Used(&old, now), most); got < held-1e-6 {
						t.Fatalf("run %d step %d: seeded counts %v, the old bucket %v", run, i, got, held)
					}
					cost := float64(1 + rng.IntN(2))
					a, b := l.Take(&old, now, cost), l.Take(&seeded, now, cost)
					if exact && a.Allowed != b.Allowed {
						t.Fatalf("run %d step %d: old allowed %v, seeded %v (used %v)", run, i, a.Allowed, b.Allowed, used)
					}
					if b.Allowed && !a.Allowed {
						t.Fatalf("run %d step %d: the seeded bucket admitted what the old one refused", run, i)
					}
					if a.Allowed && !b.Allowed {
						// Keep the two comparable: the old one gives it back.
						old = seeded
						old.log = append([]int64(nil), seeded.log...)
					}
				}
			}
		})
	}
}

// TestHandoffWindow: past its handoff window an old bucket counts nothing.
func TestHandoffWindow(t *testing.T) {
	for _, l := range handoffLimits {
		var st State
		l.Debit(&st, t0, 100*l.Capacity)
		if l.Used(&st, t0) == 0 {
			t.Fatalf("%s: a debited bucket counts nothing", l.Algorithm)
		}
		end := t0 + l.HandoffWindow().Microseconds()
		if u := l.Used(&st, end-1); u == 0 {
			t.Errorf("%s: counts nothing 1µs before the end of its window (%v)", l.Algorithm, l.HandoffWindow())
		}
		if u := l.Used(&st, t0); u > l.MostUsed() {
			t.Errorf("%s: a debt of 100 capacities counts %v, above MostUsed %v", l.Algorithm, u, l.MostUsed())
		}
		if u := l.Used(&st, end); u != 0 {
			t.Errorf("%s: counts %v at the end of its window (%v)", l.Algorithm, u, l.HandoffWindow())
		}
	}
}

// TestMemorySeed: a Memory seeds a bucket once per generation, within the
// seed's TTL, replacing what it held; a later generation seeds it again.
func TestMemorySeed(t *testing.T) {
	c := &fakeClock{}
	c.us.Store(t0)
	m := NewMemory(WithClock(c.now))
	ctx := context.Background()
	l := Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 1}
	take := func(cost float64) Decision {
		t.Helper()
		d, _ := m.Take(ctx, Request{Rule: "r", Key: "k", Limit: l, Cost: cost})
		return d
	}
	take(2) // a stale bucket of an earlier generation: replaced
	s := Seed{Rule: "r", Key: "k", Limit: l, Generation: 3, Used: 6, TTL: time.Minute}
	if ok, _ := m.Seeded(ctx, []Seed{s}); ok[0] {
		t.Fatal("seeded before Seed")
	}
	if ok, _ := m.Seed(ctx, []Seed{s}); !ok[0] {
		t.Fatal("Seed did not seed")
	}
	c.advance(time.Second) // 1 token refilled
	if ok, _ := m.Seeded(ctx, []Seed{s}); !ok[0] {
		t.Fatal("not seeded after Seed")
	}
	if u, _ := m.Used(ctx, []Request{{Rule: "r", Key: "k", Limit: l}}); u[0] != 5 {
		t.Fatalf("used %v a second after a seed of 6", u[0])
	}
	if d := take(5); !d.Allowed || d.Remaining != 0 {
		t.Fatalf("a second after a seed of 6, 5 of 10: %+v", d)
	}
	// A second seed of the same generation (another instance racing)
	// leaves the bucket and its checks alone.
	s2 := s
	s2.Used = 0
	if ok, _ := m.Seed(ctx, []Seed{s2}); ok[0] {
		t.Fatal("seeded twice in one generation")
	}
	if d := take(1); d.Allowed {
		t.Fatalf("a second seed refilled the bucket: %+v", d)
	}
	// An earlier generation is seeded too; a later one is not.
	if ok, _ := m.Seeded(ctx, []Seed{{Rule: "r", Key: "k", Generation: 2}, {Rule: "r", Key: "k", Generation: 4}}); !ok[0] || ok[1] {
		t.Fatalf("seeded at generations 2 and 4: %v", ok)
	}
	// Another origin (a change of the rule's homes) has its own record.
	other := Seed{Rule: "r", Key: "k", Limit: l, Generation: 1, Origin: "homes-1", TTL: time.Minute}
	if ok, _ := m.Seeded(ctx, []Seed{other}); ok[0] {
		t.Fatal("another origin seeded by a topology's seed")
	}
	if ok, _ := m.Seed(ctx, []Seed{other}); !ok[0] {
		t.Fatal("another origin not seeded")
	}
	if ok, _ := m.Seeded(ctx, []Seed{s, other}); !ok[0] || !ok[1] {
		t.Fatalf("seeded: %v, want both", ok)
	}
	// Past the TTL the record is gone.
	c.advance(time.Minute - time.Second)
	if ok, _ := m.Seeded(ctx, []Seed{s}); ok[0] {
		t.Fatal("still seeded past the TTL")
	}
	// Other rules and keys are not seeded.
	if ok, _ := m.Seeded(ctx, []Seed{{Rule: "other", Key: "k", Generation: 1}, {Rule: "r", Key: "j", Generation: 1}}); ok[0] || ok[1] {
		t.Fatalf("other buckets seeded: %v", ok)
	}
}
