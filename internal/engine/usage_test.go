package engine

import (
	"context"
	"errors"
	"math"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/usage"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// peerUsage is what the engine answers a peer's Home.Usage.
func peerUsage(ctx context.Context, e *Engine, origin string, items []homes.Item) ([]bucket.Decision, error) {
	u := e.NewUsage()
	u.FromPeer(origin)
	if err := u.AddItems(items); err != nil {
		return nil, err
	}
	if err := e.Usage(ctx, u); err != nil {
		return nil, err
	}
	return u.Decisions(), nil
}

// readUsage reads one rule's usage of key through e.
func readUsage(t *testing.T, e *Engine, rule, key string) usage.Item {
	t.Helper()
	u := e.NewUsage()
	if _, err := u.AddRule(rule, key, 0); err != nil {
		t.Fatal(err)
	}
	if err := e.Usage(context.Background(), u); err != nil {
		t.Fatal(err)
	}
	return *u.Items()[0]
}

// TestUsageRemembersNoDenial: a usage of an empty bucket says a check
// would be refused, and leaves no denial in the deny cache (a check's
// refusal does), nor any state: it answers the same twice.
func TestUsageRemembersNoDenial(t *testing.T) {
	r := twoRegions(t)
	ctx := context.Background()
	for range 8 {
		if ok, err := decideRules(ctx, t, r.east, "k", "open"); !ok || err != nil {
			t.Fatalf("check = %v, %v", ok, err)
		}
	}
	denials := r.east.deny.Len()
	first := readUsage(t, r.east, "open", "k")
	if first.Usage.Allowed || first.Usage.Remaining > 1e-6 || first.Usage.RetryAfter <= 0 {
		t.Fatalf("usage of an empty bucket = %+v, want refused with a retry", first.Usage)
	}
	if n := r.east.deny.Len(); n != denials {
		t.Fatalf("usage left %d denials in the deny cache, %d before", n, denials)
	}
	if again := readUsage(t, r.east, "open", "k"); again.Usage.Allowed || again.Usage.Remaining > 1e-6 || again.Usage.Limit != 8 {
		t.Fatalf("second usage = %+v, first %+v", again.Usage, first.Usage)
	}
	if ok, err := decideRules(ctx, t, r.east, "k", "open"); ok || err != nil {
		t.Fatalf("check after usage = %v, %v; want refused", ok, err)
	}
	if n := r.east.deny.Len(); n == 0 {
		t.Fatal("a refused check left no denial: the cache is off")
	}
}

// TestUsagePinnedAtHome: a pinned rule's key homed in another region is
// read there, not in this region's store.
func TestUsagePinnedAtHome(t *testing.T) {
	r := twoRegions(t)
	ctx := context.Background()
	for range 3 {
		if ok, err := decideRules(ctx, t, r.east, "u1", "pinned"); !ok || err != nil {
			t.Fatalf("check = %v, %v", ok, err)
		}
	}
	got := readUsage(t, r.east, "pinned", "u1")
	home := readUsage(t, r.west, "pinned", "u1")
	if math.Abs(got.Usage.Remaining-5) > 1e-6 || math.Abs(home.Usage.Remaining-5) > 1e-6 || got.Usage.Limit != 8 || !got.Usage.Allowed {
		t.Fatalf("usage through us-east %+v, at eu-west %+v; want 5 of 8 left", got.Usage, home.Usage)
	}
	if n := r.eastStore.Len(); n != 0 {
		t.Fatalf("us-east's store holds %d buckets, want none", n)
	}
	r.home.fail.Store(true)
	u := r.east.NewUsage()
	if _, err := u.AddRule("pinned", "u1", 0); err != nil {
		t.Fatal(err)
	}
	if err := r.east.Usage(ctx, u); !errors.Is(err, usage.ErrUnavailable) {
		t.Fatalf("usage with the home down = %v, want ErrUnavailable", err)
	}
}

// TestUsageInvalid: a usage is validated as a check is, naming the field.
func TestUsageInvalid(t *testing.T) {
	r := twoRegions(t)
	tests := []struct {
		name, rule, key string
		cost            float64
		field           string
		unknown         bool
	}{
		{name: "unknown rule", rule: "nope", key: "k", field: "rule_id", unknown: true},
		{name: "empty key", rule: "open", key: "", field: "key"},
		{name: "cost above capacity", rule: "open", key: "k", cost: 9, field: "cost"},
		{name: "negative cost", rule: "open", key: "k", cost: -1, field: "cost"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := r.east.NewUsage().AddRule(tt.rule, tt.key, tt.cost)
			var inv *request.InvalidError
			if !errors.As(err, &inv) || inv.Field != tt.field || errors.Is(err, request.ErrUnknownRule) != tt.unknown {
				t.Fatalf("AddRule = %v, want an invalid %s", err, tt.field)
			}
		})
	}
}

// FuzzUsage: any usage by rule id is either read with sane numbers,
// spending nothing, or refused with an *request.InvalidError naming
// rule_id, key or cost; it never panics.
func FuzzUsage(f *testing.F) {
	e, store := newMemoryEngine(f, "testdata/rules.yml")
	f.Add("tb", "client", 1.0)
	f.Add("log", "k", 1.5)
	f.Add("tb", "", math.NaN())
	f.Add("nope", "k", math.Inf(1))
	f.Add("tb", "k", math.Copysign(0, -1))
	f.Fuzz(func(t *testing.T, rule, key string, cost float64) {
		u := e.NewUsage()
		it, err := u.AddRule(rule, key, cost)
		if err != nil {
			var inv *request.InvalidError
			if !errors.As(err, &inv) || (inv.Field != "rule_id" && inv.Field != "key" && inv.Field != "cost") {
				t.Fatalf("AddRule(%q, %q, %v): %v, want an *request.InvalidError naming rule_id, key or cost", rule, key, cost, err)
			}
			if (inv.Field == "rule_id") != errors.Is(err, request.ErrUnknownRule) {
				t.Fatalf("AddRule(%q): rule_id error %v does not wrap request.ErrUnknownRule", rule, err)
			}
			return
		}
		if err := e.Usage(context.Background(), u); err != nil {
			t.Fatalf("Usage(%q, %q, %v): %v", rule, key, cost, err)
		}
		d := it.Usage
		if d.Remaining < 0 || math.IsNaN(d.Remaining) || d.Remaining > d.Limit || (!d.Allowed && d.RetryAfter <= 0) {
			t.Fatalf("usage %+v of rule %q", d, rule)
		}
		if n := store.Len(); n != 0 {
			t.Fatalf("a usage made %d buckets", n)
		}
	})
}

// TestUsageOfAnOverride: a key with an override is read against its own
// limit, as its checks are decided; the rule's other keys against the
// rule's.
func TestUsageOfAnOverride(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte(`rules:
  - id: api
    capacity: 10
    refill_per_second: 1
    overrides:
      big: {capacity: 500, refill_per_second: 50}
  - id: jobs
    algorithm: concurrency
    limit: 2
    overrides:
      big: {limit: 7}
`))
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Store: bucket.NewMemory()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		rule, key string
		limit     float64
	}{{"api", "big", 500}, {"api", "small", 10}, {"jobs", "big", 7}, {"jobs", "small", 2}} {
		if got := readUsage(t, e, c.rule, c.key).Usage; got.Limit != c.limit || got.Remaining != c.limit {
			t.Errorf("usage of %s %s: limit %v, remaining %v; want %v both", c.rule, c.key, got.Limit, got.Remaining, c.limit)
		}
	}
	// A cost above the rule's capacity but within the override's is valid.
	u := e.NewUsage()
	if _, err := u.AddRule("api", "big", 100); err != nil {
		t.Errorf("usage of cost 100 for the key with capacity 500: %v", err)
	}
}
