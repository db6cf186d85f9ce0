package engine

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/engine/concurrency"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/usage"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

const priorityRules = `
rules:
  - id: shed
    capacity: 100
    refill_per_second: 0.001
    key_by: global
    reserve: {critical: 0.2, default: 0.05}
  - id: plain
    algorithm: fixed_window
    limit: 1000
    window: 1h
`

// leaseRules are concurrency rules with a reserve, one adaptive, and a
// rate rule with one, each matching its own path.
const leaseRules = `
rules:
  - id: inflight
    algorithm: concurrency
    limit: 20
    key_by: global
    reserve: {critical: 0.2, default: 0.05}
    match: {path: /search}
  - id: adaptive
    algorithm: concurrency
    limit: 10
    key_by: global
    adaptive: {min: 2, max: 20, target_latency: 10ms}
    reserve: {critical: 0.2, default: 0.05}
    match: {path: /adaptive}
  - id: shed
    capacity: 100
    refill_per_second: 0.001
    key_by: global
    reserve: {critical: 0.2, default: 0.05}
    match: {path: /rate}
`

// classEngine is an engine of region local on a memory store under the
// rules of yaml and opts, and its metrics' registry.
func classEngine(t *testing.T, yaml string, opts Options) (*Engine, *prometheus.Registry) {
	t.Helper()
	set, err := rules.Parse("priority.yml", []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	opts.Store, opts.Region, opts.Logger = newFaultStore(), "local", quietLogger()
	e, err := New(opts, set, reg)
	if err != nil {
		t.Fatal(err)
	}
	return e, reg
}

// setClass sets the priority class of a check, an Acquire or a usage;
// "-" leaves it unset.
func setClass(t *testing.T, r interface{ SetPriority(string) error }, class string) {
	t.Helper()
	if class == "-" {
		return
	}
	if err := r.SetPriority(class); err != nil {
		t.Fatal(err)
	}
}

// checkAs decides a check as class ("-": none set) of rule shed at cost
// and of each rule of also at 1, for key global (shed's key of an
// Acquire, keyed by global).
func checkAs(t *testing.T, e *Engine, class string, cost float64, also ...string) (*request.Check, bool) {
	t.Helper()
	c := e.NewCheck()
	setClass(t, c, class)
	if _, err := c.AddRule("shed", "global", cost); err != nil {
		t.Fatal(err)
	}
	for _, rule := range also {
		if _, err := c.AddRule(rule, "global", 1); err != nil {
			t.Fatal(err)
		}
	}
	ok, err := e.Decide(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	return c, ok
}

// priorityCheck checks rules shed and plain by class.
func priorityCheck(t *testing.T, e *Engine, class string, cost float64) (*request.Check, bool) {
	t.Helper()
	return checkAs(t, e, class, cost, "plain")
}

// acquireAs decides an Acquire as class ("-": none set) of the rules
// matching path; an allowed one holds its leases until released.
func acquireAs(t *testing.T, e *Engine, class, path string) (bool, *concurrency.Acquire, *concurrency.Lease) {
	t.Helper()
	c := e.NewAcquire()
	setClass(t, c, class)
	if _, _, err := c.AddAttributes(&rules.Attributes{Path: path}, 1); err != nil {
		t.Fatal(err)
	}
	ok, l, err := e.Acquire(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	return ok, c, l
}

// usageAs reads rule's usage of key as class ("-": none set) for a check
// of cost.
func usageAs(t *testing.T, e *Engine, class, rule, key string, cost float64) *usage.Item {
	t.Helper()
	u := e.NewUsage()
	setClass(t, u, class)
	if _, err := u.AddRule(rule, key, cost); err != nil {
		t.Fatal(err)
	}
	if err := e.Usage(context.Background(), u); err != nil {
		t.Fatal(err)
	}
	return u.Items()[0]
}

// wantDecisions holds limiter_priority_decisions_total, its help
// included, to want: per class, its allowed, limited and reserved
// decisions.
func wantDecisions(t *testing.T, reg *prometheus.Registry, want map[string][3]int) {
	t.Helper()
	var b strings.Builder
	b.WriteString(`
# HELP limiter_priority_decisions_total Checks and Acquires decided, by priority class (one of --priority.classes) and result (reserved: refused only for the reserves of the classes above it).
# TYPE limiter_priority_decisions_total counter
`)
	for _, class := range slices.Sorted(maps.Keys(want)) {
		for i, result := range []string{"allowed", "limited", "reserved"} {
			fmt.Fprintf(&b, "limiter_priority_decisions_total{class=%q,result=%q} %d\n", class, result, want[class][i])
		}
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(b.String()), "limiter_priority_decisions_total"); err != nil {
		t.Fatal(err)
	}
}

// checkStep is a check of shed at cost, and of plain, as class: allowed
// or not, and refused only for a reserve or not.
type checkStep struct {
	class    string
	cost     float64
	allowed  bool
	reserved bool
}

// checkSteps decides steps in order through priorityCheck.
func checkSteps(t *testing.T, e *Engine, steps []checkStep) {
	t.Helper()
	for _, step := range steps {
		c, ok := priorityCheck(t, e, step.class, step.cost)
		if ok != step.allowed || c.Reserved() != step.reserved {
			t.Fatalf("%q cost %v: allowed %v, reserved %v; want %v, %v", step.class, step.cost, ok, c.Reserved(), step.allowed, step.reserved)
		}
	}
}

// TestPriorityReserve: each class spends the shared bucket down to what
// it keeps for the classes above it; a refusal for the reserve only is
// Reserved and counted as such by class; the deny cache does not hold it
// against a more important class.
func TestPriorityReserve(t *testing.T) {
	e, reg := classEngine(t, priorityRules, Options{})
	checkSteps(t, e, []checkStep{
		{"sheddable", 75, true, false},
		{"sheddable", 1, false, true},
		{"", 5, true, false},              // default
		{"no-such-class", 1, false, true}, // default too
		{"sheddable", 1, false, true},
		{"critical", 20, true, false},
		{"critical", 1, false, false}, // empty: refused by the limit
	})
	wantDecisions(t, reg, map[string][3]int{"critical": {1, 1, 0}, "default": {1, 0, 1}, "sheddable": {1, 0, 2}})
}

// TestPriorityClassesConfigured: the classes and their order come from
// Options.Classes; a rule whose reserve names another class is refused.
func TestPriorityClassesConfigured(t *testing.T) {
	classes, err := rules.ParseClasses("gold,critical,default")
	if err != nil {
		t.Fatal(err)
	}
	e, _ := classEngine(t, priorityRules, Options{Classes: classes})
	// Default keeps the reserves of the classes above it: gold's (none)
	// and critical's (0.2).
	checkSteps(t, e, []checkStep{
		{"", 80, true, false},     // down to 20%
		{"", 1, false, true},      // into critical's reserve
		{"gold", 20, true, false}, // the rest
	})
	set, err := rules.Parse("r.yml", []byte("rules:\n  - id: a\n    capacity: 1\n    refill_per_second: 1\n    reserve: {sheddable: 0.5}\n"))
	if err != nil {
		t.Fatal(err)
	}
	var re *rules.Error
	if err := e.SetRules(set); !errors.As(err, &re) || re.Field != "reserve.sheddable" {
		t.Fatalf("SetRules with a class not configured = %v, want an *rules.Error naming reserve.sheddable", err)
	}
}

// TestPriorityInvalid: an over-long class name is invalid, naming
// priority, for a check and for an Acquire.
func TestPriorityInvalid(t *testing.T) {
	e, _ := classEngine(t, priorityRules, Options{})
	for name, r := range map[string]interface{ SetPriority(string) error }{"check": e.NewCheck(), "Acquire": e.NewAcquire()} {
		var inv *request.InvalidError
		if err := r.SetPriority(strings.Repeat("x", rules.MaxClassLen+1)); !errors.As(err, &inv) || inv.Field != "priority" {
			t.Fatalf("%s: SetPriority(33 bytes) = %v, want an InvalidError naming priority", name, err)
		}
	}
}

// TestPriorityPaced: a paced check of a class that keeps a reserve never
// waits, since waiting spends refill that a more important class
// arriving meanwhile would find gone: it is decided now, allowed with no
// wait above its reserve, refused (reserved) within it. A critical paced
// check keeps nothing and waits as any paced check does. The class may
// be set before or after the pacing.
func TestPriorityPaced(t *testing.T) {
	e, _ := classEngine(t, `
rules:
  - id: shed
    capacity: 100
    refill_per_second: 10
    key_by: global
    reserve: {critical: 0.2, default: 0.05}
`, Options{})
	paced := func(class string, cost float64, classFirst bool) (*request.Check, bool) {
		t.Helper()
		c := e.NewCheck()
		if classFirst {
			setClass(t, c, class)
		}
		if _, err := c.AddRule("shed", "global", cost); err != nil {
			t.Fatal(err)
		}
		if err := c.Pace(10 * time.Second); err != nil {
			t.Fatalf("Pace as %q: %v", class, err)
		}
		if !classFirst {
			setClass(t, c, class)
		}
		ok, err := e.Decide(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		return c, ok
	}
	for _, step := range []struct {
		class    string
		cost     float64
		first    bool
		allowed  bool
		reserved bool
		wait     bool
	}{
		{"sheddable", 75, true, true, false, false}, // 25 left
		{"sheddable", 1, false, false, true, false},
		{"", 5, true, true, false, false}, // default: 20 left
		{"", 1, false, false, true, false},
		{"critical", 20, false, true, false, false}, // empty
		{"critical", 1, true, true, false, true},    // waits 100 ms for refill
		{"sheddable", 1, true, false, false, false}, // in debt: refused by the limit
	} {
		c, ok := paced(step.class, step.cost, step.first)
		d := c.Enforce[0].Decision
		if ok != step.allowed || c.Reserved() != step.reserved || (d.Wait > 0) != step.wait {
			t.Fatalf("paced %q of %v: allowed %v, reserved %v, %+v; want %v, %v, a wait %v", step.class, step.cost, ok, c.Reserved(), d, step.allowed, step.reserved, step.wait)
		}
		if !ok && d.RetryAfter <= 0 {
			t.Fatalf("paced %q of %v refused without a retry: %+v", step.class, step.cost, d)
		}
	}
}

// TestPriorityAcquireDefault: an Acquire that names no priority class is
// default, so the rate rules it spends keep what the default class keeps:
// it is refused, as reserved, where a critical check still passes, and
// counted as default.
func TestPriorityAcquireDefault(t *testing.T) {
	e, reg := classEngine(t, `
rules:
  - id: inflight
    algorithm: concurrency
    limit: 10
    key_by: global
    match: {path: /search}
  - id: shed
    capacity: 100
    refill_per_second: 0.001
    key_by: global
    reserve: {critical: 0.2, default: 0.05}
    match: {path: /search}
`, Options{})
	// 79 spent: 21 left, one above what default keeps for critical (20).
	if _, ok := checkAs(t, e, "critical", 79); !ok {
		t.Fatal("critical could not spend 79 of 100")
	}
	ok, c, l := acquireAs(t, e, "-", "/search")
	if !ok || c.ClassName() != "default" {
		t.Fatalf("Acquire with 21 left: allowed %v as %q, want allowed as default", ok, c.ClassName())
	}
	if _, err := e.Concurrency().Release(context.Background(), l.ID, nil); err != nil {
		t.Fatal(err)
	}
	if ok, c, _ := acquireAs(t, e, "-", "/search"); ok || !c.Reserved() {
		t.Fatalf("Acquire with 20 left: allowed %v, reserved %v; want refused for critical's reserve", ok, c.Reserved())
	}
	if _, ok := checkAs(t, e, "critical", 1); !ok {
		t.Fatal("critical refused with 20 left")
	}
	wantDecisions(t, reg, map[string][3]int{"critical": {2, 0, 0}, "default": {1, 0, 1}, "sheddable": {0, 0, 0}})
}

// TestPriorityUsage: a usage answers what a check of its priority class
// would see, default when it names none: refused, as reserved, where the
// bucket has only what a more important class keeps, with the retry of
// such a check; the remaining is the bucket's whatever the class.
func TestPriorityUsage(t *testing.T) {
	e, _ := classEngine(t, priorityRules, Options{})
	// 79 spent: 21 left.
	if _, ok := priorityCheck(t, e, "critical", 79); !ok {
		t.Fatal("critical could not spend 79")
	}
	for _, step := range []struct {
		class    string
		cost     float64
		allowed  bool
		reserved bool
	}{
		{"-", 1, true, false}, // no class: default, which keeps 20
		{"-", 2, false, true},
		{"", 2, false, true},
		{"default", 1, true, false},
		{"sheddable", 1, false, true}, // keeps 25
		{"critical", 21, true, false},
		{"critical", 22, false, false},
	} {
		d := usageAs(t, e, step.class, "shed", "global", step.cost).Usage
		if d.Allowed != step.allowed || d.Reserved != step.reserved || math.Abs(d.Remaining-21) > 1e-3 {
			t.Fatalf("usage as %q of %v: %+v; want allowed %v, reserved %v, 21 left", step.class, step.cost, d, step.allowed, step.reserved)
		}
		if d.Allowed {
			continue
		}
		// A check refused spends nothing: it answers as the usage did,
		// its retry a few µs of the store's clock later.
		c, ok := priorityCheck(t, e, step.class, step.cost)
		if ok || c.Reserved() != d.Reserved || (d.RetryAfter-c.Enforce[0].Decision.RetryAfter).Abs() > time.Millisecond {
			t.Fatalf("usage as %q of %v said %+v, a check then %v with %+v", step.class, step.cost, d, ok, c.Enforce[0].Decision)
		}
	}
}

// TestPriorityAcquireReserve: an Acquire of a class takes a lease of a
// concurrency rule with a reserve only while fewer than the limit less
// what its class keeps are held, refused as reserved below the limit; the
// rate rules it spends keep what its class keeps. A lease refused for the
// reserve counts as reserved.
func TestPriorityAcquireReserve(t *testing.T) {
	e, reg := classEngine(t, leaseRules, Options{})
	for _, step := range []struct {
		class    string
		path     string
		n        int
		allowed  bool
		reserved bool
	}{
		{"sheddable", "/search", 15, true, false},
		// 15 held: sheddable keeps 5 of 20, default 4.
		{"sheddable", "/search", 1, false, true},
		{"", "/search", 1, true, false}, // default, no class
		{"default", "/search", 1, false, true},
		{"critical", "/search", 4, true, false},
		{"critical", "/search", 1, false, false}, // at the limit
		// The rate rules: 80 spent, 20 left, what default keeps for
		// critical.
		{"critical", "/rate", 80, true, false},
		{"default", "/rate", 1, false, true},
		{"critical", "/rate", 1, true, false},
	} {
		for i := range step.n {
			ok, c, _ := acquireAs(t, e, step.class, step.path)
			if ok != step.allowed || c.Reserved() != step.reserved {
				t.Fatalf("%q of %s, %d of %d: allowed %v, reserved %v; want %v, %v", step.class, step.path, i+1, step.n, ok, c.Reserved(), step.allowed, step.reserved)
			}
			if !ok && step.path == "/search" && c.Leases()[0].Decision.RetryAfter <= 0 {
				t.Fatalf("%q of %s refused without a retry: %+v", step.class, step.path, c.Leases()[0].Decision)
			}
		}
	}
	wantDecisions(t, reg, map[string][3]int{"critical": {85, 1, 0}, "default": {1, 0, 2}, "sheddable": {15, 0, 1}})
}

// TestPriorityLeaseUsage: a usage of a concurrency rule with a reserve
// answers what an Acquire of its class would see: leases free out of its
// class's room, refused as reserved where only the reserve of a more
// important class is left, with the retry of such an Acquire; the limit
// is the key's, adaptive or not, and the leases held whatever the class.
func TestPriorityLeaseUsage(t *testing.T) {
	e, _ := classEngine(t, leaseRules, Options{})
	ctx := context.Background()
	paths := map[string]string{"inflight": "/search", "adaptive": "/adaptive"}
	// 15 of inflight's 20 held: sheddable's room (20 - 5).
	for range 15 {
		if ok, _, _ := acquireAs(t, e, "sheddable", "/search"); !ok {
			t.Fatal("sheddable lease refused below its room")
		}
	}
	// 7 of adaptive's, whose limit a failure cut from 10 to 9: sheddable's
	// room is 9 - 2.
	var first *concurrency.Lease
	for range 8 {
		ok, _, l := acquireAs(t, e, "critical", "/adaptive")
		if !ok {
			t.Fatal("critical lease of the adaptive rule refused")
		}
		if first == nil {
			first = l
		}
	}
	if ok, err := e.Concurrency().Release(ctx, first.ID, &bucket.LeaseSample{Failed: true}); err != nil || !ok {
		t.Fatalf("release of a failed request: %v, %v", ok, err)
	}
	for _, step := range []struct {
		rule      string
		class     string
		limit     float64
		held      int
		remaining float64
		allowed   bool
		reserved  bool
	}{
		{"inflight", "sheddable", 20, 15, 0, false, true},
		{"inflight", "default", 20, 15, 1, true, false},
		{"inflight", "-", 20, 15, 1, true, false}, // no class: default
		{"inflight", "critical", 20, 15, 5, true, false},
		{"adaptive", "sheddable", 9, 7, 0, false, true},
		{"adaptive", "default", 9, 7, 1, true, false},
		{"adaptive", "critical", 9, 7, 2, true, false},
	} {
		it := usageAs(t, e, step.class, step.rule, "global", 0)
		d := it.Usage
		if d.Allowed != step.allowed || d.Reserved != step.reserved || d.Limit != step.limit || d.Remaining != step.remaining || it.Held() != step.held {
			t.Fatalf("%s as %q: %+v, %d held; want allowed %v, reserved %v, %v of %v left, %d held",
				step.rule, step.class, d, it.Held(), step.allowed, step.reserved, step.remaining, step.limit, step.held)
		}
		if d.Allowed {
			if d.RetryAfter != 0 {
				t.Fatalf("%s as %q: allowed with a retry: %+v", step.rule, step.class, d)
			}
			continue
		}
		// An Acquire refused holds nothing: it answers as the usage did.
		ok, c, _ := acquireAs(t, e, step.class, paths[step.rule])
		ld := c.Leases()[0].Decision
		if ok || ld.Reserved != d.Reserved || (d.RetryAfter-ld.RetryAfter).Abs() > time.Millisecond || d.RetryAfter <= 0 {
			t.Fatalf("%s: usage as %q said %+v, an Acquire then %v with %+v", step.rule, step.class, d, ok, ld)
		}
	}
	// At the limit every class is refused by it, none for a reserve.
	for range 5 {
		if ok, _, _ := acquireAs(t, e, "critical", "/search"); !ok {
			t.Fatal("critical lease refused below the limit")
		}
	}
	for _, class := range []string{"critical", "sheddable"} {
		if it := usageAs(t, e, class, "inflight", "global", 0); it.Usage.Allowed || it.Usage.Reserved || it.Usage.Remaining != 0 || it.Held() != 20 || it.Usage.RetryAfter <= 0 {
			t.Fatalf("inflight full, as %q: %+v, %d held", class, it.Usage, it.Held())
		}
	}
}
