package bucket

import (
	"errors"
	"math"
	"testing"
	"time"
)

// t0 is an instant aligned to a whole minute, so window boundaries are known.
const t0 = int64(1_764_460_800_000_000) // 2025-11-30T00:00:00Z in µs

const sec = int64(1_000_000)

type step struct {
	at      int64 // µs after t0
	cost    float64
	allowed bool
	// remaining, retry and reset as expected; retry and reset in µs.
	remaining    float64
	retry, reset int64
}

func runSteps(t *testing.T, l Limit, steps []step) {
	t.Helper()
	if err := l.Validate(); err != nil {
		t.Fatalf("limit: %v", err)
	}
	var st State
	for i, s := range steps {
		d := l.Take(&st, t0+s.at, s.cost)
		want := Decision{Allowed: s.allowed, Remaining: s.remaining, Limit: l.Capacity,
			RetryAfter: micros(s.retry), ResetAfter: micros(s.reset)}
		if d.Allowed != want.Allowed || math.Abs(d.Remaining-want.Remaining) > 1e-9 ||
			d.RetryAfter != want.RetryAfter || d.ResetAfter != want.ResetAfter || d.Limit != want.Limit {
			t.Fatalf("step %d (t=+%dµs cost %v):\n got %+v\nwant %+v", i, s.at, s.cost, d, want)
		}
	}
}

func TestAlgorithms(t *testing.T) {
	tests := []struct {
		name  string
		limit Limit
		steps []step
	}{
		{
			name:  "token bucket burst then refill",
			limit: Limit{Algorithm: TokenBucket, Capacity: 3, RefillPerSecond: 1},
			steps: []step{
				{at: 0, cost: 1, allowed: true, remaining: 2, reset: 1 * sec},
				{at: 0, cost: 1, allowed: true, remaining: 1, reset: 2 * sec},
				{at: 0, cost: 1, allowed: true, remaining: 0, reset: 3 * sec},
				{at: 0, cost: 1, allowed: false, remaining: 0, retry: 1 * sec, reset: 3 * sec},
				{at: sec / 2, cost: 1, allowed: false, remaining: 0.5, retry: sec / 2, reset: 5 * sec / 2},
				{at: sec, cost: 1, allowed: true, remaining: 0, reset: 3 * sec},
				// Fully refilled after an idle period: never above capacity.
				{at: 100 * sec, cost: 2, allowed: true, remaining: 1, reset: 2 * sec},
			},
		},
		{
			name:  "token bucket cost above remaining is refused whole",
			limit: Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 2},
			steps: []step{
				{at: 0, cost: 7, allowed: true, remaining: 3, reset: 7 * sec / 2},
				{at: 0, cost: 4, allowed: false, remaining: 3, retry: sec / 2, reset: 7 * sec / 2},
				{at: 0, cost: 3, allowed: true, remaining: 0, reset: 5 * sec},
			},
		},
		{
			name: "token bucket with a rate that does not divide a second",
			// A token takes 1e9/3 ns, charged 333333333 ns (rounded down):
			// three tokens at once leave 3e-9, never a refusal of the third,
			// and the fourth waits 333333332 ns, rounded up to the µs.
			limit: Limit{Algorithm: TokenBucket, Capacity: 3, RefillPerSecond: 3},
			steps: []step{
				{at: 0, cost: 1, allowed: true, remaining: 3 - 0.333333333*3, reset: 333334},
				{at: 0, cost: 1, allowed: true, remaining: 3 - 0.666666666*3, reset: 666667},
				{at: 0, cost: 1, allowed: true, remaining: 3 - 0.999999999*3, reset: 1000000},
				{at: 0, cost: 1, allowed: false, remaining: 3 - 0.999999999*3, retry: 333334, reset: 1000000},
				{at: 333334, cost: 1, allowed: true, remaining: 3 - 0.999999332*3, reset: 1000000},
			},
		},
		{
			name:  "gcra",
			limit: Limit{Algorithm: GCRA, Capacity: 2, RefillPerSecond: 10},
			steps: []step{
				{at: 0, cost: 1, allowed: true, remaining: 1, reset: sec / 10},
				{at: 0, cost: 1, allowed: true, remaining: 0, reset: 2 * sec / 10},
				{at: 0, cost: 1, allowed: false, remaining: 0, retry: sec / 10, reset: 2 * sec / 10},
				{at: sec / 20, cost: 1, allowed: false, remaining: 0, retry: sec / 20, reset: 3 * sec / 20},
				{at: sec / 10, cost: 1, allowed: true, remaining: 0, reset: 2 * sec / 10},
				{at: 2 * sec, cost: 2, allowed: true, remaining: 0, reset: 2 * sec / 10},
			},
		},
		{
			name:  "sliding window weighs the previous window",
			limit: Limit{Algorithm: SlidingWindow, Capacity: 10, Window: time.Minute},
			steps: []step{
				{at: 0, cost: 4, allowed: true, remaining: 6, reset: 120 * sec},
				{at: 30 * sec, cost: 6, allowed: true, remaining: 0, reset: 90 * sec},
				{at: 30 * sec, cost: 1, allowed: false, remaining: 0, retry: 36 * sec, reset: 90 * sec},
				// Next window, f = 0.5: estimate 10*0.5 = 5.
				{at: 90 * sec, cost: 5, allowed: true, remaining: 0, reset: 90 * sec},
				// estimate 5+5=10; passes when 10*(1-f)+5+1 <= 10: f >= 0.6.
				{at: 90 * sec, cost: 1, allowed: false, remaining: 0, retry: 6 * sec, reset: 90 * sec},
				{at: 96 * sec, cost: 1, allowed: true, remaining: 0, reset: 84 * sec},
				// Two windows later both counters are gone.
				{at: 240 * sec, cost: 10, allowed: true, remaining: 0, reset: 120 * sec},
			},
		},
		{
			name:  "sliding window rejection waits for the next window",
			limit: Limit{Algorithm: SlidingWindow, Capacity: 4, Window: 10 * time.Second},
			steps: []step{
				{at: 0, cost: 4, allowed: true, remaining: 0, reset: 20 * sec},
				// cur 4 + 2 > 4: in the next window 4*(1-g) <= 2 at g = 0.5.
				{at: 1 * sec, cost: 2, allowed: false, remaining: 0, retry: 14 * sec, reset: 19 * sec},
				{at: 15 * sec, cost: 2, allowed: true, remaining: 0, reset: 15 * sec},
			},
		},
		{
			name:  "fixed window resets at the boundary",
			limit: Limit{Algorithm: FixedWindow, Capacity: 3, Window: time.Minute},
			steps: []step{
				{at: 10 * sec, cost: 2, allowed: true, remaining: 1, reset: 50 * sec},
				{at: 20 * sec, cost: 2, allowed: false, remaining: 1, retry: 40 * sec, reset: 40 * sec},
				{at: 20 * sec, cost: 1, allowed: true, remaining: 0, reset: 40 * sec},
				{at: 59 * sec, cost: 1, allowed: false, remaining: 0, retry: 1 * sec, reset: 1 * sec},
				{at: 60 * sec, cost: 3, allowed: true, remaining: 0, reset: 60 * sec},
			},
		},
		{
			name:  "sliding log is exact",
			limit: Limit{Algorithm: SlidingLog, Capacity: 3, Window: 10 * time.Second},
			steps: []step{
				{at: 0, cost: 1, allowed: true, remaining: 2, reset: 10 * sec},
				{at: 2 * sec, cost: 2, allowed: true, remaining: 0, reset: 10 * sec},
				{at: 5 * sec, cost: 1, allowed: false, remaining: 0, retry: 5 * sec, reset: 7 * sec},
				// Cost 2 needs the two entries at +2s to leave.
				{at: 10 * sec, cost: 2, allowed: false, remaining: 1, retry: 2 * sec, reset: 2 * sec},
				{at: 10 * sec, cost: 1, allowed: true, remaining: 0, reset: 10 * sec},
				{at: 12 * sec, cost: 2, allowed: true, remaining: 0, reset: 10 * sec},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { runSteps(t, tt.limit, tt.steps) })
	}
}

// Over T seconds a token bucket admits at most C + r*T, whatever the pattern.
func TestTokenBucketBound(t *testing.T) {
	l := Limit{Algorithm: TokenBucket, Capacity: 50, RefillPerSecond: 7}
	var st State
	admitted := 0.0
	const T = 60 * sec
	for at := int64(0); at <= T; at += 997 {
		if d := l.Take(&st, t0+at, 1); d.Allowed {
			admitted++
		}
	}
	limit := l.Capacity + l.RefillPerSecond*float64(T)/1e6
	if admitted > limit || admitted < limit-1 {
		t.Fatalf("admitted %v over 60s, want within [%v, %v]", admitted, limit-1, limit)
	}
}

func TestNormalizeCost(t *testing.T) {
	tb := Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 1}
	log := Limit{Algorithm: SlidingLog, Capacity: 5, Window: time.Second}
	fast := Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 1e6}
	win := Limit{Algorithm: FixedWindow, Capacity: 10, Window: time.Second}
	tests := []struct {
		name  string
		limit Limit
		cost  float64
		want  float64
		err   error
	}{
		{"zero means one", tb, 0, 1, nil},
		{"fraction", tb, 0.5, 0.5, nil},
		{"capacity", tb, 10, 10, nil},
		{"above capacity", tb, 10.5, 0, ErrInvalidCost},
		{"negative", tb, -1, 0, ErrInvalidCost},
		{"NaN", tb, math.NaN(), 0, ErrInvalidCost},
		{"+Inf", tb, math.Inf(1), 0, ErrInvalidCost},
		{"-Inf", tb, math.Inf(-1), 0, ErrInvalidCost},
		{"log whole", log, 2, 2, nil},
		{"log fraction", log, 1.5, 0, ErrInvalidCost},
		// 1.9 ns of refill at 1e6/s would be charged 1 ns.
		{"below the quantum's 1%", fast, 0.0019, 0, ErrInvalidCost},
		{"100 ns of refill", fast, 0.1, 0.1, nil},
		// 1.4 millionths of a token would count as 1.
		{"window below the quantum's 1%", win, 1.4e-6, 0, ErrInvalidCost},
		{"window at 100 quanta", win, 1e-4, 1e-4, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.limit.NormalizeCost(tt.cost)
			if !errors.Is(err, tt.err) || got != tt.want {
				t.Fatalf("NormalizeCost(%v) = %v, %v; want %v, %v", tt.cost, got, err, tt.want, tt.err)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name  string
		limit Limit
		ok    bool
	}{
		{"token bucket", Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 1}, true},
		{"token bucket no refill", Limit{Algorithm: TokenBucket, Capacity: 10}, false},
		{"token bucket NaN refill", Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: math.NaN()}, false},
		{"token bucket with window", Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 1, Window: time.Second}, false},
		{"gcra", Limit{Algorithm: GCRA, Capacity: 1, RefillPerSecond: 0.5}, true},
		{"zero capacity", Limit{Algorithm: GCRA, RefillPerSecond: 1}, false},
		{"infinite capacity", Limit{Algorithm: FixedWindow, Capacity: math.Inf(1), Window: time.Second}, false},
		{"fixed window", Limit{Algorithm: FixedWindow, Capacity: 100, Window: 24 * time.Hour}, true},
		{"window too short", Limit{Algorithm: SlidingWindow, Capacity: 100, Window: time.Microsecond}, false},
		{"window with refill", Limit{Algorithm: SlidingWindow, Capacity: 100, Window: time.Second, RefillPerSecond: 1}, false},
		{"log", Limit{Algorithm: SlidingLog, Capacity: 20, Window: time.Hour}, true},
		{"log too large", Limit{Algorithm: SlidingLog, Capacity: MaxLogCapacity + 1, Window: time.Hour}, false},
		{"log fractional", Limit{Algorithm: SlidingLog, Capacity: 2.5, Window: time.Hour}, false},
		{"no algorithm", Limit{Capacity: 1, RefillPerSecond: 1}, false},
		{"unknown algorithm", Limit{Algorithm: "leaky", Capacity: 1, RefillPerSecond: 1}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.limit.Validate()
			if (err == nil) != tt.ok {
				t.Fatalf("Validate() = %v, want ok=%v", err, tt.ok)
			}
			if err != nil && !errors.Is(err, ErrInvalidLimit) {
				t.Fatalf("error %v does not wrap ErrInvalidLimit", err)
			}
		})
	}
}

func TestValidateKey(t *testing.T) {
	if err := ValidateKey(""); !errors.Is(err, ErrInvalidKey) {
		t.Fatalf("empty key: %v", err)
	}
	if err := ValidateKey(string(make([]byte, MaxKeyLen+1))); !errors.Is(err, ErrInvalidKey) {
		t.Fatalf("long key: %v", err)
	}
	if err := ValidateKey(string(make([]byte, MaxKeyLen))); err != nil {
		t.Fatalf("key of MaxKeyLen: %v", err)
	}
}

// Debit reports the overshoot: by how much the admissions known here exceed
// the limit after the debit.
func TestDebitOvershoot(t *testing.T) {
	l := Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 1}
	var st State
	for range 6 {
		l.Take(&st, t0, 1)
	}
	if got := l.Debit(&st, t0, 3); got != 0 {
		t.Fatalf("3 remote tokens with 4 left: overshoot %v, want 0", got)
	}
	if got := l.Debit(&st, t0, 5); got != 4 {
		t.Fatalf("5 remote tokens with 1 left: overshoot %v, want 4", got)
	}
	if got := l.Debit(&st, t0, 2); got != 6 {
		t.Fatalf("2 remote tokens with 4 of debt: overshoot %v, want 6", got)
	}
	fw := Limit{Algorithm: FixedWindow, Capacity: 5, Window: time.Minute}
	var w State
	fw.Take(&w, t0, 4)
	if got := fw.Debit(&w, t0, 3); got != 2 {
		t.Fatalf("fixed window 4 of 5 used, 3 remote: overshoot %v, want 2", got)
	}
}

// TestLoweredCapacity: a rule's capacity lowered under an active key. The
// stored instant (full again, or the theoretical arrival time) of the old
// capacity reads as at most the debt bound of the new one (capacity +
// rate*DebtHorizon), the most a debit leaves, so the key waits (cost +
// capacity) / rate + DebtHorizon at most, not the old capacity's refill time.
func TestLoweredCapacity(t *testing.T) {
	tests := []struct {
		name       string
		algorithm  Algorithm
		drain      float64
		afterDrain []step // under the new limit
	}{
		{
			name: "token bucket", algorithm: TokenBucket, drain: 1000,
			afterDrain: []step{
				// Full at t0+1000s reads as t0+31s: 10 + 1*10 tokens of debt.
				{at: sec, cost: 1, allowed: false, remaining: 0, retry: 21 * sec, reset: 30 * sec},
				{at: 22 * sec, cost: 1, allowed: true, remaining: 0, reset: 10 * sec},
				{at: 22 * sec, cost: 1, allowed: false, remaining: 0, retry: sec, reset: 10 * sec},
			},
		},
		{
			name: "gcra", algorithm: GCRA, drain: 1000,
			afterDrain: []step{
				{at: sec, cost: 1, allowed: false, remaining: 0, retry: 21 * sec, reset: 30 * sec},
				{at: 22 * sec, cost: 1, allowed: true, remaining: 0, reset: 10 * sec},
				{at: 22 * sec, cost: 1, allowed: false, remaining: 0, retry: sec, reset: 10 * sec},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			old := Limit{Algorithm: tt.algorithm, Capacity: 1000, RefillPerSecond: 1}
			lowered := Limit{Algorithm: tt.algorithm, Capacity: 10, RefillPerSecond: 1}
			var st State
			if d := old.Take(&st, t0, tt.drain); !d.Allowed || d.Remaining != 0 {
				t.Fatalf("drain: %+v", d)
			}
			for i, s := range tt.afterDrain {
				d := lowered.Take(&st, t0+s.at, s.cost)
				want := Decision{Allowed: s.allowed, Remaining: s.remaining, Limit: lowered.Capacity,
					RetryAfter: micros(s.retry), ResetAfter: micros(s.reset), At: t0 + s.at}
				if d != want {
					t.Fatalf("step %d (t=+%dµs cost %v):\n got %+v\nwant %+v", i, s.at, s.cost, d, want)
				}
			}
		})
	}
}

// TestDebitAfterLoweredCapacity: a debit reads the state as a take does, so
// the overshoot it reports is the new capacity's, not the old one's.
func TestDebitAfterLoweredCapacity(t *testing.T) {
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(string(alg), func(t *testing.T) {
			old := Limit{Algorithm: alg, Capacity: 1000, RefillPerSecond: 1}
			lowered := Limit{Algorithm: alg, Capacity: 10, RefillPerSecond: 1}
			var st State
			old.Take(&st, t0, 1000)
			// 10 + 1*10 tokens of debt at most, so one more token
			// overshoots by 21.
			if got := lowered.Debit(&st, t0+sec, 1); got != 21 {
				t.Fatalf("overshoot %v, want 21", got)
			}
		})
	}
}

// TestWindowsWhenTheClockStepsBack: a window rule's state of a later
// window, read by a clock that stepped back (a failover to a node behind,
// an NTP step), still counts: it is neither read as empty nor rewritten
// under the earlier window.
func TestWindowsWhenTheClockStepsBack(t *testing.T) {
	const w = int64(time.Second / time.Microsecond)
	base := (time.Now().UnixMicro()/w + 10) * w
	for _, alg := range []Algorithm{FixedWindow, SlidingWindow} {
		t.Run(string(alg), func(t *testing.T) {
			l := Limit{Algorithm: alg, Capacity: 2, Window: time.Second}
			var st State
			admitted := 0
			// Window 1 filled, the clock 5 µs back into window 0, then on
			// again in window 1.
			for _, at := range []int64{w + 1, w + 2, w - 4, w - 3, w + 3, w + 4} {
				if l.Take(&st, base+at, 1).Allowed {
					admitted++
				}
			}
			if admitted != 2 {
				t.Fatalf("a %s of 2 admitted %d within 10 µs", alg, admitted)
			}
			if used := l.Used(&st, base+w-4); used != 2 {
				t.Fatalf("Used by the clock stepped back = %v, want 2", used)
			}
		})
	}
}
