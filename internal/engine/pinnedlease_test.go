package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/engine/concurrency"
	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/leaseid"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
)

const pinnedLeaseRules = `rules:
  - id: pin
    algorithm: concurrency
    limit: 2
    lease_ttl: 10s
    home: pinned
    home_keys: {k: eu, k2: eu}
    on_failure: open
  - id: local
    algorithm: concurrency
    limit: 5
    lease_ttl: 10s
  - id: pin-adaptive
    algorithm: concurrency
    limit: 1
    lease_ttl: 10s
    home: pinned
    home_keys: {k: eu}
    adaptive: {min: 1, max: 4, target_latency: 100ms}
`

// engineHome is a home region's engine, reached in-process as a peer
// region would reach it; down makes it answer nothing (err).
type engineHome struct {
	e      *Engine
	origin string
	gen    uint64
	mu     sync.Mutex
	err    error
	calls  map[string]int
}

func (h *engineHome) call(name string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.calls == nil {
		h.calls = map[string]int{}
	}
	h.calls[name]++
	return h.err
}

func (h *engineHome) Decide(context.Context, []homes.Item) (bool, []bucket.Decision, error) {
	return false, nil, errors.New("not used")
}
func (h *engineHome) Refund(context.Context, []homes.Item) error { return nil }
func (h *engineHome) Usage(ctx context.Context, items []homes.Item) ([]bucket.Decision, error) {
	return peerUsage(ctx, h.e, h.origin, items)
}

func (h *engineHome) Settle(ctx context.Context, st bucket.Settlement) (bucket.Settled, error) {
	return h.e.SettleHere(ctx, st)
}

func (h *engineHome) Handoff(context.Context, []homes.Item) ([]float64, error) {
	return nil, errors.New("not used")
}

func (h *engineHome) AcquireLease(ctx context.Context, id string) (concurrency.HomeLease, error) {
	if err := h.call(metrics.CallAcquire); err != nil {
		return concurrency.HomeLease{}, err
	}
	pl, err := h.e.Concurrency().PeerAcquire(ctx, h.origin, h.gen, id)
	if err != nil {
		return concurrency.HomeLease{}, err
	}
	hl := concurrency.HomeLease{Allowed: pl.Allowed, Expires: pl.Expires, TTL: pl.TTL, Fallback: pl.Fallback}
	for _, it := range pl.Items {
		hl.Decisions = append(hl.Decisions, it.Decision)
	}
	return hl, nil
}

func (h *engineHome) ReleaseLease(ctx context.Context, id string, sample *bucket.LeaseSample) (bool, error) {
	if err := h.call(metrics.CallRelease); err != nil {
		return false, err
	}
	return h.e.Concurrency().PeerRelease(ctx, id, sample)
}

func (h *engineHome) RenewLease(ctx context.Context, id string) (bool, time.Time, time.Duration, error) {
	if err := h.call(metrics.CallRenew); err != nil {
		return false, time.Time{}, 0, err
	}
	ok, l, err := h.e.Concurrency().PeerRenew(ctx, id)
	if err != nil || !ok {
		return false, time.Time{}, 0, err
	}
	return true, l.Expires, l.TTL, nil
}

// newPinnedPair makes the engines of regions us and eu, each homing the
// other's pinned keys through an engineHome; key k is homed in eu.
func newPinnedPair(t *testing.T) (us, eu *Engine, toEU *engineHome, usReg *prometheus.Registry) {
	t.Helper()
	set, err := rules.Parse("rules.yml", []byte(pinnedLeaseRules))
	if err != nil {
		t.Fatal(err)
	}
	topo, err := region.Parse("topology.yml", []byte("generation: 1\nregions:\n  - name: us\n    limiter_address: 127.0.0.1:1\n  - name: eu\n    limiter_address: 127.0.0.1:2\n"))
	if err != nil {
		t.Fatal(err)
	}
	toEU, toUS := &engineHome{origin: "us", gen: 1}, &engineHome{origin: "eu", gen: 1}
	mk := func(name string, homes map[string]homes.Home, reg prometheus.Registerer) *Engine {
		e, err := New(Options{Store: bucket.NewMemory(), Region: name, Topology: topo, Homes: homes, Logger: quietLogger()}, set, reg)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	usReg = prometheus.NewRegistry()
	us = mk("us", map[string]homes.Home{"eu": toEU}, usReg)
	eu = mk("eu", map[string]homes.Home{"us": toUS}, prometheus.NewRegistry())
	toEU.e, toUS.e = eu, us
	return us, eu, toEU, usReg
}

func acquireRule(t *testing.T, e *Engine, rule, key string) (bool, *concurrency.Lease, error) {
	t.Helper()
	c := e.NewAcquire()
	if _, err := c.AddRule(rule, key, 0); err != nil {
		t.Fatal(err)
	}
	return e.Acquire(context.Background(), c)
}

// TestPinnedLeaseHeldAtHome: us forwards the Acquire of a key homed in eu;
// the lease is held in eu (its limit counts every region's), and is
// released or renewed through either region.
func TestPinnedLeaseHeldAtHome(t *testing.T) {
	us, eu, _, _ := newPinnedPair(t)
	ctx := context.Background()
	ok1, l1, err1 := acquireRule(t, us, "pin", "k")
	ok2, l2, err2 := acquireRule(t, eu, "pin", "k")
	if !ok1 || !ok2 || err1 != nil || err2 != nil {
		t.Fatalf("two acquires under a limit of 2: %v %v, %v %v", ok1, err1, ok2, err2)
	}
	if ok, _, err := acquireRule(t, us, "pin", "k"); ok || err != nil {
		t.Fatalf("a third acquire through us: %v, %v; want refused at the home", ok, err)
	}
	id, _ := leaseid.Parse(l1.ID)
	if id.Parts[0].Region != "eu" || id.Parts[0].Flags != 0 {
		t.Fatalf("lease id part %+v, want held in eu", id.Parts[0])
	}
	if ok, l, err := eu.Concurrency().Renew(ctx, l1.ID); !ok || err != nil || l.TTL != 10*time.Second {
		t.Fatalf("Renew through eu of a lease taken through us: %v, %v, %v", ok, l, err)
	}
	if ok, err := eu.Concurrency().Release(ctx, l1.ID, nil); !ok || err != nil {
		t.Fatalf("Release through eu: %v, %v", ok, err)
	}
	if ok, err := us.Concurrency().Release(ctx, l2.ID, nil); !ok || err != nil {
		t.Fatalf("Release through us of a lease taken in eu: %v, %v", ok, err)
	}
	if ok, err := us.Concurrency().Release(ctx, l2.ID, nil); ok || err != nil {
		t.Fatalf("a second Release: %v, %v; want not released", ok, err)
	}
}

// TestPeerAcquireNeverForwardsAgain: a forwarded Acquire of a key this
// region does not home is refused, not forwarded on.
func TestPeerAcquireNeverForwardsAgain(t *testing.T) {
	us, _, toEU, _ := newPinnedPair(t)
	id := leaseid.New("eu", 1, []leaseid.Part{{Rule: "pin", Key: "k", Region: "us"}})
	_, err := us.Concurrency().PeerAcquire(context.Background(), "eu", 1, id.String())
	var inv *request.InvalidError
	if !errors.As(err, &inv) || inv.Field != "lease_id" {
		t.Fatalf("PeerAcquire in us of a key homed in eu: %v, want an *request.InvalidError of lease_id", err)
	}
	_, err = us.Concurrency().PeerAcquire(context.Background(), "eu", 0, id.String())
	if !errors.Is(err, homes.ErrStaleTopology) {
		t.Fatalf("PeerAcquire routed with an older generation: %v, want homes.ErrStaleTopology", err)
	}
	if len(toEU.calls) != 0 {
		t.Fatalf("us called eu %v for a forwarded acquire", toEU.calls)
	}
	local := leaseid.New("eu", 1, []leaseid.Part{{Rule: "local", Key: "k", Region: "us"}})
	if _, err := us.Concurrency().PeerAcquire(context.Background(), "eu", 1, local.String()); !errors.As(err, &inv) {
		t.Fatalf("PeerAcquire of a local rule: %v, want invalid", err)
	}
}

// TestPinnedLeaseHomeNoAnswer: a home that does not answer leaves the
// fail-open rule a fallback lease here, with this region's share (2 / 2
// regions = 1), not renewed; one whose answer did not come in time is
// asked to release what it may hold; a mixed Acquire whose local part
// refuses after the home granted releases the home's lease.
func TestPinnedLeaseHomeNoAnswer(t *testing.T) {
	us, eu, toEU, _ := newPinnedPair(t)
	ctx := context.Background()
	toEU.err = errors.New("connection refused")
	ok, l, err := acquireRule(t, us, "pin", "k")
	if !ok || err != nil {
		t.Fatalf("Acquire with the home down: %v, %v", ok, err)
	}
	id, _ := leaseid.Parse(l.ID)
	if p := id.Parts[0]; p.Region != "us" || p.Flags != leaseid.Regional {
		t.Fatalf("fallback lease part %+v, want held in us, regional", p)
	}
	if ok, _, _ := acquireRule(t, us, "pin", "k"); ok {
		t.Fatal("a second fallback lease past this region's share of 1")
	}
	if ok, _, err := us.Concurrency().Renew(ctx, l.ID); ok || err != nil {
		t.Fatalf("Renew of a region's share: %v, %v; want not renewed", ok, err)
	}
	if ok, _, _ := acquireRule(t, us, "pin", "k"); !ok {
		t.Fatal("the share's slot did not come back after the refused renewal")
	}
	if got := testutil.ToFloat64(us.m.ForwardedLeases.WithLabelValues("pin", metrics.CallAcquire, metrics.ResultError)); got != 3 {
		t.Errorf("forwarded acquires without an answer = %v, want 3", got)
	}

	toEU.err = fmt.Errorf("slow: %w", bucket.ErrOutcomeUnknown)
	before := toEU.calls[metrics.CallRelease]
	if ok, _, err := acquireRule(t, us, "pin", "k2"); !ok || err != nil {
		t.Fatalf("Acquire whose home's answer did not come: %v, %v; want a fallback lease", ok, err)
	}
	if toEU.calls[metrics.CallRelease] != before+1 {
		t.Errorf("an acquire whose answer did not come asked for %d releases, want 1", toEU.calls[metrics.CallRelease]-before)
	}

	// The home granted, the local part refuses: the home's lease goes back.
	toEU.err = nil
	for range 5 {
		if ok, _, err := acquireRule(t, us, "local", "m"); !ok || err != nil {
			t.Fatal(err)
		}
	}
	c := us.NewAcquire()
	if _, err := c.AddRule("pin", "k", 0); err != nil {
		t.Fatal(err)
	}
	if _, err := c.AddRule("local", "m", 0); err != nil {
		t.Fatal(err)
	}
	if ok, _, err := us.Acquire(ctx, c); ok || err != nil {
		t.Fatalf("mixed acquire with the local rule full: %v, %v; want refused", ok, err)
	}
	if got := testutil.ToFloat64(us.m.ForwardedLeases.WithLabelValues("pin", metrics.CallRelease, metrics.ResultReleased)); got < 1 {
		t.Errorf("the home's lease of a refused acquire not given back (released %v)", got)
	}
	// Both of eu's slots are free: the refused acquire holds nothing there.
	for i := range 2 {
		if ok, _, err := acquireRule(t, eu, "pin", "k"); !ok || err != nil {
			t.Fatalf("acquire %d in eu after the refused mixed acquire: %v, %v", i, ok, err)
		}
	}
}

// TestForgedLocalLeaseNoPeerCall: a local rule's lease is held in the
// region of its Acquire, so an id saying it is held elsewhere is edited:
// its Release and Renew are refused as invalid (naming lease_id) without
// a call to any region. A real lease id holding a local rule's lease and
// a pinned one is still released through the other region, each part
// where it is held.
func TestForgedLocalLeaseNoPeerCall(t *testing.T) {
	us, eu, toEU, _ := newPinnedPair(t)
	ctx := context.Background()
	ok, l, err := acquireRule(t, us, "local", "m")
	if !ok || err != nil {
		t.Fatalf("Acquire: %v, %v", ok, err)
	}
	real, _ := leaseid.Parse(l.ID)
	forged := *real
	forged.Parts = []leaseid.Part{{Rule: "local", Key: "m", Region: "eu"}}
	notInvalid := 0
	for range 500 {
		var inv *request.InvalidError
		released, err := us.Concurrency().Release(ctx, forged.String(), nil)
		if !errors.As(err, &inv) || inv.Field != "lease_id" || released {
			notInvalid++
		}
		renewed, _, err := us.Concurrency().Renew(ctx, forged.String())
		if !errors.As(err, &inv) || inv.Field != "lease_id" || renewed {
			notInvalid++
		}
	}
	if notInvalid > 0 || len(toEU.calls) != 0 {
		t.Fatalf("500 Releases and 500 Renews of a local lease said to be held in eu: %d not refused as invalid lease_id, calls to eu %v; want all refused, no call",
			notInvalid, toEU.calls)
	}
	if ok, err := us.Concurrency().Release(ctx, l.ID, nil); !ok || err != nil {
		t.Fatalf("Release of the real lease: %v, %v", ok, err)
	}

	// A mixed lease taken through us, released through eu: the pinned part
	// there, the local part forwarded to us.
	c := us.NewAcquire()
	if _, err := c.AddRule("pin", "k", 0); err != nil {
		t.Fatal(err)
	}
	if _, err := c.AddRule("local", "m", 0); err != nil {
		t.Fatal(err)
	}
	ok, mixed, err := us.Acquire(ctx, c)
	if !ok || err != nil {
		t.Fatalf("mixed Acquire: %v, %v", ok, err)
	}
	if ok, err := eu.Concurrency().Release(ctx, mixed.ID, nil); !ok || err != nil {
		t.Fatalf("Release through eu of a mixed lease taken through us: %v, %v", ok, err)
	}
	for i := range 5 {
		if ok, _, err := acquireRule(t, us, "local", "m"); !ok || err != nil {
			t.Fatalf("local acquire %d after the mixed lease's release: %v, %v (its local part still held)", i, ok, err)
		}
	}
}

// TestPinnedAdaptiveSample: a Release through another region than the
// key's home carries its sample there, where the key's limit is kept.
func TestPinnedAdaptiveSample(t *testing.T) {
	us, _, _, _ := newPinnedPair(t)
	ctx := context.Background()
	ok, l, err := acquireRule(t, us, "pin-adaptive", "k")
	if !ok || err != nil {
		t.Fatalf("acquire: %v, %v", ok, err)
	}
	if ok, err := us.Concurrency().Release(ctx, l.ID, &bucket.LeaseSample{Duration: time.Millisecond}); !ok || err != nil {
		t.Fatalf("release through us: %v, %v", ok, err)
	}
	// One fast sample at a limit of 1 makes it 2, at the home.
	for i := range 2 {
		if ok, _, err := acquireRule(t, us, "pin-adaptive", "k"); !ok || err != nil {
			t.Fatalf("acquire %d of 2 after a fast sample: %v, %v", i+1, ok, err)
		}
	}
}
