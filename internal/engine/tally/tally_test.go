package tally

import (
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/topkeys"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// spend is one SpendRecorder.AddPaced.
type spend struct {
	rule, key          string
	cost, budget, rate float64
}

type recorder struct{ got []spend }

func (r *recorder) AddPaced(rule, key string, cost, budget, rate float64, admittedMicros int64) {
	r.got = append(r.got, spend{rule, key, cost, budget, rate})
}

// newTally returns a Tally over the rules of yaml, its table and its
// recorder, with fleet instances in the region.
func newTally(t *testing.T, yaml string, fleet int, affinity bool) (*Tally, *request.Table, *recorder) {
	t.Helper()
	m, err := metrics.New(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	set, err := rules.Parse("rules.yml", []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	return &Tally{Metrics: m, Top: topkeys.New(64), Spends: rec, Fleet: func() int { return fleet }, KeyAffinity: affinity},
		request.NewTable(set, 1, 1, nil, m, nil), rec
}

const tallyRules = `rules:
  - id: api
    capacity: 100
    refill_per_second: 10
  - id: local
    capacity: 100
    refill_per_second: 10
    reconcile: false
`

func item(tb *request.Table, rule, key string, cost float64, route request.Route, allowed bool) *request.Item {
	en := tb.ByID[rule]
	return &request.Item{Rule: en.Rule, Key: key, Cost: cost, Entry: en, Limits: en.For(key), Route: route, Decision: bucket.Decision{Allowed: allowed}}
}

// TestCountRecordsSpends: an admitted check of a reconciled rule records
// its cost with the instance's share of the rule's budget (the rule's
// whole budget with key affinity); a check decided elsewhere (a home
// region, a lease taken earlier) or of a rule not reconciled records
// nothing; a batch taken from the store records the batch.
func TestCountRecordsSpends(t *testing.T) {
	for _, c := range []struct {
		name     string
		fleet    int
		affinity bool
		budget   float64
	}{
		{"alone", 1, false, 10},
		{"fleet of 4", 4, false, 2.5},
		{"fleet of 4, key affinity", 4, true, 10},
		{"fleet unknown", 0, false, 10},
	} {
		t.Run(c.name, func(t *testing.T) {
			ta, tb, rec := newTally(t, tallyRules, c.fleet, c.affinity)
			batch := item(tb, "api", "b", 1, request.RouteStore, true)
			batch.Batch = 5
			req := &request.Request{Table: tb, Metrics: ta.Metrics, Enforce: []*request.Item{
				item(tb, "api", "a", 2, request.RouteStore, true),
				item(tb, "api", "home", 1, request.RouteHome, true),
				item(tb, "api", "lease", 1, request.RouteLease, true),
				item(tb, "local", "a", 3, request.RouteStore, true),
				batch,
				item(tb, "api", "fallback", 1, request.RouteFallback, true),
			}}
			ta.Count(req, true)
			want := []spend{{"api", "a", 2, c.budget, 10}, {"api", "b", 5, c.budget, 10}, {"api", "fallback", 1, c.budget, 10}}
			if len(rec.got) != len(want) {
				t.Fatalf("recorded %v, want %v", rec.got, want)
			}
			for i := range want {
				if rec.got[i] != want[i] {
					t.Errorf("spend %d: %+v, want %+v", i, rec.got[i], want[i])
				}
			}
			en := tb.ByID["api"]
			for name, c := range map[string]struct {
				counter prometheus.Counter
				want    float64
			}{
				"allowed":           {en.Allowed, 3}, // a, lease, b
				"leased":            {en.Leased, 1},
				"forwarded allowed": {en.ForwardedAllowed, 1},
				"fallback allowed":  {en.FallbackAllowed, 1},
				"admitted cost":     {en.AdmittedCost, 2 + 1 + 1 + 1 + 1},
			} {
				if got := testutil.ToFloat64(c.counter); got != c.want {
					t.Errorf("%s: %v, want %v", name, got, c.want)
				}
			}
		})
	}
}

// TestCountRefusals: a refused check counts each rule that refused it by
// where it was decided and adds its key to the rule's top refused keys;
// the rules that allowed it or were not reached count nothing and record
// no spend.
func TestCountRefusals(t *testing.T) {
	ta, tb, rec := newTally(t, tallyRules, 1, false)
	req := &request.Request{Table: tb, Metrics: ta.Metrics, Enforce: []*request.Item{
		item(tb, "api", "store", 1, request.RouteStore, false),
		item(tb, "api", "deny", 1, request.RouteDeny, false),
		item(tb, "api", "home", 1, request.RouteHome, false),
		item(tb, "api", "fallback", 1, request.RouteFallback, false),
		item(tb, "local", "allowed", 1, request.RouteStore, true),
		item(tb, "local", "unreached", 1, request.RouteNone, false),
	}}
	ta.Count(req, false)
	if len(rec.got) != 0 {
		t.Errorf("a refused check recorded spends %v", rec.got)
	}
	en := tb.ByID["api"]
	for name, c := range map[string]struct {
		counter prometheus.Counter
		want    float64
	}{
		"limited":           {en.Limited, 2}, // the store's and the deny cache's
		"deny hits":         {en.DenyHits, 1},
		"forwarded limited": {en.ForwardedLimited, 1},
		"fallback limited":  {en.FallbackLimited, 1},
		"admitted cost":     {en.AdmittedCost, 0},
		"local allowed":     {tb.ByID["local"].Allowed, 0},
	} {
		if got := testutil.ToFloat64(c.counter); got != c.want {
			t.Errorf("%s: %v, want %v", name, got, c.want)
		}
	}
	now := time.Now().UnixNano()
	if got := ta.Top.Rules(now); !slices.Equal(got, []string{"api"}) {
		t.Errorf("rules with refused keys %v, want [api]", got)
	}
	var keys []string
	for _, e := range ta.Top.Top("api", 10, now) {
		keys = append(keys, e.Key)
	}
	slices.Sort(keys)
	if want := []string{"deny", "fallback", "home", "store"}; !slices.Equal(keys, want) {
		t.Errorf("top refused keys of api %v, want %v", keys, want)
	}
}

// TestCountAcquires: an Acquire is counted by its class as a check is:
// allowed; limited when a lease or a rate rule refused it at a limit;
// reserved when what refused it was only its class's reserve, of a lease
// or of a rate rule.
func TestCountAcquires(t *testing.T) {
	ta, tb, _ := newTally(t, tallyRules+`  - id: inflight
    algorithm: concurrency
    limit: 10
    reserve: {critical: 0.2, default: 0.05}
`, 1, false)
	lease := func(allowed, reserved bool) *request.Item {
		it := item(tb, "inflight", "k", 1, request.RouteStore, allowed)
		it.Decision.Reserved = reserved
		return it
	}
	rate := func(allowed, reserved bool) []*request.Item {
		it := item(tb, "api", "k", 1, request.RouteStore, allowed)
		it.Decision.Reserved = reserved
		return []*request.Item{it}
	}
	for _, c := range []struct {
		class   string
		leased  *request.Item
		enforce []*request.Item
		allowed bool
	}{
		{"sheddable", lease(true, false), nil, true},
		{"sheddable", lease(true, false), rate(true, false), true},
		{"sheddable", lease(false, true), nil, false},
		{"sheddable", lease(true, false), rate(false, true), false},
		{"default", lease(false, false), nil, false},
		{"default", lease(true, false), rate(false, false), false},
		{"critical", lease(true, false), nil, true},
	} {
		req := &request.Request{Table: tb, Metrics: ta.Metrics, Leased: []*request.Item{c.leased}, Enforce: c.enforce}
		if err := req.SetPriority(c.class); err != nil {
			t.Fatal(err)
		}
		ta.Count(req, c.allowed)
	}
	for _, want := range []struct {
		class, result string
		n             float64
	}{
		{"sheddable", metrics.PriorityAllowed, 2},
		{"sheddable", metrics.PriorityReserved, 2},
		{"sheddable", metrics.PriorityLimited, 0},
		{"default", metrics.PriorityLimited, 2},
		{"default", metrics.PriorityReserved, 0},
		{"critical", metrics.PriorityAllowed, 1},
	} {
		if got := testutil.ToFloat64(ta.Metrics.PriorityDecisions.WithLabelValues(want.class, want.result)); got != want.n {
			t.Errorf("limiter_priority_decisions_total{class=%q,result=%q} = %v, want %v", want.class, want.result, got, want.n)
		}
	}
}

// TestCountPacesBuckets: a token bucket's or GCRA's spend is recorded with
// its refill rate, for the accumulator to pace it; a window's, and a
// settlement's change, with none.
func TestCountPacesBuckets(t *testing.T) {
	ta, tb, rec := newTally(t, `rules:
  - id: tb
    capacity: 100
    refill_per_second: 10
  - id: gcra
    algorithm: gcra
    capacity: 10
    refill_per_second: 2.5
  - id: win
    algorithm: fixed_window
    limit: 100
    window: 1m
`, 1, false)
	ta.Count(&request.Request{Table: tb, Metrics: ta.Metrics, Enforce: []*request.Item{
		item(tb, "tb", "a", 1, request.RouteStore, true),
		item(tb, "gcra", "a", 1, request.RouteStore, true),
		item(tb, "win", "a", 1, request.RouteStore, true),
	}}, true)
	ta.Settled(tb.ByID["tb"], "a", -0.5)
	want := []float64{10, 2.5, 0, 0}
	if len(rec.got) != len(want) {
		t.Fatalf("recorded %v, want %d spends", rec.got, len(want))
	}
	for i, w := range want {
		if rec.got[i].rate != w {
			t.Errorf("spend %d (%s, cost %v): rate %v, want %v", i, rec.got[i].rule, rec.got[i].cost, rec.got[i].rate, w)
		}
	}
}
