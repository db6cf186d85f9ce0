package engine

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/settlement"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

const settleRules = `rules:
  - {id: token_bucket, capacity: 10, refill_per_second: 0.000001, settle_within: 1m}
  - {id: gcra, algorithm: gcra, capacity: 10, refill_per_second: 0.000001}
  - {id: sliding_window, algorithm: sliding_window, limit: 10, window: 1h}
  - {id: fixed_window, algorithm: fixed_window, limit: 10, window: 1h}
  - {id: sliding_log, algorithm: sliding_log, limit: 10, window: 1h}
  - {id: leased, capacity: 10, refill_per_second: 0.000001, lease: 5}
  - id: overridden
    capacity: 10
    refill_per_second: 0.000001
    overrides: {vip: {capacity: 100, refill_per_second: 0.000001}}
`

// spendRecorder records the spends given to the other regions.
type spendRecorder struct {
	mu  sync.Mutex
	sum map[string]float64
}

func (r *spendRecorder) AddPaced(rule, key string, cost, _, _ float64, _ int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.sum == nil {
		r.sum = map[string]float64{}
	}
	r.sum[rule+"/"+key] += cost
}

func (r *spendRecorder) of(rule, key string) float64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sum[rule+"/"+key]
}

// settleEngine is an engine over the embedded store with settleRules, on
// a clock the test moves, recording the spends for the other regions.
func settleEngine(t *testing.T, store bucket.Backend) (*Engine, *time.Time, *spendRecorder) {
	t.Helper()
	set, err := rules.Parse("settle.yml", []byte(settleRules))
	if err != nil {
		t.Fatal(err)
	}
	spends := &spendRecorder{}
	e, err := New(Options{Store: store, Region: "local", Logger: quietLogger(), Spends: spends}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	e.now = func() time.Time { return now }
	return e, &now, spends
}

// settleCheck spends cost of rule for key as an estimate, and returns its
// settlement.
func settleCheck(t *testing.T, e *Engine, rule, key string, cost float64) string {
	t.Helper()
	c := e.NewCheck()
	it, err := c.AddRule(rule, key, cost)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Settle(); err != nil {
		t.Fatal(err)
	}
	allowed, err := e.Decide(context.Background(), c)
	if err != nil || !allowed {
		t.Fatalf("check %s %v: allowed %v, %v", rule, cost, allowed, err)
	}
	s := e.Settlement(it)
	if s == "" {
		t.Fatalf("check %s: no settlement", rule)
	}
	return s
}

// leftOf is what a check of rule for key would see left now, to the
// millionth (a token bucket refills a millionth a second).
func leftOf(t *testing.T, e *Engine, store bucket.Usager, rule, key string) float64 {
	t.Helper()
	en := e.table.Load().ByID[rule]
	ds, err := store.Usage(context.Background(), []bucket.Request{{Rule: rule, Key: key, Limit: en.For(key).Limit, Cost: 1}})
	if err != nil {
		t.Fatal(err)
	}
	return math.Round(ds[0].Remaining*1e6) / 1e6
}

// testSettle holds a store to settling: an actual below the estimate gives
// the difference back, one above takes the extra, a replay changes
// nothing and answers as the first, and the other regions receive the
// settled cost.
func testSettle(t *testing.T, store bucket.Backend) {
	e, _, spends := settleEngine(t, store)
	ctx := context.Background()
	for _, rule := range []string{"token_bucket", "gcra", "sliding_window", "fixed_window", "sliding_log", "leased"} {
		t.Run(rule, func(t *testing.T) {
			for _, tc := range []struct {
				name             string
				estimate, actual float64
				left             float64 // after the settle, of 10
			}{
				{"gives back", 6, 2, 8},
				{"takes the extra", 2, 9, 1},
				{"all back", 4, 0, 10},
				{"as estimated", 3, 3, 7},
			} {
				t.Run(tc.name, func(t *testing.T) {
					key := tc.name
					s := settleCheck(t, e, rule, key, tc.estimate)
					if got := leftOf(t, e, store, rule, key); got != 10-tc.estimate {
						t.Fatalf("after the estimate: %v left, want %v", got, 10-tc.estimate)
					}
					r, err := e.Settle(ctx, s, tc.actual)
					if err != nil || !r.Settled || r.Replay || r.Actual != tc.actual {
						t.Fatalf("Settle = %+v, %v; want settled with %v", r, err, tc.actual)
					}
					if got := leftOf(t, e, store, rule, key); got != tc.left {
						t.Fatalf("after the settle: %v left, want %v", got, tc.left)
					}
					// A replay, even with another cost, changes nothing
					// and answers as the first.
					r, err = e.Settle(ctx, s, tc.actual+5)
					if err != nil || !r.Settled || !r.Replay || r.Actual != tc.actual {
						t.Fatalf("replay = %+v, %v; want a replay settled with %v", r, err, tc.actual)
					}
					if got := leftOf(t, e, store, rule, key); got != tc.left {
						t.Fatalf("after the replay: %v left, want %v", got, tc.left)
					}
					if rule == "leased" {
						return // not reconciled: no spends for the other regions
					}
					if got := spends.of(rule, key); got != tc.actual {
						t.Fatalf("the other regions receive %v, want the settled cost %v", got, tc.actual)
					}
				})
			}
		})
	}
}

func TestSettleMemory(t *testing.T) { testSettle(t, bucket.NewMemory()) }

// TestSettleCounted: each Settle counts its result by rule.
func TestSettleCounted(t *testing.T) {
	e, now, _ := settleEngine(t, bucket.NewMemory())
	ctx := context.Background()
	s := settleCheck(t, e, "token_bucket", "k", 2)
	expired := settleCheck(t, e, "token_bucket", "k2", 2)
	for range 2 {
		if _, err := e.Settle(ctx, s, 1); err != nil {
			t.Fatal(err)
		}
	}
	*now = now.Add(2 * time.Minute)
	if _, err := e.Settle(ctx, expired, 1); err != nil {
		t.Fatal(err)
	}
	for result, want := range map[string]float64{"settled": 1, "replay": 1, "expired": 1, "error": 0} {
		if got := testutil.ToFloat64(e.m.Settlements.WithLabelValues("token_bucket", result)); got != want {
			t.Errorf("limiter_settlements_total{result=%q} = %v, want %v", result, got, want)
		}
	}
}

// TestSettleOverride: a key with a limit of its own settles against it.
func TestSettleOverride(t *testing.T) {
	store := bucket.NewMemory()
	e, _, _ := settleEngine(t, store)
	s := settleCheck(t, e, "overridden", "vip", 60)
	if r, err := e.Settle(context.Background(), s, 20); err != nil || !r.Settled {
		t.Fatalf("Settle = %+v, %v", r, err)
	}
	if got := leftOf(t, e, store, "overridden", "vip"); got != 80 {
		t.Fatalf("after the settle: %v left of the key's 100, want 80", got)
	}
}

// TestSettleDebtBounded: an actual far above the capacity takes the
// bucket into debt no deeper than a debit's bound.
func TestSettleDebtBounded(t *testing.T) {
	store := bucket.NewMemory()
	e, _, _ := settleEngine(t, store)
	s := settleCheck(t, e, "token_bucket", "k", 1)
	if _, err := e.Settle(context.Background(), s, 1e12); err != nil {
		t.Fatal(err)
	}
	en := e.table.Load().ByID["token_bucket"]
	ds, err := store.Usage(context.Background(), []bucket.Request{{Rule: "token_bucket", Key: "k", Limit: en.Limit, Cost: 1}})
	if err != nil {
		t.Fatal(err)
	}
	// capacity + rate*DebtHorizon of debt, then one token to pass.
	most := (en.Limit.Capacity + en.Limit.RefillPerSecond*bucket.DebtHorizon.Seconds() + 1) / en.Limit.RefillPerSecond
	if ds[0].Allowed || ds[0].RetryAfter.Seconds() > most*1.001 {
		t.Fatalf("after a huge settle: %+v, want refused for at most %v s", ds[0], most)
	}
}

// TestSettleExpired: after the rule's settle_within the estimate stands.
func TestSettleExpired(t *testing.T) {
	store := bucket.NewMemory()
	e, now, spends := settleEngine(t, store)
	s := settleCheck(t, e, "token_bucket", "k", 6)
	*now = now.Add(time.Minute + time.Millisecond)
	r, err := e.Settle(context.Background(), s, 1)
	if err != nil || r.Settled || !r.Expired {
		t.Fatalf("Settle after settle_within = %+v, %v; want expired", r, err)
	}
	if got := leftOf(t, e, store, "token_bucket", "k"); got != 4 {
		t.Fatalf("after an expired settle: %v left, want 4: the estimate stands", got)
	}
	if got := spends.of("token_bucket", "k"); got != 6 {
		t.Fatalf("the other regions receive %v, want the estimate 6", got)
	}
}

// TestSettleRefused: a forged, altered or foreign settlement, a bad
// actual cost, a rule gone, a check by attributes or a paced one are
// refused naming the field, and change nothing.
func TestSettleRefused(t *testing.T) {
	store := bucket.NewMemory()
	e, _, _ := settleEngine(t, store)
	ctx := context.Background()
	s := settleCheck(t, e, "token_bucket", "k", 6)
	other, _, _ := settleEngine(t, bucket.NewMemory()) // another key: a foreign fleet
	foreign := settleCheck(t, other, "token_bucket", "k", 6)
	alter := func(i int, v string) string {
		parts := strings.Split(s, ".")
		parts[i] = v
		return strings.Join(parts, ".")
	}
	for _, tc := range []struct {
		name, settlement, field string
		actual                  float64
		is                      error
	}{
		{"malformed", "s1.nonsense", "settlement", 1, settlement.ErrMalformed},
		{"empty", "", "settlement", 1, settlement.ErrMalformed},
		{"a raised estimate", alter(3, "10"), "settlement", 1, settlement.ErrForged},
		{"another key", alter(2, "b3RoZXI"), "settlement", 1, settlement.ErrForged},
		{"a later expiry", alter(5, "99999999999999"), "settlement", 1, settlement.ErrForged},
		{"another fleet's", foreign, "settlement", 1, settlement.ErrForged},
		{"too long", "s1." + strings.Repeat("a", settlement.MaxLen), "settlement", 1, settlement.ErrMalformed},
		{"negative cost", s, "actual_cost", -1, bucket.ErrInvalidCost},
		{"NaN cost", s, "actual_cost", math.NaN(), bucket.ErrInvalidCost},
		{"infinite cost", s, "actual_cost", math.Inf(1), bucket.ErrInvalidCost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := e.Settle(ctx, tc.settlement, tc.actual)
			var inv *request.InvalidError
			if !errors.As(err, &inv) || inv.Field != tc.field || !errors.Is(err, tc.is) || r.Settled {
				t.Fatalf("Settle = %+v, %v; want an InvalidError of %s wrapping %v", r, err, tc.field, tc.is)
			}
			if got := leftOf(t, e, store, "token_bucket", "k"); got != 4 {
				t.Fatalf("after a refused settle: %v left, want 4", got)
			}
		})
	}
	t.Run("rule gone", func(t *testing.T) {
		set, err := rules.Parse("gone.yml", []byte("rules:\n  - {id: other, capacity: 1, refill_per_second: 1}\n"))
		if err != nil {
			t.Fatal(err)
		}
		if err := e.SetRules(set); err != nil {
			t.Fatal(err)
		}
		_, err = e.Settle(ctx, s, 1)
		if !errors.Is(err, request.ErrUnknownRule) {
			t.Fatalf("Settle of a rule gone = %v, want ErrUnknownRule", err)
		}
	})
	t.Run("paced", func(t *testing.T) {
		c := e.NewCheck()
		if _, err := c.AddRule("other", "k", 1); err != nil {
			t.Fatal(err)
		}
		c.Request.MaxWait = time.Second
		var inv *request.InvalidError
		if err := c.Settle(); !errors.As(err, &inv) || inv.Field != "settle" {
			t.Fatalf("Settle of a paced check = %v, want an InvalidError of settle", err)
		}
	})
}

// TestSettleNoneForALeaseOrFallback: a check that settles is decided in
// the store, not from a token lease; one the store could not decide has
// no settlement.
func TestSettleNoneForALeaseOrFallback(t *testing.T) {
	fs := newFaultStore()
	e, _, _ := settleEngine(t, fs)
	if e.leases.Len() != 0 {
		t.Fatal("a lease before any check")
	}
	settleCheck(t, e, "leased", "k", 1)
	if e.leases.Len() != 0 {
		t.Fatal("a check that settles took a lease")
	}
	fs.setFail(errors.New("down"))
	c := e.NewCheck()
	it, err := c.AddRule("token_bucket", "k", 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Settle(); err != nil {
		t.Fatal(err)
	}
	if allowed, err := e.Decide(context.Background(), c); err != nil || !allowed {
		t.Fatalf("fallback: %v, %v", allowed, err)
	}
	if s := e.Settlement(it); s != "" {
		t.Fatalf("a fallback decision has the settlement %q", s)
	}
}

// TestSettlePinnedAtHome: a pinned rule's key homed in another region is
// settled there, once: its settlement comes from the home's answer, its
// Settle goes to the home, and a Settle that found the home down settles
// when sent again.
func TestSettlePinnedAtHome(t *testing.T) {
	r := twoRegions(t)
	ctx := context.Background()
	s := settleCheck(t, r.east, "pinned", "u1", 6)
	if got := leftOf(t, r.west, r.wStore, "pinned", "u1"); got != 2 {
		t.Fatalf("at the home after the estimate: %v left, want 2", got)
	}
	if got := leftOf(t, r.east, r.eastStore, "pinned", "u1"); got != 8 {
		t.Fatalf("here after the estimate: %v left, want 8 (untouched)", got)
	}
	r.home.fail.Store(true)
	if _, err := r.east.Settle(ctx, s, 1); !errors.Is(err, ErrNotSettled) {
		t.Fatalf("Settle with the home down = %v, want ErrNotSettled", err)
	}
	r.home.fail.Store(false)
	res, err := r.east.Settle(ctx, s, 1)
	if err != nil || !res.Settled || res.Replay || res.Actual != 1 {
		t.Fatalf("Settle = %+v, %v", res, err)
	}
	if got := leftOf(t, r.west, r.wStore, "pinned", "u1"); got != 7 {
		t.Fatalf("at the home after the settle: %v left, want 7", got)
	}
	if res, err := r.east.Settle(ctx, s, 8); err != nil || !res.Replay || res.Actual != 1 {
		t.Fatalf("replay = %+v, %v; want a replay of 1", res, err)
	}
	if got := leftOf(t, r.west, r.wStore, "pinned", "u1"); got != 7 {
		t.Fatalf("at the home after the replay: %v left, want 7", got)
	}
	if got := leftOf(t, r.east, r.eastStore, "pinned", "u1"); got != 8 {
		t.Fatalf("here after the settle: %v left, want 8 (untouched)", got)
	}
}

// TestSettleHereRefuses: the home refuses a settlement naming no rule, a
// concurrency rule, a bad key, estimate, instant or TTL, each naming the
// field, and changes nothing.
func TestSettleHereRefuses(t *testing.T) {
	r := twoRegions(t)
	ok := bucket.Settlement{Request: bucket.Request{Rule: "pinned", Key: "u1", Cost: 1}, At: 1, Actual: 1, ID: "x", TTL: time.Minute}
	for _, tc := range []struct {
		name, field string
		mutate      func(*bucket.Settlement)
	}{
		{"unknown rule", "rule_id", func(s *bucket.Settlement) { s.Rule = "nope" }},
		{"empty key", "key", func(s *bucket.Settlement) { s.Key = "" }},
		{"no estimate", "estimate", func(s *bucket.Settlement) { s.Cost = 0 }},
		{"no instant", "estimate", func(s *bucket.Settlement) { s.At = 0 }},
		{"ttl too long", "ttl_ms", func(s *bucket.Settlement) { s.TTL = 2 * time.Hour }},
		{"negative actual", "actual_cost", func(s *bucket.Settlement) { s.Actual = -1 }},
		{"no id", "actual_cost", func(s *bucket.Settlement) { s.ID = "" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := ok
			tc.mutate(&s)
			_, err := r.west.SettleHere(context.Background(), s)
			var inv *request.InvalidError
			if !errors.As(err, &inv) || inv.Field != tc.field {
				t.Fatalf("SettleHere = %v, want an InvalidError of %s", err, tc.field)
			}
		})
	}
	if got := leftOf(t, r.west, r.wStore, "pinned", "u1"); got != 8 {
		t.Fatalf("after refused settles: %v left, want 8", got)
	}
}
