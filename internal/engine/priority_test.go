package engine

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

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

func priorityEngine(t *testing.T, opts Options) (*Engine, *prometheus.Registry) {
	t.Helper()
	set, err := rules.Parse("priority.yml", []byte(priorityRules))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	opts.Store, opts.Logger = newFaultStore(), quietLogger()
	e, err := New(opts, set, reg)
	if err != nil {
		t.Fatal(err)
	}
	return e, reg
}

// priorityCheck checks rules shed and plain for key by class.
func priorityCheck(t *testing.T, e *Engine, class string, cost float64) (*request.Check, bool) {
	t.Helper()
	c := e.NewCheck()
	if err := c.SetPriority(class); err != nil {
		t.Fatal(err)
	}
	if _, err := c.AddRule("shed", "all", cost); err != nil {
		t.Fatal(err)
	}
	if _, err := c.AddRule("plain", "all", 1); err != nil {
		t.Fatal(err)
	}
	ok, err := e.Decide(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	return c, ok
}

// TestPriorityReserve: each class spends the shared bucket down to what
// it keeps for the classes above it; a refusal for the reserve only is
// Reserved and counted as such by class; the deny cache does not hold it
// against a more important class.
func TestPriorityReserve(t *testing.T) {
	e, reg := priorityEngine(t, Options{})
	for _, step := range []struct {
		class    string
		cost     float64
		allowed  bool
		reserved bool
	}{
		{"sheddable", 75, true, false},
		{"sheddable", 1, false, true},
		{"", 5, true, false},              // default
		{"no-such-class", 1, false, true}, // default too
		{"sheddable", 1, false, true},
		{"critical", 20, true, false},
		{"critical", 1, false, false}, // empty: refused by the limit
	} {
		c, ok := priorityCheck(t, e, step.class, step.cost)
		if ok != step.allowed || c.Reserved() != step.reserved {
			t.Fatalf("%q cost %v: allowed %v, reserved %v; want %v, %v", step.class, step.cost, ok, c.Reserved(), step.allowed, step.reserved)
		}
	}
	want := `
# HELP limiter_priority_decisions_total Checks and Acquires decided, by priority class (one of --priority.classes) and result (reserved: refused only for the reserves of the classes above it).
# TYPE limiter_priority_decisions_total counter
limiter_priority_decisions_total{class="critical",result="allowed"} 1
limiter_priority_decisions_total{class="critical",result="limited"} 1
limiter_priority_decisions_total{class="critical",result="reserved"} 0
limiter_priority_decisions_total{class="default",result="allowed"} 1
limiter_priority_decisions_total{class="default",result="limited"} 0
limiter_priority_decisions_total{class="default",result="reserved"} 1
limiter_priority_decisions_total{class="sheddable",result="allowed"} 1
limiter_priority_decisions_total{class="sheddable",result="limited"} 0
limiter_priority_decisions_total{class="sheddable",result="reserved"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "limiter_priority_decisions_total"); err != nil {
		t.Fatal(err)
	}
}

// TestPriorityClassesConfigured: the classes and their order come from
// Options.Classes; a rule whose reserve names another class is refused.
func TestPriorityClassesConfigured(t *testing.T) {
	classes, err := rules.ParseClasses("gold,critical,default")
	if err != nil {
		t.Fatal(err)
	}
	e, _ := priorityEngine(t, Options{Classes: classes})
	// Default keeps the reserves of the classes above it: gold's (none)
	// and critical's (0.2).
	if _, ok := priorityCheck(t, e, "", 80); !ok {
		t.Fatal("default could not spend down to 20%")
	}
	if c, ok := priorityCheck(t, e, "", 1); ok || !c.Reserved() {
		t.Fatal("default spent into critical's reserve")
	}
	if _, ok := priorityCheck(t, e, "gold", 20); !ok {
		t.Fatal("gold could not spend the rest")
	}
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
// priority.
func TestPriorityInvalid(t *testing.T) {
	e, _ := priorityEngine(t, Options{})
	c := e.NewCheck()
	var inv *request.InvalidError
	if err := c.SetPriority(strings.Repeat("x", rules.MaxClassLen+1)); !errors.As(err, &inv) || inv.Field != "priority" {
		t.Fatalf("SetPriority(33 bytes) = %v, want an InvalidError naming priority", err)
	}
}

// TestPriorityPaced: a paced check of a class that keeps a reserve never
// waits, since waiting spends refill that a more important class
// arriving meanwhile would find gone: it is decided now, allowed with no
// wait above its reserve, refused (reserved) within it. A critical paced
// check keeps nothing and waits as any paced check does. The class may
// be set before or after the pacing.
func TestPriorityPaced(t *testing.T) {
	set, err := rules.Parse("paced.yml", []byte(`
rules:
  - id: shed
    capacity: 100
    refill_per_second: 10
    key_by: global
    reserve: {critical: 0.2, default: 0.05}
`))
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Store: newFaultStore(), Logger: quietLogger()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	paced := func(class string, cost float64, classFirst bool) (*request.Check, bool) {
		t.Helper()
		c := e.NewCheck()
		if classFirst {
			if err := c.SetPriority(class); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := c.AddRule("shed", "all", cost); err != nil {
			t.Fatal(err)
		}
		if err := c.Pace(10 * time.Second); err != nil {
			t.Fatalf("Pace as %q: %v", class, err)
		}
		if !classFirst {
			if err := c.SetPriority(class); err != nil {
				t.Fatal(err)
			}
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
	set, err := rules.Parse("acquire.yml", []byte(`
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
`))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	e, err := New(Options{Store: newFaultStore(), Region: "local", Logger: quietLogger()}, set, reg)
	if err != nil {
		t.Fatal(err)
	}
	acquire := func() (bool, *request.Request) {
		t.Helper()
		c := e.NewAcquire()
		if _, _, err := c.AddAttributes(&rules.Attributes{Path: "/search"}, 1); err != nil {
			t.Fatal(err)
		}
		ok, l, err := e.Acquire(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			if _, err := e.Concurrency().Release(context.Background(), l.ID, nil); err != nil {
				t.Fatal(err)
			}
		}
		return ok, &c.Request
	}
	check := func(class string, cost float64) bool {
		t.Helper()
		c := e.NewCheck()
		if err := c.SetPriority(class); err != nil {
			t.Fatal(err)
		}
		if _, err := c.AddRule("shed", "global", cost); err != nil {
			t.Fatal(err)
		}
		ok, err := e.Decide(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	// 79 spent: 21 left, one above what default keeps for critical (20).
	if !check("critical", 79) {
		t.Fatal("critical could not spend 79 of 100")
	}
	if ok, c := acquire(); !ok || c.ClassName() != "default" {
		t.Fatalf("Acquire with 21 left: allowed %v as %q, want allowed as default", ok, c.ClassName())
	}
	if ok, c := acquire(); ok || !c.Reserved() {
		t.Fatalf("Acquire with 20 left: allowed %v, reserved %v; want refused for critical's reserve", ok, c.Reserved())
	}
	if !check("critical", 1) {
		t.Fatal("critical refused with 20 left")
	}
	want := `
# HELP limiter_priority_decisions_total Checks and Acquires decided, by priority class (one of --priority.classes) and result (reserved: refused only for the reserves of the classes above it).
# TYPE limiter_priority_decisions_total counter
limiter_priority_decisions_total{class="critical",result="allowed"} 2
limiter_priority_decisions_total{class="critical",result="limited"} 0
limiter_priority_decisions_total{class="critical",result="reserved"} 0
limiter_priority_decisions_total{class="default",result="allowed"} 1
limiter_priority_decisions_total{class="default",result="limited"} 0
limiter_priority_decisions_total{class="default",result="reserved"} 1
limiter_priority_decisions_total{class="sheddable",result="allowed"} 0
limiter_priority_decisions_total{class="sheddable",result="limited"} 0
limiter_priority_decisions_total{class="sheddable",result="reserved"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "limiter_priority_decisions_total"); err != nil {
		t.Fatal(err)
	}
}

// TestPriorityUsage: a usage answers what a check of its priority class
// would see, default when it names none: refused, as reserved, where the
// bucket has only what a more important class keeps, with the retry of
// such a check; the remaining is the bucket's whatever the class.
func TestPriorityUsage(t *testing.T) {
	e, _ := priorityEngine(t, Options{})
	// 79 spent: 21 left.
	if _, ok := priorityCheck(t, e, "critical", 79); !ok {
		t.Fatal("critical could not spend 79")
	}
	read := func(class string, cost float64) bucket.Decision {
		t.Helper()
		u := e.NewUsage()
		if class != "-" {
			if err := u.SetPriority(class); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := u.AddRule("shed", "all", cost); err != nil {
			t.Fatal(err)
		}
		if err := e.Usage(context.Background(), u); err != nil {
			t.Fatal(err)
		}
		return u.Items()[0].Usage
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
		d := read(step.class, step.cost)
		if d.Allowed != step.allowed || d.Reserved != step.reserved || math.Abs(d.Remaining-21) > 1e-3 {
			t.Fatalf("usage as %q of %v: %+v; want allowed %v, reserved %v, 21 left", step.class, step.cost, d, step.allowed, step.reserved)
		}
		if d.Allowed {
			continue
		}
		// A check refused spends nothing: it answers as the usage did,
		// its retry a few µs of the store's clock later.
		c, ok := priorityCheck(t, e, strings.Trim(step.class, "-"), step.cost)
		if ok || c.Reserved() != d.Reserved || (d.RetryAfter-c.Enforce[0].Decision.RetryAfter).Abs() > time.Millisecond {
			t.Fatalf("usage as %q of %v said %+v, a check then %v with %+v", step.class, step.cost, d, ok, c.Enforce[0].Decision)
		}
	}
}

// TestPriorityAcquireReserve: an Acquire of a class takes a lease of a
// concurrency rule with a reserve only while fewer than the limit less
// what its class keeps are held, refused as reserved below the limit; the
// rate rules it spends keep what its class keeps.
func TestPriorityAcquireReserve(t *testing.T) {
	set, err := rules.Parse("acquire.yml", []byte(`
rules:
  - id: inflight
    algorithm: concurrency
    limit: 20
    key_by: global
    reserve: {critical: 0.2, default: 0.05}
    match: {path: /search}
  - id: shed
    capacity: 100
    refill_per_second: 0.001
    key_by: global
    reserve: {critical: 0.2, default: 0.05}
    match: {path: /rate}
`))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	e, err := New(Options{Store: newFaultStore(), Region: "local", Logger: quietLogger()}, set, reg)
	if err != nil {
		t.Fatal(err)
	}
	acquire := func(class, path string) (bool, []*request.Item) {
		t.Helper()
		c := e.NewAcquire()
		if err := c.SetPriority(class); err != nil {
			t.Fatal(err)
		}
		if _, _, err := c.AddAttributes(&rules.Attributes{Path: path}, 1); err != nil {
			t.Fatal(err)
		}
		ok, _, err := e.Acquire(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		return ok, append(c.Leases(), c.Enforced()...)
	}
	for i := range 15 {
		if ok, _ := acquire("sheddable", "/search"); !ok {
			t.Fatalf("sheddable lease %d refused", i+1)
		}
	}
	// 15 held: sheddable keeps 5 of 20, default 4.
	if ok, items := acquire("sheddable", "/search"); ok || !request.Reserved(items) || items[0].Decision.RetryAfter <= 0 {
		t.Fatalf("sheddable with 15 held: allowed %v, reserved %v", ok, request.Reserved(items))
	}
	if ok, _ := acquire("", "/search"); !ok {
		t.Fatal("default (no class) with 15 held refused")
	}
	if ok, items := acquire("default", "/search"); ok || !request.Reserved(items) {
		t.Fatalf("default with 16 held: allowed %v, reserved %v", ok, request.Reserved(items))
	}
	for i := 16; i < 20; i++ {
		if ok, _ := acquire("critical", "/search"); !ok {
			t.Fatalf("critical lease %d refused", i+1)
		}
	}
	if ok, items := acquire("critical", "/search"); ok || request.Reserved(items) {
		t.Fatalf("critical at the limit: allowed %v, reserved %v", ok, request.Reserved(items))
	}
	// The rate rules: 80 spent, 20 left, what default keeps for critical.
	for range 80 {
		if ok, _ := acquire("critical", "/rate"); !ok {
			t.Fatal("critical spend refused")
		}
	}
	if ok, items := acquire("default", "/rate"); ok || !request.Reserved(items) {
		t.Fatalf("default spend with 20 left: allowed %v, reserved %v", ok, request.Reserved(items))
	}
	if ok, _ := acquire("critical", "/rate"); !ok {
		t.Fatal("critical spend with 20 left refused")
	}
	// A lease refused for the reserve counts as reserved.
	want := `
# HELP limiter_priority_decisions_total Checks and Acquires decided, by priority class (one of --priority.classes) and result (reserved: refused only for the reserves of the classes above it).
# TYPE limiter_priority_decisions_total counter
limiter_priority_decisions_total{class="critical",result="allowed"} 85
limiter_priority_decisions_total{class="critical",result="limited"} 1
limiter_priority_decisions_total{class="critical",result="reserved"} 0
limiter_priority_decisions_total{class="default",result="allowed"} 1
limiter_priority_decisions_total{class="default",result="limited"} 0
limiter_priority_decisions_total{class="default",result="reserved"} 2
limiter_priority_decisions_total{class="sheddable",result="allowed"} 15
limiter_priority_decisions_total{class="sheddable",result="limited"} 0
limiter_priority_decisions_total{class="sheddable",result="reserved"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "limiter_priority_decisions_total"); err != nil {
		t.Fatal(err)
	}
	c := e.NewAcquire()
	var ie *request.InvalidError
	if err := c.SetPriority(strings.Repeat("x", rules.MaxClassLen+1)); !errors.As(err, &ie) || ie.Field != "priority" {
		t.Fatalf("SetPriority of a long class = %v, want an InvalidError naming priority", err)
	}
}

// TestPriorityLeaseUsage: a usage of a concurrency rule with a reserve
// answers what an Acquire of its class would see: leases free out of its
// class's room, refused as reserved where only the reserve of a more
// important class is left, with the retry of such an Acquire; the limit
// is the key's, adaptive or not, and the leases held whatever the class.
func TestPriorityLeaseUsage(t *testing.T) {
	set, err := rules.Parse("leases.yml", []byte(`
rules:
  - id: inflight
    algorithm: concurrency
    limit: 20
    key_by: global
    reserve: {critical: 0.2, default: 0.05}
  - id: adaptive
    algorithm: concurrency
    limit: 10
    key_by: global
    adaptive: {min: 2, max: 20, target_latency: 10ms}
    reserve: {critical: 0.2, default: 0.05}
`))
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Store: newFaultStore(), Region: "local", Logger: quietLogger()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	acquire := func(rule, class string) (bool, *request.Item, string) {
		t.Helper()
		c := e.NewAcquire()
		if err := c.SetPriority(class); err != nil {
			t.Fatal(err)
		}
		it, err := c.AddRule(rule, "global", 1)
		if err != nil {
			t.Fatal(err)
		}
		ok, l, err := e.Acquire(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return false, it, ""
		}
		return true, it, l.ID
	}
	read := func(rule, class string) *usage.Item {
		t.Helper()
		u := e.NewUsage()
		if class != "-" {
			if err := u.SetPriority(class); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := u.AddRule(rule, "global", 0); err != nil {
			t.Fatal(err)
		}
		if err := e.Usage(ctx, u); err != nil {
			t.Fatal(err)
		}
		return u.Items()[0]
	}
	// 15 of inflight's 20 held: sheddable's room (20 - 5).
	for range 15 {
		if ok, _, _ := acquire("inflight", "sheddable"); !ok {
			t.Fatal("sheddable lease refused below its room")
		}
	}
	// 7 of adaptive's, whose limit a failure cut from 10 to 9: sheddable's
	// room is 9 - 2.
	var ids []string
	for range 8 {
		ok, _, id := acquire("adaptive", "critical")
		if !ok {
			t.Fatal("critical lease of the adaptive rule refused")
		}
		ids = append(ids, id)
	}
	if ok, err := e.Concurrency().Release(ctx, ids[0], &bucket.LeaseSample{Failed: true}); err != nil || !ok {
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
		it := read(step.rule, step.class)
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
		ok, lit, _ := acquire(step.rule, strings.Trim(step.class, "-"))
		if ok || lit.Decision.Reserved != d.Reserved || (d.RetryAfter-lit.Decision.RetryAfter).Abs() > time.Millisecond || d.RetryAfter <= 0 {
			t.Fatalf("%s: usage as %q said %+v, an Acquire then %v with %+v", step.rule, step.class, d, ok, lit.Decision)
		}
	}
	// At the limit every class is refused by it, none for a reserve.
	for range 5 {
		if ok, _, _ := acquire("inflight", "critical"); !ok {
			t.Fatal("critical lease refused below the limit")
		}
	}
	for _, class := range []string{"critical", "sheddable"} {
		if it := read("inflight", class); it.Usage.Allowed || it.Usage.Reserved || it.Usage.Remaining != 0 || it.Held() != 20 || it.Usage.RetryAfter <= 0 {
			t.Fatalf("inflight full, as %q: %+v, %d held", class, it.Usage, it.Held())
		}
	}
}
