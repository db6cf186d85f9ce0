package tracing

import (
	"context"
	"strings"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// TestValidate: a bad endpoint or ratio is refused, naming its flag; off
// is a nil Tracer that installs nothing.
func TestValidate(t *testing.T) {
	for _, c := range []struct {
		o    Options
		want string
	}{
		{Options{Endpoint: "collector", SampleRatio: 0.5}, "--trace.otlp-endpoint"},
		{Options{Endpoint: "collector:", SampleRatio: 0.5}, "--trace.otlp-endpoint"},
		{Options{SampleRatio: 1.5}, "--trace.sample-ratio"},
		{Options{SampleRatio: -0.1}, "--trace.sample-ratio"},
	} {
		if err := c.o.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error naming %s", c.o, err, c.want)
		}
	}
	if err := (Options{Endpoint: "collector:4317", SampleRatio: 1}).Validate(); err != nil {
		t.Errorf("a good endpoint: %v", err)
	}
	tr, err := Start(Default(), "limiterd", "a", "i")
	if err != nil || tr != nil || tr.ServerHandler() != nil || tr.DialOptions() != nil || tr.Shutdown(0) != nil {
		t.Errorf("off: %v, %v", tr, err)
	}
}

// TestHeader: a span context put in a message's headers is read back
// whole, under the W3C names as written (NATS's headers are
// case-sensitive); TraceHeader keeps it alone; headers without one carry
// nothing.
func TestHeader(t *testing.T) {
	ts, err := trace.ParseTraceState("vendor=v1")
	if err != nil {
		t.Fatal(err)
	}
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{0x4b, 0xf9, 1}, SpanID: trace.SpanID{0x00, 0xf0, 2},
		TraceFlags: trace.FlagsSampled, TraceState: ts,
	})
	h := map[string][]string{"Nats-Msg-Id": {"i-1-0"}}
	InjectHeader(h, sc)
	if h["traceparent"] == nil || h["tracestate"] == nil {
		t.Fatalf("headers %v: want traceparent and tracestate", h)
	}
	got := SpanContextFromHeader(h)
	if !got.Equal(sc.WithRemote(true)) {
		t.Errorf("read back %+v, want %+v", got, sc)
	}
	only := TraceHeader(h)
	if len(only) != 2 || !SpanContextFromHeader(only).Equal(got) {
		t.Errorf("TraceHeader %v: want the trace context alone", only)
	}
	empty := map[string][]string{}
	InjectHeader(empty, trace.SpanContext{})
	if len(empty) != 0 || SpanContextFromHeader(empty).IsValid() || TraceHeader(empty) != nil || SpanContextFromHeader(nil).IsValid() {
		t.Errorf("no span context: headers %v", empty)
	}
}

// TestSampleLinked: at a ratio of 0, a new root span is sampled only when
// it links to a sampled span; a child follows its parent.
func TestSampleLinked(t *testing.T) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sampler(0)))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	tr := tp.Tracer("test")
	sampled := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{1}, TraceFlags: trace.FlagsSampled, Remote: true})
	unsampled := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{2}, SpanID: trace.SpanID{2}, Remote: true})
	for _, c := range []struct {
		name  string
		links []trace.Link
		want  bool
	}{
		{"no link", nil, false},
		{"linked to an unsampled span", []trace.Link{{SpanContext: unsampled}}, false},
		{"linked to a sampled span", []trace.Link{{SpanContext: unsampled}, {SpanContext: sampled}}, true},
	} {
		ctx, span := tr.Start(context.Background(), "apply", trace.WithNewRoot(), trace.WithLinks(c.links...))
		if got := span.SpanContext().IsSampled(); got != c.want {
			t.Errorf("%s: sampled %v, want %v", c.name, got, c.want)
		}
		_, child := tr.Start(ctx, "child")
		if child.SpanContext().IsSampled() != c.want {
			t.Errorf("%s: its child not sampled as its parent", c.name)
		}
		child.End()
		span.End()
	}
}
