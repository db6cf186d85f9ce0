package engine

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"math"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// newMemoryEngine is an engine over the embedded store with the rules of file.
func newMemoryEngine(t testing.TB, file string, mutate ...func(*Options)) (*Engine, *bucket.Memory) {
	t.Helper()
	set, err := rules.Load(file)
	if err != nil {
		t.Fatal(err)
	}
	store := bucket.NewMemory()
	opts := Options{Store: store, Region: "local", Logger: quietLogger()}
	for _, m := range mutate {
		m(&opts)
	}
	e, err := New(opts, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return e, store
}

// FuzzCheck: any check by rule id is either decided with sane numbers or
// refused with an *request.InvalidError naming rule_id, key or cost; it never
// panics and never spends on an invalid request.
func FuzzCheck(f *testing.F) {
	e, _ := newMemoryEngine(f, "testdata/rules.yml")
	f.Add("tb", "client", 1.0)
	f.Add("log", "k", 1.5)
	f.Add("tb", "", math.NaN())
	f.Add("nope", "k", math.Inf(1))
	f.Add("tb", "k", math.Copysign(0, -1))
	f.Add("tb", "k", 1e-300)
	f.Fuzz(func(t *testing.T, rule, key string, cost float64) {
		c := e.NewCheck()
		it, err := c.AddRule(rule, key, cost)
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
		if _, err := e.Decide(context.Background(), c); err != nil {
			t.Fatalf("Decide(%q, %q, %v): %v", rule, key, cost, err)
		}
		d := it.Decision
		if it.Rule.ID != rule {
			t.Fatalf("decided by rule %q, asked %q", it.Rule.ID, rule)
		}
		if d.Remaining < 0 || math.IsNaN(d.Remaining) || d.Limit != it.Limit().Capacity {
			t.Fatalf("decision %+v for limit %+v", d, it.Limit())
		}
		if !d.Allowed && d.RetryAfter <= 0 {
			t.Fatalf("rejection without a retry time: %+v", d)
		}
	})
}
