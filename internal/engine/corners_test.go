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
