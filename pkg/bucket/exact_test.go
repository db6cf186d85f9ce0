package bucket

import (
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"
)

// burst is how many requests of cost pass at one instant on a fresh state.
func burst(l Limit, cost float64, most int) int {
	var st State
	n := 0
	for n < most && l.Take(&st, t0, cost).Allowed {
		n++
	}
	return n
}

// TestExactBursts: requests whose costs add up to the capacity all pass at
// one instant, and nothing more, for a token bucket and GCRA alike. With
// whole microseconds per spend, TokenBucket{10, 3} refused the second
// Take(5) (4.999999 left), and a capacity of 1000 admitted 1,010 at
// 30,000/s and 1,249 (GCRA 1,250) at 800,000/s.
func TestExactBursts(t *testing.T) {
	tests := []struct {
		capacity, rate, cost float64
		want                 int
	}{
		{10, 3, 5, 2},
		{1000, 30_000, 1, 1000},
		{1000, 800_000, 1, 1000},
		{1000, 1_000_000, 1, 1000},
		{1000, 660_000, 1, 1000},
		{1000, 999_999, 1, 1000},
		{1, 1_000_000, 0.1, 10},
		{1, 800_000, 0.008, 125},
		{3, 7, 0.3, 10},
		{2.5, 0.7, 0.5, 5},
		{1e9, 1e6, 1e6, 1000},
		{1e9, 1e3, 1e7, 100},
		{1e9, 10, 1e8, 10}, // fills in 1e8 s
		{100, 1e-3, 1, 100},
	}
	for _, tt := range tests {
		for _, alg := range []Algorithm{TokenBucket, GCRA} {
			t.Run(fmt.Sprintf("%s %g at %g per s cost %g", alg, tt.capacity, tt.rate, tt.cost), func(t *testing.T) {
				l := Limit{Algorithm: alg, Capacity: tt.capacity, RefillPerSecond: tt.rate}
				if err := l.Validate(); err != nil {
					t.Fatal(err)
				}
				if got := burst(l, tt.cost, tt.want+10); got != tt.want {
					t.Fatalf("%d requests of cost %g pass at one instant, want %d", got, tt.cost, tt.want)
				}
			})
		}
	}
}

// TestTwoHalvesOfTen is the case from the issue, with its remaining.
func TestTwoHalvesOfTen(t *testing.T) {
	l := Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 3}
	var st State
	for i := range 2 {
		if d := l.Take(&st, t0, 5); !d.Allowed || math.Abs(d.Remaining-float64(5-5*i)) > 1e-8 {
			t.Fatalf("Take(5) #%d: %+v, want allowed with %d left", i+1, d, 5-5*i)
		}
	}
	d := l.Take(&st, t0, 5)
	// 5 tokens take 5/3 s to come back.
	if d.Allowed || d.RetryAfter != 1666667*time.Microsecond {
		t.Fatalf("third Take(5): %+v, want refused for 1.666667s", d)
	}
	if d := l.Take(&st, t0+1666667, 5); !d.Allowed {
		t.Fatalf("Take(5) after its RetryAfter: %+v, want allowed", d)
	}
}

// sustained is the cost admitted of perMicro checks of cost every µs over d.
func sustained(l Limit, cost float64, perMicro int, d time.Duration) float64 {
	var st State
	n := 0
	for at := int64(0); at < d.Microseconds(); at++ {
		for range perMicro {
			if l.Take(&st, t0+at, cost).Allowed {
				n++
			}
		}
	}
	return float64(n) * cost
}

// TestSustainedRate: under a check per µs, a bucket that never fills up
// between checks admits its rate, to within 0.1% (each spend is charged
// its exact duration rounded down to the ns: at most 1 ns of refill
// gained per spend). With whole microseconds, 800,000/s sustained
// 1,000,000/s and 660,000/s only 500,000/s.
func TestSustainedRate(t *testing.T) {
	const d = time.Second
	for _, rate := range []float64{800_000, 660_000, 1_000_000, 999_999, 333_333, 30_000, 7} {
		for _, alg := range []Algorithm{TokenBucket, GCRA} {
			t.Run(fmt.Sprintf("%s %g per s", alg, rate), func(t *testing.T) {
				l := Limit{Algorithm: alg, Capacity: 2, RefillPerSecond: rate}
				got := sustained(l, 1, 1, d)
				want := l.Capacity + rate*d.Seconds()
				if math.Abs(got-want) > max(1, want*1e-3) {
					t.Fatalf("admitted %v over %v, want %v (capacity + rate*T) within 0.1%%", got, d, want)
				}
			})
		}
	}
}

// TestSustainedRateCapacityOne: with a capacity of 1 and one check of cost
// 1 per µs, the bucket is full again before the next check whenever the
// rate is below 1e6/s, and a full bucket keeps no more: the exact token
// bucket admits one check every 2 µs (500,000/s) at 800,000/s and at
// 660,000/s alike, and every check at 1e6/s. Whole microseconds gave
// 1,000,000/s at 800,000/s. Smaller costs, several per µs, use the whole
// rate: the capacity at the first µs, then the rate over the 9,999 µs
// after it.
func TestSustainedRateCapacityOne(t *testing.T) {
	const d = 10 * time.Millisecond
	tests := []struct {
		rate, cost float64
		perMicro   int
		want       float64
	}{
		{800_000, 1, 1, 5_000},
		{660_000, 1, 1, 5_000},
		{1_000_000, 1, 1, 10_000},
		{800_000, 0.1, 10, 8_000.2},
		{500_000, 0.25, 4, 5_000.5},
	}
	for _, tt := range tests {
		for _, alg := range []Algorithm{TokenBucket, GCRA} {
			t.Run(fmt.Sprintf("%s %g per s cost %g", alg, tt.rate, tt.cost), func(t *testing.T) {
				l := Limit{Algorithm: alg, Capacity: 1, RefillPerSecond: tt.rate}
				ref := exactAdmitted(l, tt.cost, tt.perMicro, d)
				if math.Abs(ref-tt.want) > 1e-6 {
					t.Fatalf("the exact model admits %v, the test expects %v", ref, tt.want)
				}
				if got := sustained(l, tt.cost, tt.perMicro, d); math.Abs(got-ref) > ref*1e-3 {
					t.Fatalf("admitted %v over %v, the exact token bucket %v", got, d, ref)
				}
			})
		}
	}
}

// exactAdmitted is sustained on the exact model.
func exactAdmitted(l Limit, cost float64, perMicro int, d time.Duration) float64 {
	m := newExactBucket(l)
	n := 0
	for at := int64(0); at < d.Microseconds(); at++ {
		m.advance(at)
		for range perMicro {
			if m.allows(cost) {
				m.spend(cost)
				n++
			}
		}
	}
	return float64(n) * cost
}

// exactBucket is the token bucket of DESIGN.md in exact rationals:
// tokens = min(C, tokens + elapsed*r), admitted when tokens >= cost, and
// debits down to -(C + r*DebtHorizon).
type exactBucket struct {
	capacity, perMicro, floor, tokens *big.Rat
	at                                int64
}

// rat is f as the decimal a rule or a request writes it (0.1, not the
// binary double nearest to it), which is what the arithmetic is exact for.
func rat(f float64) *big.Rat {
	r, ok := new(big.Rat).SetString(strconv.FormatFloat(f, 'g', -1, 64))
	if !ok {
		panic(fmt.Sprintf("rat(%v)", f))
	}
	return r
}

func newExactBucket(l Limit) *exactBucket {
	perMicro := new(big.Rat).Quo(rat(l.RefillPerSecond), big.NewRat(1e6, 1))
	floor := new(big.Rat).Mul(perMicro, big.NewRat(DebtHorizon.Microseconds(), 1))
	floor.Add(floor, rat(l.Capacity)).Neg(floor)
	return &exactBucket{capacity: rat(l.Capacity), perMicro: perMicro, floor: floor, tokens: rat(l.Capacity)}
}

func (b *exactBucket) advance(now int64) {
	if now > b.at {
		refill := new(big.Rat).Mul(b.perMicro, big.NewRat(now-b.at, 1))
		b.tokens.Add(b.tokens, refill)
		if b.tokens.Cmp(b.capacity) > 0 {
			b.tokens.Set(b.capacity)
		}
	}
	b.at = max(b.at, now)
}

func (b *exactBucket) allows(cost float64) bool { return b.tokens.Cmp(rat(cost)) >= 0 }

func (b *exactBucket) spend(cost float64) {
	b.tokens.Sub(b.tokens, rat(cost))
	if b.tokens.Cmp(b.floor) < 0 {
		b.tokens.Set(b.floor)
	}
}

// tokensOf is the exact number of tokens a token bucket's or GCRA's st
// holds at now, clamped as a check reads it.
func tokensOf(l Limit, st State, now int64) *big.Rat {
	l.clampDebt(&st, now)
	debt := max(st.a-now*1000, 0) // ns
	tok := new(big.Rat).Mul(big.NewRat(debt, 1e9), rat(l.RefillPerSecond))
	return tok.Sub(rat(l.Capacity), tok)
}

// TestAgainstExactModel holds the token bucket and GCRA to the exact
// model over random limits (capacity 1 to 1e9, rate 1e-3 to 1e6 per
// second), costs (whole and fractional), steps and debits (small and far
// beyond the debt bound). The model follows the implementation's
// decisions, and at every step their tokens differ by at most what the
// arithmetic promises: never fewer than the model's (a spend is never
// charged more than its exact duration, up to 2^-49 of it), never more
// than 1 ns of refill per spend since the two were last full together. A
// decision may differ from the model's only within that margin.
func TestAgainstExactModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	const limits, steps = 120, 400
	tried := 0
	var differed, atBound int
	for tried < limits {
		capacity := math.Round(math.Pow(10, rng.Float64()*9)*100) / 100
		capacity = max(capacity, 1)
		rate := math.Round(math.Pow(10, -3+rng.Float64()*9)*1000) / 1000
		rate = max(rate, 1e-3)
		alg := []Algorithm{TokenBucket, GCRA}[rng.IntN(2)]
		l := Limit{Algorithm: alg, Capacity: capacity, RefillPerSecond: rate}
		if l.Validate() != nil {
			continue
		}
		tried++
		t.Run(fmt.Sprintf("%s %g at %g per s", alg, capacity, rate), func(t *testing.T) {
			m := newExactBucket(l)
			var st State
			now := int64(0)
			spends := 0 // since the two were last full together
			fill := capacity / rate * 1e6
			var retry time.Duration
			for step := range steps {
				switch rng.IntN(6) {
				case 5:
					// Exactly when the last refusal said: on the edge.
					now += retry.Microseconds()
				case 0:
				case 1:
					now += rng.Int64N(1000)
				case 2:
					now += int64(rng.Float64() * 1e6 / rate * 3)
				case 3:
					now += int64(rng.Float64() * fill)
				case 4:
					now += int64(rng.Float64() * fill * 0.05)
				}
				m.advance(now)
				ours := tokensOf(l, st, t0+now)
				if ours.Cmp(m.capacity) == 0 && m.tokens.Cmp(m.capacity) == 0 {
					spends = 0
				}
				checkMargin(t, l, step, spends, ours, m.tokens)
				cost := pickCost(rng, capacity, rate)
				if rng.IntN(6) == 0 {
					amount := cost * float64(1+rng.IntN(3))
					if rng.IntN(4) == 0 {
						amount = (capacity + rate*DebtHorizon.Seconds()) * (0.5 + 2*rng.Float64())
					}
					l.Debit(&st, t0+now, amount)
					m.spend(amount)
					spends += 2
					continue
				}
				want := m.allows(cost)
				d := l.Take(&st, t0+now, cost)
				if !d.Allowed {
					retry = d.RetryAfter
				}
				if d.Allowed != want {
					differed++
					margin := new(big.Rat).Sub(m.tokens, rat(cost))
					// 1 ns of refill per spend, and the 2^-49 rounding slack.
					if !withinSlack(l, spends, margin) {
						t.Fatalf("step %d at +%dµs cost %v: allowed %v, the exact model %v with %s tokens",
							step, now, cost, d.Allowed, want, m.tokens.FloatString(9))
					}
				}
				if d.Allowed {
					m.spend(cost)
					spends++
				}
				if m.tokens.Cmp(m.floor) == 0 {
					atBound++
				}
			}
		})
	}
	t.Logf("%d limits x %d steps: %d decisions differed from the exact model, each within the margin; %d steps at the debt bound", limits, steps, differed, atBound)
	if atBound == 0 {
		t.Fatal("no step reached the debt bound")
	}
}

// pickCost is a whole or a fractional cost at most capacity, at least 1 ns
// of refill.
func pickCost(rng *rand.Rand, capacity, rate float64) float64 {
	var c float64
	switch rng.IntN(4) {
	case 0:
		c = 1
	case 1:
		c = float64(1 + rng.IntN(10))
	case 2:
		c = float64(1+rng.IntN(999)) / 1000
	default:
		c = math.Round(capacity*rng.Float64()*1000) / 1000
	}
	return min(max(c, 1e-3, rate*1e-9), capacity)
}

// withinSlack reports whether |margin| (tokens) is within what spends
// spends can put between the implementation and the exact model.
func withinSlack(l Limit, spends int, margin *big.Rat) bool {
	slack := rat(float64(spends+2) * l.RefillPerSecond * 1e-9)
	slack.Add(slack, rat(float64(spends+2)*(l.Capacity+l.RefillPerSecond*DebtHorizon.Seconds())*0x1p-48))
	abs := new(big.Rat).Abs(margin)
	return abs.Cmp(slack) <= 0
}

// checkMargin fails when ours (the implementation's tokens) is below the
// model's beyond the rounding slack, or above it by more than 1 ns of
// refill per spend.
func checkMargin(t *testing.T, l Limit, step, spends int, ours, model *big.Rat) {
	t.Helper()
	diff := new(big.Rat).Sub(ours, model)
	if diff.Sign() < 0 && !withinSlack(l, spends, diff) {
		t.Fatalf("step %d: %s tokens, fewer than the exact model's %s", step, ours.FloatString(12), model.FloatString(12))
	}
	if diff.Sign() > 0 && !withinSlack(l, spends, diff) {
		t.Fatalf("step %d: %s tokens, more than the exact model's %s by over 1 ns of refill per spend (%d spends)",
			step, ours.FloatString(12), model.FloatString(12), spends)
	}
}

// TestWindowFractionalCosts: window counts are whole millionths of a
// token, so fractional costs add up without drift. As floats, 30 checks of
// 0.1 against a limit of 3 refused the 30th (the sum passed 3).
func TestWindowFractionalCosts(t *testing.T) {
	tests := []struct {
		limit, cost float64
		want        int
	}{
		{3, 0.1, 30},
		{1, 0.1, 10},
		{0.3, 0.1, 3},
		{10, 0.7, 14},
		{1, 1e-6, 1_000_000},
		{1e9, 0.5, 1000}, // stops at most
		{4.2, 0.3, 14},
	}
	for _, tt := range tests {
		for _, alg := range []Algorithm{FixedWindow, SlidingWindow} {
			t.Run(fmt.Sprintf("%s %g of %g", alg, tt.cost, tt.limit), func(t *testing.T) {
				l := Limit{Algorithm: alg, Capacity: tt.limit, Window: time.Minute}
				most := min(tt.want+10, 1000)
				got := burst(l, tt.cost, most)
				if got != min(tt.want, most) {
					t.Fatalf("%d checks of %g pass against %g, want %d", got, tt.cost, tt.limit, tt.want)
				}
			})
		}
	}
}

// TestDebtBound: a debit keeps up to capacity + rate*DebtHorizon of debt
// (a window up to limit + max(limit, limit*DebtHorizon/window)), so one
// huge or forged spend locks a key out for at most (cost + capacity) /
// rate + DebtHorizon, a window until it stops counting.
func TestDebtBound(t *testing.T) {
	tb := Limit{Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 100}
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(string(alg), func(t *testing.T) {
			l := tb
			l.Algorithm = alg
			var st State
			if over := l.Debit(&st, t0, 1e12); over != 1e12-10 {
				t.Fatalf("overshoot %v, want %v", over, 1e12-10)
			}
			// -(10 + 100*10) tokens: cost 1 waits (1 + 10 + 1000) / 100 s.
			d := l.Take(&st, t0, 1)
			if d.Allowed || d.RetryAfter != 10110*time.Millisecond {
				t.Fatalf("after a huge debit: %+v, want refused for 10.11s", d)
			}
			// A smaller debit is kept whole: 600 tokens of debt wait 6.01 s.
			st = State{}
			l.Debit(&st, t0, 610)
			if d := l.Take(&st, t0, 1); d.RetryAfter != 6010*time.Millisecond {
				t.Fatalf("after a debit of 610: %+v, want refused for 6.01s", d)
			}
		})
	}
	windows := []struct {
		lim  Limit
		most float64
	}{
		{Limit{Algorithm: FixedWindow, Capacity: 10, Window: time.Second}, 110},
		{Limit{Algorithm: SlidingWindow, Capacity: 10, Window: time.Second}, 110},
		{Limit{Algorithm: FixedWindow, Capacity: 10, Window: time.Hour}, 20},
		{Limit{Algorithm: SlidingWindow, Capacity: 10, Window: 100 * time.Second}, 20},
	}
	for _, w := range windows {
		t.Run(fmt.Sprintf("%s of %v", w.lim.Algorithm, w.lim.Window), func(t *testing.T) {
			var st State
			w.lim.Debit(&st, t0, 1e12)
			if st.b != w.most {
				t.Fatalf("count %v after a huge debit, want %v", st.b, w.most)
			}
			st = State{}
			w.lim.Debit(&st, t0, w.most-1)
			if st.b != w.most-1 {
				t.Fatalf("count %v after a debit of %v, want it whole", st.b, w.most-1)
			}
		})
	}
	log := Limit{Algorithm: SlidingLog, Capacity: 5, Window: time.Second}
	var st State
	log.Debit(&st, t0, 1e6)
	if len(st.log) != 55 {
		t.Fatalf("log of %d after a huge debit, want 5 + 5*10 = 55", len(st.log))
	}
}

// TestTokenBucketAndGCRAAgree: the same limit, costs, instants and debits
// give the same admissions, retries and resets under both algorithms, and
// GCRA's remaining is the whole requests of cost 1 that then pass. (Sums of
// ns are exact below 2^53 ns, 104 days: the limits here fill within 1e6 s.)
func TestTokenBucketAndGCRAAgree(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 5))
	for range 200 {
		capacity := max(math.Round(math.Pow(10, rng.Float64()*4)), 1)
		rate := math.Round(math.Pow(10, -3+rng.Float64()*9)*1000) / 1000
		tb := Limit{Algorithm: TokenBucket, Capacity: capacity, RefillPerSecond: max(rate, 1e-3)}
		if tb.Validate() != nil || capacity/tb.RefillPerSecond > 1e6 {
			continue
		}
		gcra := tb
		gcra.Algorithm = GCRA
		var a, b State
		now := t0
		for step := range 200 {
			now += int64(rng.Float64() * rng.Float64() * capacity / tb.RefillPerSecond * 1e6)
			cost := pickCost(rng, capacity, tb.RefillPerSecond)
			if rng.IntN(8) == 0 {
				tb.Debit(&a, now, cost*3)
				gcra.Debit(&b, now, cost*3)
				continue
			}
			x, y := tb.Take(&a, now, cost), gcra.Take(&b, now, cost)
			if x.Allowed != y.Allowed || x.RetryAfter != y.RetryAfter || x.ResetAfter != y.ResetAfter {
				t.Fatalf("%+v step %d cost %v: token bucket %+v, gcra %+v", tb, step, cost, x, y)
			}
			if n := burst1(gcra, b, now); y.Remaining != float64(n) {
				t.Fatalf("%+v step %d: gcra reports %v left, %d requests of cost 1 pass", tb, step, y.Remaining, n)
			}
		}
	}
}

// burst1 is how many requests of cost 1 pass at now on a copy of st.
func burst1(l Limit, st State, now int64) int {
	n := 0
	for n < 2_000_000 && l.Take(&st, now, 1).Allowed {
		n++
	}
	return n
}
