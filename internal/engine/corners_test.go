package engine

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

const cornerRules = `
rules:
  - id: lx
    capacity: 100
    refill_per_second: 0.000001
    lease: 5
  - id: ly
    capacity: 100
    refill_per_second: 0.000001
    lease: 5
`

func cornerEngine(t *testing.T, store *faultStore) *Engine {
	t.Helper()
	set, err := rules.Parse("corners.yml", []byte(cornerRules))
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Store: store, Region: "local", Logger: quietLogger()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func decideRules(ctx context.Context, t *testing.T, e *Engine, key string, ids ...string) (bool, error) {
	t.Helper()
	c := e.NewCheck()
	for _, id := range ids {
		if _, err := c.AddRule(id, key, 1); err != nil {
			t.Fatal(err)
		}
	}
	return e.Decide(ctx, c)
}

// TestLeasedKeyNotJammedWhenAWaitEnds: a check that becomes rule lx's
// batch fetcher and then gives up waiting for rule ly's batch (another
// check is taking it) must end lx's fetch, or every later check of
// (lx, key) waits for a batch that never comes.
func TestLeasedKeyNotJammedWhenAWaitEnds(t *testing.T) {
	store := newFaultStore()
	e := cornerEngine(t, store)
	block := make(chan struct{})
	store.mu.Lock()
	store.block = block
	store.mu.Unlock()

	// Check A takes ly's batch and waits in the store.
	aDone := make(chan error, 1)
	go func() {
		_, err := decideRules(context.Background(), t, e, "k", "ly")
		aDone <- err
	}()
	for store.calls.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	// Check C becomes lx's fetcher, then waits for A's ly batch until
	// its deadline.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	_, err := decideRules(ctx, t, e, "k", "lx", "ly")
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("check of lx and ly while ly's batch is taken = %v; want its deadline", err)
	}
	store.mu.Lock()
	store.block = nil
	store.mu.Unlock()
	close(block)
	if err := <-aDone; err != nil {
		t.Fatal(err)
	}

	ctx, cancel = context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ok, err := decideRules(ctx, t, e, "k", "lx")
	if err != nil || !ok {
		t.Fatalf("later check of lx = %v, %v; want allowed (the key is jammed by a fetch never ended)", ok, err)
	}
}

const homeRules = `
rules:
  - id: pin
    capacity: 8
    refill_per_second: 0.000001
    home: pinned
    home_keys: {u1: eu-west}
    match: {path: "/p/**"}
    key_by: user
  - id: plocal
    capacity: 1
    refill_per_second: 0.000001
    match: {path: /p/both}
    key_by: api_key
  - id: win
    algorithm: fixed_window
    limit: 2
    window: 1h
    home: pinned
    home_keys: {u1: eu-west}
    match: {path: "/w/**"}
    key_by: user
  - id: wlocal
    capacity: 1
    refill_per_second: 0.000001
    match: {path: /w/both}
    key_by: api_key
`

func decideAttrs(t *testing.T, e *Engine, a *rules.Attributes) bool {
	t.Helper()
	e.deny.Clear()
	ok, _, err := checkAttrs(t, e, a)
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

// TestHomeRefundsOnlyWhatItsStoreSpent: a home that decided a forwarded
// check from its fallback (its store failing) spent nothing in its store;
// when a local rule at the origin refuses, the refund must not give its
// store bucket a token it never took.
func TestHomeRefundsOnlyWhatItsStoreSpent(t *testing.T) {
	r := twoRegionsWith(t, homeRules, newFaultStore())
	one := &rules.Attributes{User: "u1", Path: "/p/one"}
	for i := range 8 {
		if !decideAttrs(t, r.east, one) {
			t.Fatalf("check %d of pin's 8 refused", i+1)
		}
	}
	// plocal's one token, spent by another user.
	if !decideAttrs(t, r.east, &rules.Attributes{User: "u2", APIKey: "k1", Path: "/p/both"}) {
		t.Fatal("plocal's first check refused")
	}
	r.wStore.setFail(errors.New("eu-west's store is down"))
	// eu-west decides pin from its fallback; plocal refuses at us-east.
	r.west.deny.Clear()
	if decideAttrs(t, r.east, &rules.Attributes{User: "u1", APIKey: "k1", Path: "/p/both"}) {
		t.Fatal("check with plocal exhausted allowed")
	}
	if n := testutil.ToFloat64(r.west.table.Load().ByID["pin"].FallbackAllowed); n != 1 {
		t.Fatalf("eu-west's fallback allowed %v checks of pin, want 1", n)
	}
	if err := r.east.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.wStore.setFail(nil)
	r.west.deny.Clear()
	if decideAttrs(t, r.east, one) {
		t.Fatalf("pin of capacity 8 admitted a 9th check (%d refunds): the home gave its store back what its fallback spent", r.home.refunds.Load())
	}
}

// TestRefundAtTheStoresInstant: a forwarded check spends a fixed window's
// token at the home in the store's window H-1 (the store's clock reads
// just before the hour limiterd's clock reads); its refund, arriving once
// the store is in window H and that window is full, must give back to
// window H-1 (gone: nothing), never to H.
func TestRefundAtTheStoresInstant(t *testing.T) {
	hour := time.Hour.Microseconds()
	realHour := time.Now().UnixMicro() / hour * hour
	var clock atomic.Int64
	clock.Store(realHour - 1) // the store's window H-1, limiterd's H
	west := &faultStore{Memory: bucket.NewMemory(bucket.WithClock(func() time.Time { return time.UnixMicro(clock.Load()) }))}
	r := twoRegionsWith(t, homeRules, west)
	// wlocal's one token, spent by another user.
	if !decideAttrs(t, r.east, &rules.Attributes{User: "u2", APIKey: "k1", Path: "/w/both"}) {
		t.Fatal("wlocal's first check refused")
	}
	r.home.refundGate = make(chan struct{})
	if decideAttrs(t, r.east, &rules.Attributes{User: "u1", APIKey: "k1", Path: "/w/both"}) {
		t.Fatal("check with wlocal exhausted allowed")
	}
	// The store moves into window H, which two checks fill.
	clock.Store(realHour + time.Second.Microseconds())
	one := &rules.Attributes{User: "u1", Path: "/w/one"}
	for i := range 2 {
		if !decideAttrs(t, r.east, one) {
			t.Fatalf("check %d of window H refused", i+1)
		}
	}
	close(r.home.refundGate)
	if err := r.east.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.west.deny.Clear()
	if decideAttrs(t, r.east, one) {
		t.Fatal("a fixed window of 2 admitted a 3rd check in one window: the refund of a spend in window H-1 gave back to window H")
	}
}

// TestFallbackSharesByTime: a fleet larger than a rule's limit shares it
// by time while the store is down: each instance admits a request per
// longer window, so the fleet together keeps the limit's rate, instead of
// one request per instance per window.
func TestFallbackSharesByTime(t *testing.T) {
	tests := []struct {
		name  string
		lim   bucket.Limit
		n     int
		cost  float64
		until time.Duration // the share admits cost once in this long
		least float64       // of the limit's rate, at least
	}{
		{"sliding log 3 a minute, 10 instances", bucket.Limit{Algorithm: bucket.SlidingLog, Capacity: 3, Window: time.Minute}, 10, 1, 200 * time.Second, 0.9},
		{"fixed window 5 an hour, 20 instances, cost 2", bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 5, Window: time.Hour}, 20, 2, 16 * time.Hour, 0.9},
		// A sliding window holding its capacity admits again once the
		// previous window weighs nothing: half the rate, the safe side.
		{"sliding window 4 a second, 8 instances", bucket.Limit{Algorithm: bucket.SlidingWindow, Capacity: 4, Window: time.Second}, 8, 1, 2 * time.Second, 0.45},
		{"token bucket 5 at 1/s, 10 instances", bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 5, RefillPerSecond: 1}, 10, 1, 10 * time.Second, 0.9},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sh := request.Share(tt.lim, tt.n, tt.cost)
			if err := sh.Validate(); err != nil && sh.Algorithm != bucket.SlidingLog {
				t.Fatalf("share %+v: %v", sh, err)
			}
			if _, err := sh.NormalizeCost(tt.cost); err != nil {
				t.Fatalf("share %+v refuses a cost of %v: %v", sh, tt.cost, err)
			}
			// Over a long span the fleet admits the limit's rate.
			var st bucket.State
			span := 500 * tt.until
			start := (time.Now().UnixMicro()/time.Hour.Microseconds() + 1) * time.Hour.Microseconds()
			admitted := 0
			step := tt.until / 20
			for at := time.Duration(0); at < span; at += step {
				if sh.Take(&st, start+at.Microseconds(), tt.cost).Allowed {
					admitted++
				}
			}
			fleet := float64(admitted) * tt.cost * float64(tt.n)
			want := request.SustainedRate(tt.lim) * span.Seconds()
			if fleet > want*1.05+float64(tt.n)*tt.lim.Capacity || fleet < want*tt.least {
				t.Fatalf("%d instances of share %+v admit %v in %v, want about %v (the limit's rate)", tt.n, sh, fleet, span, want)
			}
		})
	}
}

// TestRehomedKeySeededOnce: two instances load a change of home_keys at
// different times, so their handoff windows end apart. When the first's
// seed record has expired, the second, still within its own window, asks
// the old home (refilled: it reports nothing) and seeds again: that seed
// must not give back what the key spent here since it moved.
func TestRehomedKeySeededOnce(t *testing.T) {
	src := func(home string) *rules.Set {
		t.Helper()
		set, err := rules.Parse("rules.yml", []byte(`rules:
  - id: vip
    capacity: 10
    refill_per_second: 0.001
    home: pinned
    on_failure: closed
    home_keys: {acme: `+home+`}
`))
		if err != nil {
			t.Fatal(err)
		}
		return set
	}
	topo := parseTopo(t, topoSrc(1, "", "us", "eu"))
	eu, err := New(Options{Store: bucket.NewMemory(), Region: "eu", Logger: quietLogger()}, src("eu"), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	euHome := &fakeHome{e: eu}
	var clock atomic.Int64
	clock.Store(time.Now().UnixMicro())
	store := bucket.NewMemory(bucket.WithClock(func() time.Time { return time.UnixMicro(clock.Load()) }))
	var us []*Engine
	for range 2 {
		e, err := New(Options{Store: store, Region: "us", Topology: topo, Homes: map[string]homes.Home{"eu": euHome}, Logger: quietLogger()},
			src("eu"), prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		if err := e.SetRules(src("us")); err != nil {
			t.Fatal(err)
		}
		us = append(us, e)
	}
	// The first loaded the change a window ago less 100 ms, the second now.
	window := src("us").Get("vip").Bucket().HandoffWindow()
	us[0].table.Load().ByID["vip"].Rehome.Since = time.Now().Add(-window + 100*time.Millisecond)
	if n, err := admit(t, us[0], "vip", "acme"); n != 10 || err != nil {
		t.Fatalf("first instance: admitted %d (%v), want 10 (eu spent nothing)", n, err)
	}
	clock.Add(time.Second.Microseconds()) // the seed record expires
	if n, err := admit(t, us[1], "vip", "acme"); n != 0 || err != nil {
		t.Fatalf("second instance, within its window after the record expired: admitted %d more (%v), want 0", n, err)
	}
}
