package engine

import (
	"context"
	"testing"

	"github.com/limiterd/limiterd/internal/rules"
)

// BenchmarkDecide is the engine's own cost of a check on the embedded
// store: a check by rule id, and one by attributes matching two rules.
func BenchmarkDecide(b *testing.B) {
	e, _ := newMemoryEngine(b, "testdata/rules.yml", func(o *Options) { o.DenyCacheSize = -1 })
	ctx := context.Background()
	b.Run("rule", func(b *testing.B) {
		b.ReportAllocs()
		// The least cost the rule takes: millions of checks never empty it.
		cost := e.table.Load().ByID["flood"].Limit.MinCost()
		for b.Loop() {
			c := e.NewCheck()
			if _, err := c.AddRule("flood", "k", cost); err != nil {
				b.Fatal(err)
			}
			if _, err := e.Decide(ctx, c); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("attributes", func(b *testing.B) {
		b.ReportAllocs()
		a := &rules.Attributes{APIKey: "k", IP: "192.0.2.1", Path: "/api/x"}
		for b.Loop() {
			c := e.NewCheck()
			if _, _, err := c.AddAttributes(a, 1e-9); err != nil {
				b.Fatal(err)
			}
			if _, err := e.Decide(ctx, c); err != nil {
				b.Fatal(err)
			}
		}
	})
}
