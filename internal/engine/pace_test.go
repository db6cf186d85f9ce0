package engine

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

const paceRules = `
rules:
  - id: pace
    algorithm: gcra
    capacity: 1
    refill_per_second: 1
  - id: pace-leased
    capacity: 20
    refill_per_second: 1
    lease: 5
  - id: window
    algorithm: fixed_window
    limit: 5
    window: 1s
  - id: by-user
    capacity: 1
    refill_per_second: 1
    match: {path: /two}
    key_by: user
  - id: by-key
    capacity: 1
    refill_per_second: 1
    match: {path: /two}
    key_by: api_key
  - id: pinned
    capacity: 1
    refill_per_second: 1
    home: pinned
    home_keys: {far: eu-west}
`

func paceEngine(t *testing.T) (*Engine, *faultStore, *prometheus.Registry) {
	t.Helper()
	set, err := rules.Parse("pace.yml", []byte(paceRules))
	if err != nil {
		t.Fatal(err)
	}
	store, reg := newFaultStore(), prometheus.NewRegistry()
	e, err := New(Options{Store: store, Logger: quietLogger()}, set, reg)
	if err != nil {
		t.Fatal(err)
	}
	return e, store, reg
}

// pacedCheck checks rule and key, paced by maxWait (0: not paced).
func pacedCheck(t *testing.T, e *Engine, rule, key string, maxWait time.Duration) (bool, *request.Item) {
	t.Helper()
	c := e.NewCheck()
	it, err := c.AddRule(rule, key, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Pace(maxWait); err != nil {
		t.Fatal(err)
	}
	ok, err := e.Decide(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	return ok, it
}

// TestPacedCheck: a paced check of a full bucket reserves the next slot;
// one beyond its wait is refused and spends nothing; the deny cache, which
// remembers an unpaced refusal, never refuses a paced check that fits.
func TestPacedCheck(t *testing.T) {
	e, _, _ := paceEngine(t)
	if ok, it := pacedCheck(t, e, "pace", "k", 0); !ok || it.Decision.Wait != 0 {
		t.Fatalf("first check: %v %+v", ok, it.Decision)
	}
	// Unpaced: refused, and the denial (about 1 s) is remembered.
	if ok, _ := pacedCheck(t, e, "pace", "k", 0); ok {
		t.Fatal("second unpaced check allowed")
	}
	if e.deny.Len() != 1 {
		t.Fatalf("deny cache holds %d, want the refusal", e.deny.Len())
	}
	// Paced within 2 s: the slot 1 s after the first.
	ok, it := pacedCheck(t, e, "pace", "k", 2*time.Second)
	if !ok || it.Decision.Wait <= 900*time.Millisecond || it.Decision.Wait > time.Second {
		t.Fatalf("paced check: %v %+v, want allowed with a wait of about 1s", ok, it.Decision)
	}
	// The next slot is 2 s out: beyond 1.5 s, refused, nothing spent.
	ok, it = pacedCheck(t, e, "pace", "k", 1500*time.Millisecond)
	if ok || it.Decision.RetryAfter <= 400*time.Millisecond || it.Decision.RetryAfter > 500*time.Millisecond {
		t.Fatalf("beyond the wait: %v %+v, want refused with a retry of about 0.5s", ok, it.Decision)
	}
	if ok, it = pacedCheck(t, e, "pace", "k", 2500*time.Millisecond); !ok || it.Decision.Wait <= 1900*time.Millisecond || it.Decision.Wait > 2*time.Second {
		t.Fatalf("after a refusal beyond the wait: %v %+v, want the slot 2s after the first", ok, it.Decision)
	}
	m := e.m.Paced
	if a, l := testutil.ToFloat64(m.WithLabelValues("pace", "allowed")), testutil.ToFloat64(m.WithLabelValues("pace", "limited")); a != 2 || l != 1 {
		t.Fatalf("limiter_paced_checks_total: allowed %v limited %v, want 2 and 1", a, l)
	}
	if n := testutil.CollectAndCount(e.m.PacedWait, "limiter_paced_wait_seconds"); n != 1 {
		t.Fatalf("limiter_paced_wait_seconds has %d series, want the rule's", n)
	}
}

// TestPacedMaxWaitZeroIsUnpaced: Pace(0) leaves a check exactly as it was.
func TestPacedMaxWaitZeroIsUnpaced(t *testing.T) {
	a, _, _ := paceEngine(t)
	b, _, _ := paceEngine(t)
	for i := range 3 {
		okA, itA := pacedCheck(t, a, "pace-leased", "k", 0)
		c := b.NewCheck()
		itB, err := c.AddRule("pace-leased", "k", 1)
		if err != nil {
			t.Fatal(err)
		}
		okB, err := b.Decide(context.Background(), c)
		if err != nil || okA != okB || itA.Route != itB.Route || itA.Decision.Allowed != itB.Decision.Allowed {
			t.Fatalf("check %d: paced(0) %v %v, unpaced %v %v", i, okA, itA.Route, okB, itB.Route)
		}
	}
}

// TestPacedLeaseRuleGoesToTheStore: a paced check of a lease rule never
// reserves from a lease; it is decided in the store.
func TestPacedLeaseRuleGoesToTheStore(t *testing.T) {
	e, store, _ := paceEngine(t)
	before := store.calls.Load()
	for range 3 {
		ok, it := pacedCheck(t, e, "pace-leased", "k", time.Second)
		if !ok || it.Route != request.RouteStore || it.Batch != 0 {
			t.Fatalf("paced lease rule: %v route %v batch %v", ok, it.Route, it.Batch)
		}
	}
	if n := store.calls.Load() - before; n != 3 {
		t.Fatalf("%d store calls for 3 paced checks", n)
	}
	if e.leases.Len() != 0 {
		t.Fatalf("a paced check took a lease")
	}
}

// TestPaceInvalid: a wait out of bounds, on a rule that cannot reserve, or
// over several keys is refused, naming max_wait_ms.
func TestPaceInvalid(t *testing.T) {
	e, _, _ := paceEngine(t)
	for _, tc := range []struct {
		name    string
		add     func(c *request.Check) error
		maxWait time.Duration
	}{
		{"negative", func(c *request.Check) error { _, err := c.AddRule("pace", "k", 1); return err }, -time.Millisecond},
		{"above the most", func(c *request.Check) error { _, err := c.AddRule("pace", "k", 1); return err }, bucket.MaxWait + time.Millisecond},
		{"a window rule", func(c *request.Check) error { _, err := c.AddRule("window", "k", 1); return err }, time.Second},
		{"several keys", func(c *request.Check) error {
			_, _, err := c.AddAttributes(&rules.Attributes{Path: "/two", User: "u", APIKey: "a"}, 1)
			return err
		}, time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := e.NewCheck()
			if err := tc.add(c); err != nil {
				t.Fatal(err)
			}
			err := c.Pace(tc.maxWait)
			var inv *request.InvalidError
			if !errors.As(err, &inv) || inv.Field != "max_wait_ms" || !errors.Is(err, bucket.ErrInvalidWait) {
				t.Fatalf("Pace(%v) = %v, want an InvalidError of max_wait_ms", tc.maxWait, err)
			}
		})
	}
}

// TestCancelReservation: the latest reservation comes back (the next
// caller gets its slot); one with a reservation stacked behind it does not.
func TestCancelReservation(t *testing.T) {
	e, _, _ := paceEngine(t)
	pacedCheck(t, e, "pace", "k", 0)
	_, first := pacedCheck(t, e, "pace", "k", 5*time.Second)  // slot +1 s
	_, second := pacedCheck(t, e, "pace", "k", 5*time.Second) // slot +2 s
	r1, r2 := e.Reservation(first), e.Reservation(second)
	if r1 == "" || r2 == "" {
		t.Fatal("no reservation named")
	}
	ctx := context.Background()
	if back, err := e.CancelReservation(ctx, r1); err != nil || back {
		t.Fatalf("stacked reservation: given back %v, %v; want false", back, err)
	}
	if back, err := e.CancelReservation(ctx, r2); err != nil || !back {
		t.Fatalf("latest reservation: given back %v, %v; want true", back, err)
	}
	if back, _ := e.CancelReservation(ctx, r2); back {
		t.Fatal("a reservation came back twice")
	}
	if _, next := pacedCheck(t, e, "pace", "k", 5*time.Second); next.Decision.Wait > 2*time.Second {
		t.Fatalf("next caller waits %v, want the slot given back (2s out, not 3s)", next.Decision.Wait)
	}
	var inv *request.InvalidError
	if _, err := e.CancelReservation(ctx, "r1.nonsense"); !errors.As(err, &inv) || inv.Field != "reservation" {
		t.Fatalf("malformed reservation: %v", err)
	}
}

// TestPacedPinnedRule: a paced check of a rule pinned to another region is
// forwarded with its wait; the home reserves, and its wait is answered.
func TestPacedPinnedRule(t *testing.T) {
	r := twoRegionsWith(t, paceRules, newFaultStore())
	west, east := r.west, r.east
	pacedCheck(t, east, "pinned", "far", 0)
	ok, it := pacedCheck(t, east, "pinned", "far", 2*time.Second)
	if !ok || it.Route != request.RouteHome || it.Decision.Wait <= 900*time.Millisecond || it.Decision.Wait > time.Second {
		t.Fatalf("paced pinned check: %v route %v %+v, want the home's slot about 1s out", ok, it.Route, it.Decision)
	}
	if east.Reservation(it) != "" {
		t.Fatal("a reservation of another region's store is named")
	}
	// The home holds the reservation: its own next slot is 2 s out.
	if ok, it := pacedCheck(t, west, "pinned", "far", 1500*time.Millisecond); ok {
		t.Fatalf("the home's next slot within 1.5s: %+v", it.Decision)
	}
}

// TestPacedFallback: with the store down, a fail-open rule paces from this
// instance's share (rate / fleet size) within the same wait; a paced check
// whose store reply did not come is decided there too, never allowed at
// once.
func TestPacedFallback(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"store down", errors.New("connection refused")},
		{"outcome unknown", bucket.ErrOutcomeUnknown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, store, _ := paceEngine(t)
			store.setFail(tc.err)
			ok, it := pacedCheck(t, e, "pace", "k", 0)
			if errors.Is(tc.err, bucket.ErrOutcomeUnknown) {
				if !ok || it.Route != request.RouteUnknown {
					t.Fatalf("unpaced, outcome unknown: %v route %v, want allowed uncertain", ok, it.Route)
				}
			}
			// Paced: the fallback's first slot is now, its second 1 s out.
			if ok, it = pacedCheck(t, e, "pace", "p", 2*time.Second); !ok || it.Route != request.RouteFallback || it.Decision.Wait != 0 {
				t.Fatalf("first paced check: %v route %v %+v", ok, it.Route, it.Decision)
			}
			if ok, it = pacedCheck(t, e, "pace", "p", 2*time.Second); !ok || it.Route != request.RouteFallback || it.Decision.Wait <= 900*time.Millisecond {
				t.Fatalf("second paced check: %v route %v %+v, want the fallback's next slot", ok, it.Route, it.Decision)
			}
			if e.Reservation(it) != "" {
				t.Fatal("a fallback reservation is named for CancelReservation")
			}
		})
	}
}

// TestPacedForwardOutcomeUnknown: a paced check forwarded to a home that
// reserves a slot and then answers after the forward's deadline is not
// allowed at once (the home's slot may be up to max_wait out): it is paced
// here with this region's share, as if the home were unreachable, so a
// run of such checks leaves at most at that share's rate.
func TestPacedForwardOutcomeUnknown(t *testing.T) {
	r := twoRegionsWith(t, `rules:
  - id: pinned
    algorithm: gcra
    capacity: 2
    refill_per_second: 2
    home: pinned
    home_keys: {far: eu-west}
`, newFaultStore(), func(o *Options) { o.ForwardTimeout = 20 * time.Millisecond })
	west, east, home := r.west, r.east, r.home
	// The home's burst is spent: its next slot is 500 ms out.
	for range 2 {
		if ok, _ := pacedCheck(t, west, "pinned", "far", 0); !ok {
			t.Fatal("home refused its burst")
		}
	}
	home.slow.Store(true)
	// This region's share is capacity 1 at 1/s: its first slot is now,
	// the next ones 1 s apart.
	start := time.Now()
	for i := range 3 {
		ok, it := pacedCheck(t, east, "pinned", "far", 5*time.Second)
		if !ok {
			t.Fatalf("check %d refused: %+v", i, it.Decision)
		}
		if it.Route == request.RouteUnknown {
			t.Fatalf("check %d allowed with route unknown and wait %v: the home may have reserved a later slot", i, it.Decision.Wait)
		}
		// Each slot counts from the first check; the forwards' timeouts
		// since then came off the wait.
		if min := time.Duration(i)*time.Second - time.Since(start) - 10*time.Millisecond; it.Decision.Wait < min {
			t.Fatalf("check %d waits %v, want at least %v (paced with this region's share)", i, it.Decision.Wait, min)
		}
	}
}

// TestReservationIsBoundAndSingleUse: a reservation names what it spent
// and nothing else: a cost written into it is refused as invalid (it
// would give back more than was spent); a cancel gives back at most once,
// and a stale one after another caller's reservation of the same cost
// (which leaves the bucket in the same state) gives nothing back.
func TestReservationIsBoundAndSingleUse(t *testing.T) {
	ctx := context.Background()
	t.Run("forged cost", func(t *testing.T) {
		set, err := rules.Parse("pace.yml", []byte("rules:\n  - {id: pace, algorithm: gcra, capacity: 5, refill_per_second: 1}\n"))
		if err != nil {
			t.Fatal(err)
		}
		e, err := New(Options{Store: newFaultStore(), Logger: quietLogger()}, set, prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		for range 5 {
			pacedCheck(t, e, "pace", "k", 0)
		}
		pacedCheck(t, e, "pace", "k", 5*time.Second)          // slot +1 s
		pacedCheck(t, e, "pace", "k", 5*time.Second)          // slot +2 s
		_, it := pacedCheck(t, e, "pace", "k", 5*time.Second) // slot +3 s
		r := e.Reservation(it)
		parts := strings.Split(r, ".")
		parts[3] = "5" // the capacity, not the 1 spent
		back, err := e.CancelReservation(ctx, strings.Join(parts, "."))
		var inv *request.InvalidError
		if !errors.As(err, &inv) || inv.Field != "reservation" {
			t.Fatalf("forged cost: given back %v, %v; want an InvalidError naming reservation", back, err)
		}
		if _, next := pacedCheck(t, e, "pace", "k", 5*time.Second); next.Decision.Wait < 3*time.Second {
			t.Fatalf("after a forged cancel the next slot is %v out, want 4s: nothing given back", next.Decision.Wait)
		}
	})
	t.Run("stale cancel", func(t *testing.T) {
		e, _, _ := paceEngine(t)
		pacedCheck(t, e, "pace", "k", 0)
		_, a := pacedCheck(t, e, "pace", "k", 5*time.Second) // slot +1 s
		ra := e.Reservation(a)
		if back, err := e.CancelReservation(ctx, ra); err != nil || !back {
			t.Fatalf("first cancel: %v, %v; want given back", back, err)
		}
		_, b := pacedCheck(t, e, "pace", "k", 5*time.Second) // the same slot
		rb := e.Reservation(b)
		if rb == ra {
			t.Errorf("two reservations share the token %q", ra)
		}
		if back, err := e.CancelReservation(ctx, ra); back {
			t.Fatalf("a stale cancel gave back another caller's slot (err %v)", err)
		}
		if _, next := pacedCheck(t, e, "pace", "k", 5*time.Second); next.Decision.Wait < 1500*time.Millisecond {
			t.Fatalf("after a stale cancel the next slot is %v out, want 2s", next.Decision.Wait)
		}
	})
	t.Run("another key", func(t *testing.T) {
		set, err := rules.Parse("pace.yml", []byte(paceRules))
		if err != nil {
			t.Fatal(err)
		}
		store := newFaultStore()
		engine := func(secret string) *Engine {
			e, err := New(Options{Store: store, ReservationSecret: []byte(secret), Logger: quietLogger()}, set, prometheus.NewRegistry())
			if err != nil {
				t.Fatal(err)
			}
			return e
		}
		a, own, fleet := engine("fleet secret, 16+"), engine(""), engine("fleet secret, 16+")
		pacedCheck(t, a, "pace", "k", 0)
		_, it := pacedCheck(t, a, "pace", "k", 5*time.Second)
		r := a.Reservation(it)
		var inv *request.InvalidError
		if back, err := own.CancelReservation(ctx, r); !errors.As(err, &inv) || inv.Field != "reservation" {
			t.Fatalf("another key's reservation: %v, %v; want an InvalidError naming reservation", back, err)
		}
		if back, err := fleet.CancelReservation(ctx, r); err != nil || !back {
			t.Fatalf("the fleet's reservation, given back by another process: %v, %v; want true", back, err)
		}
	})
	t.Run("at most once", func(t *testing.T) {
		e, _, _ := paceEngine(t)
		pacedCheck(t, e, "pace", "k", 0)
		_, a := pacedCheck(t, e, "pace", "k", 5*time.Second)
		ra := e.Reservation(a)
		given := 0
		for range 5 {
			if back, _ := e.CancelReservation(ctx, ra); back {
				given++
			}
			pacedCheck(t, e, "pace", "k", 5*time.Second) // another caller takes the slot
		}
		if given != 1 {
			t.Fatalf("one reservation was given back %d times, want once", given)
		}
	})
}

// TestPaceQueueCap: a rule's max_wait caps the wait of every paced check
// of it, so one key's queue holds at most max_wait of slots: a caller that
// reserves with a 10 s wait until refused leaves a caller asking the
// rule's max_wait refused for at most one spend, not for the 9 s a queue
// of 10 s would take.
func TestPaceQueueCap(t *testing.T) {
	set, err := rules.Parse("pace.yml", []byte(`rules:
  - id: capped
    algorithm: gcra
    capacity: 1
    refill_per_second: 10
    max_wait: 1s
  - id: open
    algorithm: gcra
    capacity: 1
    refill_per_second: 10
`))
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Store: newFaultStore(), Logger: quietLogger()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		rule      string
		slots     int           // the deep caller's slots before its refusal
		lockedOut time.Duration // the 1 s caller's retry, at most
	}{
		{"capped", 11, 100 * time.Millisecond}, // now, then 100 ms apart up to 1 s
		{"open", 101, 9100 * time.Millisecond}, // uncapped: the bound is max_wait_ms's own, 10 s
	} {
		t.Run(tc.rule, func(t *testing.T) {
			n := 0
			for {
				ok, it := pacedCheck(t, e, tc.rule, "k", bucket.MaxWait)
				if !ok {
					break
				}
				if it.Decision.Wait > time.Second && tc.rule == "capped" {
					t.Fatalf("slot %d waits %v, above the rule's max_wait of 1s", n, it.Decision.Wait)
				}
				n++
			}
			if n > tc.slots || n < tc.slots-1 {
				t.Errorf("the deep caller reserved %d slots, want %d", n, tc.slots)
			}
			ok, it := pacedCheck(t, e, tc.rule, "k", time.Second)
			if ok || it.Decision.RetryAfter > tc.lockedOut {
				t.Errorf("the 1 s caller: allowed %v, retry %v; want refused for at most %v", ok, it.Decision.RetryAfter, tc.lockedOut)
			}
		})
	}
}
