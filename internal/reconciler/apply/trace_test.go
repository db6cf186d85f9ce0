package apply

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/limiterd/limiterd/internal/tracing"
)

// TestApplySpans: with a tracer, each message of a batch that carries a
// span context is applied in a span of its own, a root linked to that
// context, naming the source, the partition, the stream sequence, the
// clients debited and deferred, and whether it was a replay; a message
// without one has no span, and a message left to be read again none yet.
// Without a tracer nothing is traced.
func TestApplySpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	store := &seqStore{fakeStore: fakeStore{fail: map[string]bool{"down": true}}, replayed: map[uint64]bool{3: true}, failRec: map[uint64]bool{5: true}}
	js := &fakeJS{}
	a, _, _ := newTestApplier(t, store, js)
	a.tracer = tp.Tracer("test")
	src := Source{Name: "us-east", Epoch: 42, Partition: 3, Retry: js}
	traced := func(b byte) (trace.SpanContext, nats.Header) {
		sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{b}, SpanID: trace.SpanID{b}, TraceFlags: trace.FlagsSampled})
		h := nats.Header{}
		tracing.InjectHeader(h, sc)
		return sc, h
	}
	ms := []*fakeMsg{flushMsg(t, 1, testNow, "a", "b"), flushMsg(t, 2, testNow, "c", "down"), flushMsg(t, 3, testNow, "d"),
		flushMsg(t, 4, testNow, "e"), flushMsg(t, 5, testNow, "f")}
	sc1, h1 := traced(1)
	sc3, h3 := traced(3)
	_, h5 := traced(5)
	ms[0].header, ms[2].header, ms[4].header = h1, h3, h5
	ms[3].header = nats.Header{"Nats-Msg-Id": {"x"}}
	if done := applyBatch(context.Background(), a, src, ms); done != 4 {
		t.Fatalf("ApplyBatch stopped at %d, want 4 (message 5's record fails)", done)
	}
	spans := rec.Ended()
	if len(spans) != 2 {
		t.Fatalf("%d spans, want 2: messages 1 and 3", len(spans))
	}
	for i, c := range []struct {
		link              trace.SpanContext
		seq               int64
		debited, deferred int64
		replay            bool
	}{{sc1, 1, 2, 0, false}, {sc3, 3, 0, 0, true}} {
		s := spans[i]
		if s.Name() != "apply" || s.SpanKind() != trace.SpanKindConsumer || s.Parent().IsValid() || !s.SpanContext().IsSampled() {
			t.Errorf("span %d: %s, kind %v, parent %v, sampled %v; want a sampled consumer root named apply", i, s.Name(), s.SpanKind(), s.Parent(), s.SpanContext().IsSampled())
		}
		if l := s.Links(); len(l) != 1 || !l[0].SpanContext.Equal(c.link.WithRemote(true)) {
			t.Errorf("span %d: links %v, want the message's context %v", i, l, c.link)
		}
		if s.SpanContext().TraceID() == c.link.TraceID() {
			t.Errorf("span %d in the linked trace: want a trace of its own", i)
		}
		want := map[attribute.Key]attribute.Value{
			"limiter.apply.source_region": attribute.StringValue("us-east"), "limiter.apply.partition": attribute.IntValue(3),
			"limiter.apply.stream_seq": attribute.Int64Value(c.seq), "limiter.apply.clients_debited": attribute.Int64Value(c.debited),
			"limiter.apply.clients_deferred": attribute.Int64Value(c.deferred), "limiter.apply.replay": attribute.BoolValue(c.replay),
		}
		got := map[attribute.Key]attribute.Value{}
		for _, kv := range s.Attributes() {
			got[kv.Key] = kv.Value
		}
		for k, v := range want {
			if got[k] != v {
				t.Errorf("span %d: %s = %v, want %v", i, k, got[k].String(), v.String())
			}
		}
		if s.Status().Code == codes.Error {
			t.Errorf("span %d: status %v", i, s.Status())
		}
	}

	// A message with debits deferred says so.
	rec2 := tracetest.NewSpanRecorder()
	tp.RegisterSpanProcessor(rec2)
	m := flushMsg(t, 6, testNow, "g", "down")
	m.header = h1
	if done := applyBatch(context.Background(), a, src, []*fakeMsg{m}); done != 1 {
		t.Fatalf("ApplyBatch of message 6: done %d", done)
	}
	if s := rec2.Ended(); len(s) != 1 || !hasAttr(s[0], "limiter.apply.clients_deferred", attribute.Int64Value(1)) || !hasAttr(s[0], "limiter.apply.clients_debited", attribute.Int64Value(1)) {
		t.Errorf("message 6 with a client down: spans %v, want one with a client debited and one deferred", s)
	}

	// Without a tracer: nothing.
	a.tracer = nil
	rec3 := tracetest.NewSpanRecorder()
	tp.RegisterSpanProcessor(rec3)
	m = flushMsg(t, 7, testNow, "h")
	m.header = h1
	if done := applyBatch(context.Background(), a, src, []*fakeMsg{m}); done != 1 || len(rec3.Ended()) != 0 {
		t.Errorf("without a tracer: done %d, %d spans", done, len(rec3.Ended()))
	}
}

func hasAttr(s sdktrace.ReadOnlySpan, k attribute.Key, v attribute.Value) bool {
	for _, kv := range s.Attributes() {
		if kv.Key == k {
			return kv.Value == v
		}
	}
	return false
}
