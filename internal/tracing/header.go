package tracing

import (
	"context"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// The W3C trace context's header names, as the propagator writes them.
const (
	traceparent = "traceparent"
	tracestate  = "tracestate"
)

// headerCarrier is a message's headers as the propagator reads and writes
// them: NATS's, whose keys are case-sensitive (not canonicalized as
// HTTP's).
type headerCarrier map[string][]string

func (h headerCarrier) Get(key string) string {
	if v := h[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

func (h headerCarrier) Set(key, value string) { h[key] = []string{value} }

func (h headerCarrier) Keys() []string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	return keys
}

// InjectHeader puts sc in h, a message's headers (nats.Header), with the
// W3C propagator: traceparent, and tracestate when sc has one. An invalid
// sc puts nothing.
func InjectHeader(h map[string][]string, sc trace.SpanContext) {
	if !sc.IsValid() {
		return
	}
	propagation.TraceContext{}.Inject(trace.ContextWithSpanContext(context.Background(), sc), headerCarrier(h))
}

// SpanContextFromHeader is the span context InjectHeader put in h, remote;
// invalid when h carries none.
func SpanContextFromHeader(h map[string][]string) trace.SpanContext {
	if len(h[traceparent]) == 0 {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), headerCarrier(h)))
}

// TraceHeader is the trace context of h alone, as headers of their own
// for another message (the same values); nil when h carries none.
func TraceHeader(h map[string][]string) map[string][]string {
	tp := h[traceparent]
	if len(tp) == 0 {
		return nil
	}
	out := map[string][]string{traceparent: tp}
	if ts := h[tracestate]; len(ts) > 0 {
		out[tracestate] = ts
	}
	return out
}
