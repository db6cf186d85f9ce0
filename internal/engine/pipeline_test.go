package engine

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
)

// faultStore is a real in-memory store whose calls can be made to fail or
// to wait, to drive the engine's failure paths.
type faultStore struct {
	*bucket.Memory
	mu    sync.Mutex
	fail  error // returned instead of deciding, when set
	multi func(reqs []bucket.Request, ds []bucket.Decision) error
	block chan struct{} // when set, calls wait for it to close
	calls atomic.Int64
	undos [][]bucket.Request
}

func newFaultStore() *faultStore { return &faultStore{Memory: bucket.NewMemory()} }

func (s *faultStore) setFail(err error) {
	s.mu.Lock()
	s.fail = err
	s.mu.Unlock()
}

func (s *faultStore) before() error {
	s.calls.Add(1)
	s.mu.Lock()
	block, fail := s.block, s.fail
	s.mu.Unlock()
	if block != nil {
		<-block
	}
	return fail
}

func (s *faultStore) Take(ctx context.Context, r bucket.Request) (bucket.Decision, error) {
	if err := s.before(); err != nil {
		return bucket.Decision{}, err
	}
	return s.Memory.Take(ctx, r)
}

func (s *faultStore) TakeAll(ctx context.Context, reqs []bucket.Request) ([]bucket.Decision, error) {
	if err := s.before(); err != nil {
		return nil, err
	}
	ds, _ := s.Memory.TakeAll(ctx, reqs)
	if s.multi != nil {
		return ds, s.multi(reqs, ds)
	}
	return ds, nil
}

func (s *faultStore) Undo(ctx context.Context, reqs []bucket.Request, at time.Time) error {
	s.mu.Lock()
	s.undos = append(s.undos, reqs)
	s.mu.Unlock()
	return s.Memory.Undo(ctx, reqs, at)
}

// fakeHome is another region deciding in its own store, or failing.
type fakeHome struct {
	e       *Engine
	fail    atomic.Bool
	slow    atomic.Bool // decide, then answer after the caller's deadline
	refunds atomic.Int64
	// refundGate, when set, holds each Refund until it is closed.
	refundGate chan struct{}
}

func (h *fakeHome) Decide(ctx context.Context, items []homes.Item) (bool, []bucket.Decision, error) {
	if h.fail.Load() {
		return false, nil, errors.New("home unreachable")
	}
	if h.slow.Load() {
		defer func() { <-ctx.Done() }()
		_, ds, err := h.decide(context.WithoutCancel(ctx), items)
		return false, ds, errors.Join(err, context.DeadlineExceeded)
	}
	return h.decide(ctx, items)
}

func (h *fakeHome) decide(ctx context.Context, items []homes.Item) (bool, []bucket.Decision, error) {
	c := h.e.NewCheck()
	c.FromPeer("us-east")
	var its []*request.Item
	for _, hi := range items {
		it, err := c.AddRule(hi.Rule, hi.Key, hi.Cost)
		if err != nil {
			return false, nil, err
		}
		its = append(its, it)
	}
	if len(items) > 0 && items[0].MaxWait > 0 {
		if err := c.Pace(items[0].MaxWait); err != nil {
			return false, nil, err
		}
	}
	ok, err := h.e.Decide(ctx, c)
	ds := make([]bucket.Decision, len(its))
	for i, it := range its {
		ds[i] = it.Decision
	}
	return ok, ds, err
}

func (h *fakeHome) Refund(ctx context.Context, items []homes.Item) error {
	if h.refundGate != nil {
		<-h.refundGate
	}
	h.refunds.Add(1)
	return h.e.Refund(ctx, items)
}

func (h *fakeHome) Usage(ctx context.Context, items []homes.Item) ([]bucket.Decision, error) {
	if h.fail.Load() {
		return nil, errors.New("home unreachable")
	}
	return peerUsage(ctx, h.e, "us", items)
}

func (h *fakeHome) Settle(ctx context.Context, st bucket.Settlement) (bucket.Settled, error) {
	if h.fail.Load() {
		return bucket.Settled{}, errors.New("home unreachable")
	}
	return h.e.SettleHere(ctx, st)
}

func (h *fakeHome) Handoff(ctx context.Context, items []homes.Item) ([]float64, error) {
	if h.fail.Load() {
		return nil, errors.New("home unreachable")
	}
	return h.e.Used(ctx, items)
}

const pipelineRules = `
rules:
  - id: local
    capacity: 1
    refill_per_second: 0.000001
    match: {path: /a}
    key_by: user
  - id: pinned
    capacity: 8
    refill_per_second: 0.000001
    home: pinned
    home_keys: {u1: eu-west, u2: eu-west}
    match: {path: "/**"}
    key_by: user
  - id: pinned-closed
    capacity: 8
    refill_per_second: 0.000001
    home: pinned
    on_failure: closed
    home_keys: {u1: eu-west}
    match: {path: /c}
    key_by: user
  - id: open
    capacity: 8
    refill_per_second: 0.000001
  - id: closed
    capacity: 8
    refill_per_second: 0.000001
    on_failure: closed
  - id: pair-a
    capacity: 5
    refill_per_second: 0.000001
    match: {path: /p}
    key_by: user
  - id: pair-b
    capacity: 1
    refill_per_second: 0.000001
    match: {path: /p}
    key_by: api_key
  - id: leased
    capacity: 20
    refill_per_second: 0.000001
    lease: 5
    match: {path: /l}
    key_by: user
  - id: tight
    capacity: 1
    refill_per_second: 0.000001
    match: {path: /l}
    key_by: api_key
`

type regions struct {
	east, west        *Engine
	eastStore, wStore *faultStore
	home              *fakeHome
	fleet             atomic.Int64
}

// twoRegions is us-east deciding with eu-west as the home of pinned keys.
func twoRegions(t *testing.T) *regions {
	t.Helper()
	return twoRegionsWith(t, pipelineRules, newFaultStore())
}

// twoRegionsWith is twoRegions with the rules of src, west as eu-west's
// store, and us-east's options changed by east.
func twoRegionsWith(t *testing.T, src string, west *faultStore, east ...func(*Options)) *regions {
	t.Helper()
	set, err := rules.Parse("pipeline.yml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	topo, err := region.New([]region.Region{{Name: "us-east", LimiterAddress: "a:1"}, {Name: "eu-west", LimiterAddress: "b:1"}})
	if err != nil {
		t.Fatal(err)
	}
	r := &regions{eastStore: newFaultStore(), wStore: west}
	r.fleet.Store(1)
	r.west, err = New(Options{Store: r.wStore, Region: "eu-west", Topology: topo, Logger: quietLogger()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	r.home = &fakeHome{e: r.west}
	opts := Options{Store: r.eastStore, Region: "us-east", Topology: topo, Homes: map[string]homes.Home{"eu-west": r.home},
		FleetSize: func() int { return int(r.fleet.Load()) }, Logger: quietLogger()}
	for _, f := range east {
		f(&opts)
	}
	r.east, err = New(opts, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func checkAttrs(t *testing.T, e *Engine, a *rules.Attributes) (bool, *request.Check, error) {
	t.Helper()
	c := e.NewCheck()
	if _, _, err := c.AddAttributes(a, 1); err != nil {
		t.Fatal(err)
	}
	ok, err := e.Decide(context.Background(), c)
	return ok, c, err
}

func remaining(t *testing.T, e *Engine, rule, key string) float64 {
	t.Helper()
	c := e.NewCheck()
	c.FromPeer("probe")
	it, err := c.AddRule(rule, key, 0.000001)
	if err != nil {
		t.Fatal(err)
	}
	// A probe of almost nothing, never refused while a token is left.
	if _, err := e.Decide(context.Background(), c); err != nil {
		t.Fatal(err)
	}
	return it.Decision.Remaining
}

// TestPinnedRuleRefundedWhenALocalRuleRefuses: a check by attributes with a
// rule pinned to another home region is all or nothing: when a local rule
// refuses, the home gives back what it spent.
func TestPinnedRuleRefundedWhenALocalRuleRefuses(t *testing.T) {
	r := twoRegions(t)
	a := &rules.Attributes{User: "u1", Path: "/a"}
	if ok, _, err := checkAttrs(t, r.east, a); !ok || err != nil {
		t.Fatalf("first check = %v, %v; want allowed", ok, err)
	}
	for range 3 {
		// Without the denial the first check left, the refusal comes
		// from the store, after the home region spent.
		r.east.deny.Clear()
		if ok, _, err := checkAttrs(t, r.east, a); ok || err != nil {
			t.Fatalf("check after the local rule's one token = %v, %v; want refused", ok, err)
		}
	}
	if err := r.east.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The home spent 1 for the allowed check; the refused ones gave theirs back.
	if got := remaining(t, r.west, "pinned", "user:u1"); got < 6.99 || got > 7 {
		t.Fatalf("pinned rule at its home has %v left, want 7 (8 - the one allowed check)", got)
	}
	if got := r.home.refunds.Load(); got != 3 {
		t.Errorf("refunds sent = %d, want 3, one per refused check", got)
	}
}

// TestPartialStoreFailureWithARefusalRefuses: when one client slot of a
// check fails and another refused, the check is refused (not decided by
// the fallback, which might admit it).
func TestPartialStoreFailureWithARefusalRefuses(t *testing.T) {
	r := twoRegions(t)
	a := &rules.Attributes{User: "u9", APIKey: "k9", Path: "/p"}
	if ok, _, err := checkAttrs(t, r.east, a); !ok || err != nil {
		t.Fatalf("first check = %v, %v; want allowed", ok, err)
	}
	// pair-b (capacity 1) now refuses; make pair-a's slot fail.
	r.eastStore.multi = func(reqs []bucket.Request, ds []bucket.Decision) error {
		errs := make([]error, len(reqs))
		for i, q := range reqs {
			if q.Rule == "pair-a" {
				errs[i] = errors.New("connection refused")
			}
		}
		return &bucket.MultiError{Errs: errs}
	}
	ok, c, err := checkAttrs(t, r.east, a)
	if ok || err != nil {
		t.Fatalf("check with pair-a's slot failing and pair-b refusing = %v, %v; want refused", ok, err)
	}
	for _, it := range c.Enforced() {
		if it.Rule.ID == "pair-b" && it.Decision.Allowed {
			t.Errorf("pair-b reported allowed: %+v", it.Decision)
		}
	}
	if n := r.east.fallback.Len(); n != 0 {
		t.Errorf("the fallback holds %d buckets: it decided a check the store had refused", n)
	}
}

// TestOutcomeUnknownIsNotDecidedAgain: a store call that may have run is
// never decided by the fallback; a fail-closed rule refuses it.
func TestOutcomeUnknownIsNotDecidedAgain(t *testing.T) {
	r := twoRegions(t)
	r.eastStore.setFail(fmtErr("reply timed out: %w", bucket.ErrOutcomeUnknown))
	c := r.east.NewCheck()
	it, err := c.AddRule("open", "k", 1)
	if err != nil {
		t.Fatal(err)
	}
	ok, err := r.east.Decide(context.Background(), c)
	if !ok || err != nil {
		t.Fatalf("open rule, outcome unknown = %v, %v; want allowed", ok, err)
	}
	if it.Route != request.RouteUnknown || r.east.fallback.Len() != 0 {
		t.Fatalf("route %v, fallback buckets %d: want it not decided by the fallback", it.Route, r.east.fallback.Len())
	}
	if got := testutil.ToFloat64(it.Entry.Uncertain); got != 1 {
		t.Errorf("uncertain_allowed = %v, want 1", got)
	}
	c = r.east.NewCheck()
	if _, err := c.AddRule("closed", "k", 1); err != nil {
		t.Fatal(err)
	}
	if _, err := r.east.Decide(context.Background(), c); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("closed rule, outcome unknown: %v, want ErrUnavailable", err)
	}
}

// TestOverloadedIsNotAFallback: a check that never reached the store
// because limiterd is busy answers ErrOverloaded, for every rule.
func TestOverloadedIsNotAFallback(t *testing.T) {
	r := twoRegions(t)
	r.eastStore.setFail(fmtErr("queue: %w", bucket.ErrOverloaded))
	for _, rule := range []string{"open", "closed"} {
		c := r.east.NewCheck()
		if _, err := c.AddRule(rule, "k", 1); err != nil {
			t.Fatal(err)
		}
		if _, err := r.east.Decide(context.Background(), c); !errors.Is(err, ErrOverloaded) {
			t.Fatalf("%s rule, store overloaded: %v, want ErrOverloaded", rule, err)
		}
	}
	if r.east.fallback.Len() != 0 {
		t.Fatal("the fallback decided an overloaded check")
	}
}

// TestFallbackShares: with the store down, a fail-open rule decides with
// limit / fleet; a pinned rule whose home is down too with
// limit / (regions × fleet); a fail-closed pinned rule refuses.
func TestFallbackShares(t *testing.T) {
	r := twoRegions(t)
	r.fleet.Store(2)
	r.eastStore.setFail(errors.New("connection refused"))
	r.home.fail.Store(true)
	count := func(rule, key string, a *rules.Attributes) int {
		n := 0
		for range 20 {
			c := r.east.NewCheck()
			var err error
			if a != nil {
				_, _, err = c.AddAttributes(a, 1)
			} else {
				_, err = c.AddRule(rule, key, 1)
			}
			if err != nil {
				t.Fatal(err)
			}
			ok, err := r.east.Decide(context.Background(), c)
			if err != nil {
				t.Fatalf("%s: %v", rule, err)
			}
			if ok {
				n++
			}
		}
		return n
	}
	if got := count("open", "k", nil); got != 4 {
		t.Errorf("fail-open rule of 8, store down, fleet 2: %d admitted, want 4", got)
	}
	if got := count("", "", &rules.Attributes{User: "u2", Path: "/x"}); got != 2 {
		t.Errorf("pinned rule of 8, home and store down, 2 regions, fleet 2: %d admitted, want 2", got)
	}
	c := r.east.NewCheck()
	if _, _, err := c.AddAttributes(&rules.Attributes{User: "u1", Path: "/c"}, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := r.east.Decide(context.Background(), c); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("fail-closed pinned rule with its home down: %v, want ErrUnavailable", err)
	}
}

// TestStaleDenialAfterRuleChange: a check in flight under the old rules
// cannot leave a denial that refuses under the new ones.
func TestStaleDenialAfterRuleChange(t *testing.T) {
	r := twoRegions(t)
	for range 8 {
		c := r.east.NewCheck()
		if _, err := c.AddRule("open", "k", 1); err != nil {
			t.Fatal(err)
		}
		if _, err := r.east.Decide(context.Background(), c); err != nil {
			t.Fatal(err)
		}
	}
	// The next check is refused by the store (not by the denial the last
	// one left); hold it there while the rules change under it.
	r.east.deny.Clear()
	block := make(chan struct{})
	r.eastStore.mu.Lock()
	r.eastStore.block = block
	r.eastStore.mu.Unlock()
	done := make(chan bool, 1)
	go func() {
		c := r.east.NewCheck()
		if _, err := c.AddRule("open", "k", 1); err != nil {
			t.Error(err)
		}
		ok, _ := r.east.Decide(context.Background(), c)
		done <- ok
	}()
	for deadline := time.Now().Add(5 * time.Second); r.eastStore.calls.Load() < 9; {
		if time.Now().After(deadline) {
			t.Fatal("the ninth check never reached the store")
		}
		time.Sleep(time.Millisecond)
	}
	set, err := rules.Parse("raised.yml", []byte(`
rules:
  - id: open
    capacity: 100
    refill_per_second: 0.000001
`))
	if err != nil {
		t.Fatal(err)
	}
	if err := r.east.SetRules(set); err != nil {
		t.Fatal(err)
	}
	r.eastStore.mu.Lock()
	r.eastStore.block = nil
	r.eastStore.mu.Unlock()
	close(block)
	if <-done {
		t.Fatal("the check under the old capacity was allowed")
	}
	if r.east.deny.Len() != 0 {
		t.Fatalf("the deny cache holds %d denials from the old rules", r.east.deny.Len())
	}
	c := r.east.NewCheck()
	if _, err := c.AddRule("open", "k", 1); err != nil {
		t.Fatal(err)
	}
	if ok, err := r.east.Decide(context.Background(), c); !ok || err != nil {
		t.Fatalf("check under the raised capacity = %v, %v; want allowed", ok, err)
	}
}

// TestLeaseGivenBackWhenAnotherRuleRefuses: leased tokens a refused check
// took go back to the lease. With the deny cache, tight's denial refuses
// the later checks before the lease; without it, each reaches the lease
// and the store refuses it after the lease handed out its token.
func TestLeaseGivenBackWhenAnotherRuleRefuses(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts func(*Options)
	}{{"deny cache", func(*Options) {}}, {"no deny cache", func(o *Options) { o.DenyCacheSize = -1 }}} {
		t.Run(tc.name, func(t *testing.T) {
			r := twoRegionsWith(t, pipelineRules, newFaultStore(), tc.opts)
			a := &rules.Attributes{User: "lu", APIKey: "lk", Path: "/l"}
			if ok, _, err := checkAttrs(t, r.east, a); !ok || err != nil {
				t.Fatalf("first check = %v, %v", ok, err)
			}
			// The lease holds 4; tight (capacity 1) refuses from now on.
			for range 10 {
				if ok, _, _ := checkAttrs(t, r.east, a); ok {
					t.Fatal("a check passed with tight spent")
				}
			}
			// The 4 are still there: 4 checks of leased alone pass from
			// the lease without a store call.
			before := r.eastStore.calls.Load()
			for i := range 4 {
				c := r.east.NewCheck()
				if _, err := c.AddRule("leased", "user:lu", 1); err != nil {
					t.Fatal(err)
				}
				if ok, err := r.east.Decide(context.Background(), c); !ok || err != nil {
					t.Fatalf("leased check %d = %v, %v; want allowed from the lease", i, ok, err)
				}
			}
			if calls := r.eastStore.calls.Load() - before; calls != 0 {
				t.Errorf("%d store calls for 4 checks the lease should hold: refused checks kept its tokens", calls)
			}
		})
	}
}

// TestPartlyDecidedSpendsUndoneWhenTheRestFailsClosed: a store call that
// decided one client slot and failed another, whose rule is fail-closed,
// refuses the check, and the decided slot's spend is undone at its
// instant.
func TestPartlyDecidedSpendsUndoneWhenTheRestFailsClosed(t *testing.T) {
	r := twoRegions(t)
	r.eastStore.multi = func(reqs []bucket.Request, ds []bucket.Decision) error {
		errs := make([]error, len(reqs))
		for i, q := range reqs {
			if q.Rule == "closed" {
				errs[i] = errors.New("connection refused")
			}
		}
		return &bucket.MultiError{Errs: errs}
	}
	for i := range 3 {
		c := r.east.NewCheck()
		if _, err := c.AddRule("open", "k", 1); err != nil {
			t.Fatal(err)
		}
		if _, err := c.AddRule("closed", "k", 1); err != nil {
			t.Fatal(err)
		}
		if ok, err := r.east.Decide(context.Background(), c); ok || !errors.Is(err, ErrUnavailable) {
			t.Fatalf("check %d with closed's slot failing = %v, %v; want ErrUnavailable", i, ok, err)
		}
	}
	r.eastStore.multi = nil
	if got := remaining(t, r.east, "open", "k"); got < 8-1e-3 {
		t.Fatalf("open has %v of 8 left after 3 refused checks: their spends stayed", got)
	}
	r.eastStore.mu.Lock()
	undos := len(r.eastStore.undos)
	r.eastStore.mu.Unlock()
	if undos != 3 {
		t.Errorf("%d undos sent, want 3 (one per refused check)", undos)
	}
}

// TestProbeOnEveryPath: once a denial expires, many concurrent checks of
// several rules send one probe to the store, not one call each.
func TestProbeOnEveryPath(t *testing.T) {
	r := twoRegions(t)
	a := &rules.Attributes{User: "pu", APIKey: "pk", Path: "/p"}
	_, _, _ = checkAttrs(t, r.east, a)
	_, _, _ = checkAttrs(t, r.east, a) // refused by pair-b: a denial, for a long time
	// Make the denial expire now.
	r.east.deny.Reset(r.east.table.Load().Gen)
	r.east.deny.Put(r.east.table.Load().Gen, "pair-b", "api_key:pk", 1, r.east.deny.Now(), time.Millisecond, time.Millisecond)
	time.Sleep(2 * time.Millisecond)
	before := r.eastStore.calls.Load()
	var wg sync.WaitGroup
	for range 50 {
		wg.Go(func() { _, _, _ = checkAttrs(t, r.east, a) })
	}
	wg.Wait()
	if calls := r.eastStore.calls.Load() - before; calls > 2 {
		t.Errorf("50 concurrent checks after the denial expired cost %d store calls, want 1 (the probe)", calls)
	}
}

func fmtErr(format string, err error) error { return &wrapped{format, err} }

type wrapped struct {
	msg string
	err error
}

func (w *wrapped) Error() string { return w.msg }
func (w *wrapped) Unwrap() error { return w.err }

// TestForwardTimeoutIsNotDecidedAgain: a forward that ran out of time may
// have been decided and spent at the home: the fallback does not decide it
// again (fail open: allowed as uncertain; fail closed: ErrUnavailable).
func TestForwardTimeoutIsNotDecidedAgain(t *testing.T) {
	r := twoRegions(t)
	r.east.fwdTO = 20 * time.Millisecond
	r.home.slow.Store(true)
	ok, c, err := checkAttrs(t, r.east, &rules.Attributes{User: "u2", Path: "/x"})
	if !ok || err != nil {
		t.Fatalf("fail-open pinned rule, forward timed out = %v, %v; want allowed", ok, err)
	}
	for _, it := range c.Enforced() {
		if it.Rule.ID == "pinned" && it.Route != request.RouteUnknown {
			t.Errorf("pinned rule decided by route %v, want unknown (not the fallback)", it.Route)
		}
	}
	if got := r.eastStore.Memory.Len() + r.east.fallback.Len(); got != 0 {
		t.Errorf("us-east holds %d buckets, want none: the pinned rule must not be decided here again", got)
	}
	_, _, err = checkAttrs(t, r.east, &rules.Attributes{User: "u1", Path: "/c"})
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("fail-closed pinned rule, forward timed out: %v, want ErrUnavailable", err)
	}
}
