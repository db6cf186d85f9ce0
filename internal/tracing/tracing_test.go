package tracing

import (
	"strings"
	"testing"

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
