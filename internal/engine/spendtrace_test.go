package engine

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// spanRecorder keeps the span contexts it is told of.
type spanRecorder struct{ got []trace.SpanContext }

func (r *spanRecorder) SampledSpend(sc trace.SpanContext) { r.got = append(r.got, sc) }

// nopSpends records no spend.
type nopSpends struct{}

func (nopSpends) AddPaced(string, string, float64, float64, float64, int64) {}

// TestSampledSpendNamesItsSpan: a sampled check whose spend is recorded
// for the other regions tells the span recorder its span context; an
// unsampled one, a refused one, and one of a rule not reconciled tell it
// nothing.
func TestSampledSpendNamesItsSpan(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte(`rules:
  - id: r
    capacity: 2
    refill_per_second: 0.001
  - id: local
    capacity: 100
    refill_per_second: 1
    reconcile: false
`))
	if err != nil {
		t.Fatal(err)
	}
	rec := &spanRecorder{}
	e, err := New(Options{Store: bucket.NewMemory(), Spends: nopSpends{}, SpendSpans: rec}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.NeverSample())))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	sampled := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{1}, TraceFlags: trace.FlagsSampled, Remote: true})
	decide := func(rule string, parent trace.SpanContext) (trace.SpanContext, bool) {
		t.Helper()
		ctx, span := tp.Tracer("test").Start(trace.ContextWithRemoteSpanContext(context.Background(), parent), "check")
		defer span.End()
		c := e.NewCheck()
		if _, err := c.AddRule(rule, "k", 1); err != nil {
			t.Fatal(err)
		}
		ok, err := e.Decide(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		return span.SpanContext(), ok
	}
	if _, ok := decide("r", trace.SpanContext{}); !ok || len(rec.got) != 0 {
		t.Fatalf("an unsampled check: allowed %v, spans recorded %v; want allowed, none", ok, rec.got)
	}
	sc, ok := decide("r", sampled)
	if !ok || !sc.IsSampled() || len(rec.got) != 1 || !rec.got[0].Equal(sc) {
		t.Fatalf("a sampled check %v: allowed %v, spans recorded %v; want allowed, its own", sc, ok, rec.got)
	}
	if _, ok := decide("r", sampled); ok || len(rec.got) != 1 {
		t.Fatalf("a sampled check refused: allowed %v, spans recorded %d; want refused, no more", ok, len(rec.got))
	}
	if _, ok := decide("local", sampled); !ok || len(rec.got) != 1 {
		t.Fatalf("a sampled check of a rule not reconciled: allowed %v, spans recorded %d; want allowed, no more", ok, len(rec.got))
	}
}
