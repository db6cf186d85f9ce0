package engine

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/engine/handoff"
	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
)

const handoffRules = `rules:
  - id: open
    capacity: 10
    refill_per_second: 0.001
    home: pinned
    on_failure: open
  - id: closed
    capacity: 10
    refill_per_second: 0.001
    home: pinned
    on_failure: closed
  - id: big
    capacity: 1000000000
    refill_per_second: 1000000
    home: pinned
    on_failure: open
  - id: window
    algorithm: fixed_window
    limit: 10
    window: 1h
    home: pinned
    on_failure: open
`

// handoffWorld is two regions, us and eu, each an engine on its own store:
// us switches from a topology of both to one of us alone (eu removed), so
// the keys homed in eu move to us. eu decides every key in its own store
// (it has no topology), as the home it was.
type handoffWorld struct {
	t          testing.TB
	set        *rules.Set
	older      *region.Topology
	newer      *region.Topology
	us, eu     *Engine
	usStore    *bucket.Memory
	euHome     *fakeHome
	usRegistry *prometheus.Registry
	retired    atomic.Int64 // the older topology's retire callbacks run
}

func parseTopo(t testing.TB, src string) *region.Topology {
	t.Helper()
	tp, err := region.Parse("topology.yml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	return tp
}

func topoSrc(gen int, head string, regions ...string) string {
	src := fmt.Sprintf("generation: %d\n%sregions:\n", gen, head)
	for i, r := range regions {
		src += fmt.Sprintf("  - name: %s\n    limiter_address: 127.0.0.1:%d\n", r, i+1)
	}
	return src
}

func newHandoffWorld(t testing.TB) *handoffWorld {
	t.Helper()
	set, err := rules.Parse("rules.yml", []byte(handoffRules))
	if err != nil {
		t.Fatal(err)
	}
	w := &handoffWorld{t: t, set: set, older: parseTopo(t, topoSrc(1, "", "us", "eu")), newer: parseTopo(t, topoSrc(2, "", "us")),
		usStore: bucket.NewMemory(), usRegistry: prometheus.NewRegistry()}
	w.eu, err = New(Options{Store: bucket.NewMemory(), Region: "eu", Logger: quietLogger()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	w.euHome = &fakeHome{e: w.eu}
	w.us = w.usEngine(w.usRegistry, w.older)
	return w
}

// usEngine is an instance of us on us's store, started on topo.
func (w *handoffWorld) usEngine(reg *prometheus.Registry, topo *region.Topology) *Engine {
	w.t.Helper()
	e, err := New(Options{Store: w.usStore, Region: "us", Topology: topo, Homes: map[string]homes.Home{"eu": w.euHome},
		Logger: quietLogger()}, w.set, reg)
	if err != nil {
		w.t.Fatal(err)
	}
	return e
}

// switchTo puts newer (us alone) in force in e.
func (w *handoffWorld) switchTo(e *Engine) {
	w.t.Helper()
	if err := e.SetTopology(w.newer, map[string]homes.Home{}, func() { w.retired.Add(1) }); err != nil {
		w.t.Fatal(err)
	}
}

// movedKey is a key that the switch moves from eu to us.
func (w *handoffWorld) movedKey(skip int) string {
	for i := range 10_000 {
		k := fmt.Sprintf("user:%d", i)
		if w.older.Home(k, nil) == "eu" {
			if skip == 0 {
				return k
			}
			skip--
		}
	}
	w.t.Fatal("no key moves from eu to us")
	return ""
}

// spend takes cost of rule and key at e, which must allow it.
func spend(t *testing.T, e *Engine, rule, key string, cost float64) {
	t.Helper()
	c := e.NewCheck()
	if _, err := c.AddRule(rule, key, cost); err != nil {
		t.Fatal(err)
	}
	if ok, err := e.Decide(context.Background(), c); !ok || err != nil {
		t.Fatalf("spending %v of %s at %s: %v, %v", cost, key, e.region, ok, err)
	}
}

// admit checks rule and key through e until it refuses (at most 20), and
// returns how many it admitted.
func admit(t *testing.T, e *Engine, rule, key string) (int, error) {
	t.Helper()
	for n := range 20 {
		c := e.NewCheck()
		if _, err := c.AddRule(rule, key, 1); err != nil {
			t.Fatal(err)
		}
		ok, err := e.Decide(context.Background(), c)
		if err != nil || !ok {
			return n, err
		}
	}
	return 20, nil
}

// handoffCount is e's count of handoffs of result.
func handoffCount(e *Engine, result string) float64 {
	return testutil.ToFloat64(e.m.Handoffs.WithLabelValues(result))
}

// TestHandoffAtSwitch: a key that a topology switch moves from eu (a
// region removed) to us starts at us from what eu's bucket counted, not
// from a full bucket, for a token bucket and a window; once for the
// region's whole fleet (a second instance finds it seeded); and with eu
// unreachable its rule's on_failure decides: a fail-open rule starts full,
// a fail-closed one refuses until eu answers. A key the switch does not
// move, and a moved key past its rule's handoff window, never ask eu. The
// removed region's client is kept (the older topology not retired) until
// StopHandoffs.
func TestHandoffAtSwitch(t *testing.T) {
	for _, rule := range []string{"open", "window"} {
		t.Run(rule, func(t *testing.T) {
			w := newHandoffWorld(t)
			key := w.movedKey(0)
			spend(t, w.eu, rule, key, 6) // of 10, at the key's home before the switch
			w.switchTo(w.us)
			if n, err := admit(t, w.us, rule, key); n != 4 || err != nil {
				t.Fatalf("us admitted %d after the switch (%v); want the 4 eu had left", n, err)
			}
			if got := handoffCount(w.us, metrics.HandoffSeeded); got != 1 {
				t.Errorf("handoffs seeded: %v, want 1", got)
			}
			// A second instance of us, on the same store, finds it seeded.
			reg2 := prometheus.NewRegistry()
			us2 := w.usEngine(reg2, w.older)
			w.switchTo(us2)
			if n, err := admit(t, us2, rule, key); n != 0 || err != nil {
				t.Fatalf("a second instance admitted %d (%v); want 0", n, err)
			}
			if got := handoffCount(us2, metrics.HandoffAlready); got != 1 {
				t.Errorf("the second instance's handoffs already: %v, want 1", got)
			}
			if got := w.retired.Load(); got != 0 {
				t.Fatalf("the older topology retired %d times within the handoff window, want 0", got)
			}
			w.us.StopHandoffs()
			us2.StopHandoffs()
			if got := w.retired.Load(); got != 2 {
				t.Fatalf("the older topology retired %d times after StopHandoffs, want 2 (once per instance)", got)
			}
		})
	}

	t.Run("old home unreachable", func(t *testing.T) {
		w := newHandoffWorld(t)
		k1, k2 := w.movedKey(0), w.movedKey(1)
		for _, rule := range []string{"open", "closed"} {
			spend(t, w.eu, rule, k1, 10)
			spend(t, w.eu, rule, k2, 10)
		}
		w.switchTo(w.us)
		w.euHome.fail.Store(true)
		// Fail-open: starts full.
		if n, err := admit(t, w.us, "open", k1); n != 10 || err != nil {
			t.Fatalf("fail-open with eu down: admitted %d (%v), want 10 (a full bucket)", n, err)
		}
		// Fail-closed: refused, and asked again on the next check.
		for range 2 {
			if n, err := admit(t, w.us, "closed", k1); n != 0 || !errors.Is(err, ErrUnavailable) {
				t.Fatalf("fail-closed with eu down: admitted %d (%v), want ErrUnavailable", n, err)
			}
		}
		if got := handoffCount(w.us, metrics.HandoffUnreachable); got != 3 {
			t.Errorf("handoffs unreachable: %v, want 3", got)
		}
		w.euHome.fail.Store(false)
		if n, err := admit(t, w.us, "closed", k1); n != 0 || err != nil {
			t.Fatalf("fail-closed with eu back: admitted %d (%v), want 0 (eu spent all 10)", n, err)
		}
		// Past the handoff window, a moved key starts full: eu's bucket
		// would be full again by then.
		w.us.topo.Load().Switch.Since = time.Now().Add(-w.set.Get("closed").Bucket().HandoffWindow())
		w.euHome.fail.Store(true) // never asked
		if n, err := admit(t, w.us, "closed", k2); n != 10 || err != nil {
			t.Fatalf("past the window: admitted %d (%v), want 10", n, err)
		}
		if got := handoffCount(w.us, metrics.HandoffUnreachable); got != 3 {
			t.Errorf("handoffs unreachable: %v, want still 3 (eu not asked past the window)", got)
		}
	})

	t.Run("key not moved", func(t *testing.T) {
		w := newHandoffWorld(t)
		key := ""
		for i := range 10_000 {
			if k := fmt.Sprintf("user:%d", i); w.older.Home(k, nil) == "us" {
				key = k
				break
			}
		}
		w.switchTo(w.us)
		w.euHome.fail.Store(true)
		if n, err := admit(t, w.us, "closed", key); n != 10 || err != nil {
			t.Fatalf("a key homed here before and after: admitted %d (%v), want 10", n, err)
		}
		for _, r := range metrics.HandoffResults {
			if got := testutil.ToFloat64(w.us.m.Handoffs.WithLabelValues(r)); got != 0 {
				t.Errorf("handoffs %s: %v, want 0", r, got)
			}
		}
	})

	// A process started on a topology that names the regions before it
	// (a region added: us, eu's keys moving to it) hands off from its
	// effective_at, not before.
	t.Run("started on a topology naming its previous", func(t *testing.T) {
		w := newHandoffWorld(t)
		at := time.Now().Add(-time.Second)
		src := func(at time.Time) string {
			return topoSrc(2, "effective_at: "+at.UTC().Format(time.RFC3339Nano)+"\nprevious_regions: [eu]\n", "us", "eu")
		}
		added := parseTopo(t, src(at))
		var key, early string
		for i := range 10_000 {
			if k := fmt.Sprintf("user:%d", i); added.Home(k, nil) == "us" {
				if key == "" {
					key = k
				} else {
					early = k
					break
				}
			}
		}
		spend(t, w.eu, "open", key, 7)
		spend(t, w.eu, "open", early, 7)
		us := w.usEngine(prometheus.NewRegistry(), added)
		if n, err := admit(t, us, "open", key); n != 3 || err != nil {
			t.Fatalf("started on the new topology: admitted %d (%v), want the 3 eu had left", n, err)
		}
		// Before effective_at nothing is handed off (the old home still
		// decides the key by then).
		soon := w.usEngine(prometheus.NewRegistry(), parseTopo(t, src(time.Now().Add(time.Hour))))
		if n, err := admit(t, soon, "open", early); n != 10 || err != nil {
			t.Fatalf("before effective_at: admitted %d (%v), want 10", n, err)
		}
	})
}

// TestHandoffKeysBound: a process remembers at most handoff.MaxKeys moved
// keys as seeded; past that, a moved key is still handed off once, and its
// later checks ask the store (Seeded) instead of the memory.
func TestHandoffKeysBound(t *testing.T) {
	w := newHandoffWorld(t)
	key := w.movedKey(0)
	spend(t, w.eu, "open", key, 6)
	w.switchTo(w.us)
	ts := w.us.topo.Load()
	for i := range handoff.MaxKeys + 10 {
		ts.Switch.Seeded.Add("open", fmt.Sprintf("filler:%d", i))
	}
	if n := ts.Switch.Seeded.Len(); n != handoff.MaxKeys {
		t.Fatalf("%d keys remembered, want the bound %d", n, handoff.MaxKeys)
	}
	if n, err := admit(t, w.us, "open", key); n != 4 || err != nil {
		t.Fatalf("a moved key past the bound: admitted %d (%v), want 4", n, err)
	}
	if ts.Switch.Seeded.Has("open", key) {
		t.Fatal("a key past the bound remembered")
	}
	if got := handoffCount(w.us, metrics.HandoffSeeded); got != 1 {
		t.Errorf("seeded %v, want 1", got)
	}
	// admit made 5 checks: the first seeded, the next 3 asked the store,
	// the last (refused) the deny cache answered.
	if got := handoffCount(w.us, metrics.HandoffAlready); got != 3 {
		t.Errorf("found seeded in the store %v times, want 3", got)
	}
}

// answerHome answers every Handoff with used.
type answerHome struct {
	fakeHome
	used []float64
}

func (h *answerHome) Handoff(context.Context, []homes.Item) ([]float64, error) { return h.used, nil }

// TestHandoffBadAnswers: an old home's answer that is not one finite count
// per key, within what a bucket can hold, is not taken: the key is handed
// off as from a home that did not answer.
func TestHandoffBadAnswers(t *testing.T) {
	for _, used := range [][]float64{nil, {1, 2}, {-1}, {math.NaN()}, {math.Inf(1)}, {1e12}} {
		t.Run(fmt.Sprint(used), func(t *testing.T) {
			w := newHandoffWorld(t)
			bad := &answerHome{used: used}
			us, err := New(Options{Store: bucket.NewMemory(), Region: "us", Topology: w.older, Homes: map[string]homes.Home{"eu": bad},
				Logger: quietLogger()}, w.set, prometheus.NewRegistry())
			if err != nil {
				t.Fatal(err)
			}
			if err := us.SetTopology(w.newer, map[string]homes.Home{}, nil); err != nil {
				t.Fatal(err)
			}
			key := w.movedKey(0)
			if n, err := admit(t, us, "closed", key); n != 0 || !errors.Is(err, ErrUnavailable) {
				t.Fatalf("fail-closed: admitted %d (%v), want ErrUnavailable", n, err)
			}
			if n, err := admit(t, us, "open", key); n != 10 || err != nil {
				t.Fatalf("fail-open: admitted %d (%v), want 10 (a full bucket)", n, err)
			}
		})
	}
}

// ctxHome is eu's engine as a home that gives up when its caller's context
// is done, as a gRPC call does.
type ctxHome struct{ fakeHome }

func (h *ctxHome) Handoff(ctx context.Context, items []homes.Item) ([]float64, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return h.e.Used(ctx, items)
}

// TestHandoffOutlivesItsCaller: a caller that gives up (a cancelled
// context) cannot make a fail-open moved key start from a full bucket: the
// handoff runs to its own timeout.
func TestHandoffOutlivesItsCaller(t *testing.T) {
	w := newHandoffWorld(t)
	key := w.movedKey(0)
	spend(t, w.eu, "open", key, 6)
	home := &ctxHome{fakeHome{e: w.eu}}
	us, err := New(Options{Store: bucket.NewMemory(), Region: "us", Topology: w.older, Homes: map[string]homes.Home{"eu": home},
		Logger: quietLogger()}, w.set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if err := us.SetTopology(w.newer, map[string]homes.Home{}, nil); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	c := us.NewCheck()
	if _, err := c.AddRule("open", key, 1); err != nil {
		t.Fatal(err)
	}
	_, _ = us.Decide(ctx, c) // its answer does not matter: the caller is gone
	if n, err := admit(t, us, "open", key); n > 4 || err != nil {
		t.Fatalf("after a cancelled check: admitted %d (%v), want at most the 4 eu had left", n, err)
	}
}

// seedFailStore is a Memory whose Seed fails while fail is set.
type seedFailStore struct {
	*bucket.Memory
	fail atomic.Bool
}

func (s *seedFailStore) Seed(ctx context.Context, seeds []bucket.Seed) ([]bool, error) {
	if s.fail.Load() {
		return nil, errors.New("store down")
	}
	return s.Memory.Seed(ctx, seeds)
}

// TestHandoffStoreFails: this region's store failing to seed a moved key
// decides the check as a store failure does (fail-closed refused,
// fail-open from this instance's fallback share), leaves the key unseeded,
// and the next check once the store is back takes the old home's count.
func TestHandoffStoreFails(t *testing.T) {
	w := newHandoffWorld(t)
	key := w.movedKey(0)
	spend(t, w.eu, "open", key, 6)
	spend(t, w.eu, "closed", key, 6)
	store := &seedFailStore{Memory: bucket.NewMemory()}
	reg := prometheus.NewRegistry()
	us, err := New(Options{Store: store, Region: "us", Topology: w.older, Homes: map[string]homes.Home{"eu": w.euHome},
		Logger: quietLogger()}, w.set, reg)
	if err != nil {
		t.Fatal(err)
	}
	if err := us.SetTopology(w.newer, map[string]homes.Home{}, nil); err != nil {
		t.Fatal(err)
	}
	store.fail.Store(true)
	if n, err := admit(t, us, "closed", key); n != 0 || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("fail-closed, the store failing the seed: admitted %d (%v), want ErrUnavailable", n, err)
	}
	c := us.NewCheck()
	it, _ := c.AddRule("open", key, 1)
	if ok, err := us.Decide(context.Background(), c); !ok || err != nil || it.Route != request.RouteFallback {
		t.Fatalf("fail-open, the store failing the seed: %v, %v, route %v; want allowed from the fallback", ok, err, it.Route)
	}
	if got := handoffCount(us, metrics.HandoffStoreError); got != 2 {
		t.Errorf("handoffs store_error %v, want 2", got)
	}
	store.fail.Store(false)
	for _, rule := range []string{"open", "closed"} {
		if n, err := admit(t, us, rule, key); n != 4 || err != nil {
			t.Fatalf("%s, the store back: admitted %d (%v), want the 4 eu had left", rule, n, err)
		}
	}
}

// BenchmarkHandoffWindow is a pinned rule's check decided here: with no
// switch behind it, and for a key a switch moved here, within the rule's
// handoff window, once its bucket is seeded (what every check of a moved
// key costs until the window ends).
func BenchmarkHandoffWindow(b *testing.B) {
	w := newHandoffWorld(b)
	key := w.movedKey(0)
	ctx := context.Background()
	run := func(b *testing.B, e *Engine, key string) {
		b.ReportAllocs()
		for b.Loop() {
			c := e.NewCheck()
			if _, err := c.AddRule("big", key, 1); err != nil {
				b.Fatal(err)
			}
			if ok, err := e.Decide(ctx, c); !ok || err != nil {
				b.Fatal(ok, err)
			}
		}
	}
	steady := ""
	for i := range 10_000 {
		if k := fmt.Sprintf("user:%d", i); w.older.Home(k, nil) == "us" {
			steady = k
			break
		}
	}
	b.Run("no switch", func(b *testing.B) { run(b, w.us, steady) })
	w.switchTo(w.us)
	b.Run("moved key in its window", func(b *testing.B) { run(b, w.us, key) })
	if got := handoffCount(w.us, metrics.HandoffSeeded); got != 1 {
		b.Fatalf("seeded %v, want 1", got)
	}
}

// TestHandoffAtRehome: a change of a pinned rule's home_keys that gives a
// key a new home hands its bucket off as a topology switch does: once for
// the fleet, within the rule's window; a later change of the rule that
// keeps its home_keys keeps the window; keys in neither map are not asked.
func TestHandoffAtRehome(t *testing.T) {
	rulesWith := func(homes string, capacity int) *rules.Set {
		t.Helper()
		set, err := rules.Parse("rules.yml", []byte(fmt.Sprintf(`rules:
  - id: vip
    capacity: %d
    refill_per_second: 0.001
    home: pinned
    on_failure: closed
    home_keys: {%s}
`, capacity, homes)))
		if err != nil {
			t.Fatal(err)
		}
		return set
	}
	topo := parseTopo(t, topoSrc(1, "", "us", "eu"))
	eu, err := New(Options{Store: bucket.NewMemory(), Region: "eu", Logger: quietLogger()}, rulesWith("acme: eu", 10), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	euHome := &fakeHome{e: eu}
	store := bucket.NewMemory()
	usEngine := func() *Engine {
		e, err := New(Options{Store: store, Region: "us", Topology: topo, Homes: map[string]homes.Home{"eu": euHome}, Logger: quietLogger()},
			rulesWith("acme: eu", 10), prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	us, us2 := usEngine(), usEngine()
	spend(t, eu, "vip", "acme", 6)
	// A key homed here by the hash before and after: never asked.
	plain := ""
	for i := range 10_000 {
		if k := fmt.Sprintf("user:%d", i); topo.Home(k, nil) == "us" {
			plain = k
			break
		}
	}
	moved := rulesWith("acme: us", 10)
	for _, e := range []*Engine{us, us2} {
		if err := e.SetRules(moved); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := admit(t, us, "vip", "acme"); n != 4 || err != nil {
		t.Fatalf("after home_keys moved acme here: admitted %d (%v), want the 4 eu had left", n, err)
	}
	if n, err := admit(t, us2, "vip", "acme"); n != 0 || err != nil {
		t.Fatalf("a second instance: admitted %d (%v), want 0", n, err)
	}
	if handoffCount(us, metrics.HandoffSeeded) != 1 || handoffCount(us2, metrics.HandoffAlready) != 1 {
		t.Errorf("seeded %v, already %v; want 1 and 1", handoffCount(us, metrics.HandoffSeeded), handoffCount(us2, metrics.HandoffAlready))
	}
	euHome.fail.Store(true) // a key not moved, and the window past, never ask
	if n, err := admit(t, us, "vip", plain); n != 10 || err != nil {
		t.Fatalf("a key in neither map: admitted %d (%v), want 10", n, err)
	}
	// The rule changed again, its home_keys kept: the change's window
	// goes on (a fresh instance-wide memory is not needed: the store has
	// the record).
	if err := us.SetRules(rulesWith("acme: us", 12)); err != nil {
		t.Fatal(err)
	}
	if rh := us.table.Load().ByID["vip"].Rehome; rh == nil || rh.Origin != handoff.Origin(map[string]string{"acme": "us"}) {
		t.Fatalf("the rehoming after a change keeping home_keys: %+v", rh)
	}
	if n, err := admit(t, us, "vip", "acme"); n != 2 || err != nil {
		t.Fatalf("capacity raised to 12: admitted %d (%v), want 2", n, err)
	}
	// Another key moved here (from eu, its home by the hash), past the
	// window: starts full, eu not asked.
	bolt := ""
	for i := range 10_000 {
		if k := fmt.Sprintf("bolt-%d", i); topo.Home(k, nil) == "eu" {
			bolt = k
			break
		}
	}
	spend(t, eu, "vip", bolt, 10)
	later := rulesWith("acme: us, "+bolt+": us", 12)
	if err := us.SetRules(later); err != nil {
		t.Fatal(err)
	}
	us.table.Load().ByID["vip"].Rehome.Since = time.Now().Add(-later.Get("vip").Bucket().HandoffWindow())
	if n, err := admit(t, us, "vip", bolt); n != 12 || err != nil {
		t.Fatalf("past the window: admitted %d (%v), want 12", n, err)
	}
	if got := handoffCount(us, metrics.HandoffUnreachable); got != 0 {
		t.Errorf("eu asked %v times while down, want 0", got)
	}
}

// TestHandoffMaxWindow: Options.HandoffMaxWindow caps every rule's handoff
// window: past the cap a moved key starts from a full bucket, its old home
// not asked, and a removed region's connection is released then.
func TestHandoffMaxWindow(t *testing.T) {
	w := newHandoffWorld(t)
	key := w.movedKey(0)
	spend(t, w.eu, "open", key, 6)
	us, err := New(Options{Store: bucket.NewMemory(), Region: "us", Topology: w.older, Homes: map[string]homes.Home{"eu": w.euHome},
		HandoffMaxWindow: time.Minute, Logger: quietLogger()}, w.set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	var retired atomic.Int64
	if err := us.SetTopology(w.newer, map[string]homes.Home{}, func() { retired.Add(1) }); err != nil {
		t.Fatal(err)
	}
	ts := us.topo.Load()
	if retired.Load() != 0 {
		t.Fatal("the removed region's connection not held")
	}
	// The rule's own window is about 5.5 hours: one minute past the
	// switch is past the cap.
	ts.Switch.Since = time.Now().Add(-time.Minute)
	if n, err := admit(t, us, "open", key); n != 10 || err != nil {
		t.Fatalf("past the cap: admitted %d (%v), want 10 (a full bucket)", n, err)
	}
	if got := handoffCount(us, metrics.HandoffSeeded) + handoffCount(us, metrics.HandoffUnreachable); got != 0 {
		t.Errorf("handoffs past the cap: %v, want none", got)
	}
	if w, _ := us.handoffs.Longest(w.set); w != time.Minute {
		t.Errorf("longest handoff window %v, want the cap (1m)", w)
	}
	us.StopHandoffs()
	if got := retired.Load(); got != 1 {
		t.Errorf("the older topology retired %d times after StopHandoffs, want 1", got)
	}
}
