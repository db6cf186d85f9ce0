package reconciler

import (
	"context"
	"encoding/hex"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc/metadata"

	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/testenv/otlptest"
	"github.com/limiterd/limiterd/internal/tracing"
	"github.com/limiterd/limiterd/pkg/gossip"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// TestSampledCheckLinkedToItsApply: with tracing on in both daemons (at a
// ratio of 0, so that only a caller's sampled context samples), a sampled
// check in us-east has its flush carry its span context, relayed with each
// partition message, and eu-west's reconciler applies that message in a
// span of its own, a root linked to the check's span, naming the source,
// the partition, the stream sequence and the clients debited. An
// unsampled check's message carries no trace header and has no span.
func TestSampledCheckLinkedToItsApply(t *testing.T) {
	t.Parallel()
	recv, endpoint := otlptest.Start(t)
	on := tracing.Options{Endpoint: endpoint, Insecure: true, SampleRatio: 0}
	s := buildStack(t, stackRegions, quotaRules, 100*time.Millisecond, 0, func(s *stack, opts ...natstest.Option) {
		s.nats = natstest.NewServer(t, opts...)
		s.limOpts = func(o *limiterd.Options) { o.Tracing = on }
	})
	s.recOpts = func(o *Options) { o.Trace = on }
	s.startReconciler("us-east")
	s.startReconciler("eu-west")
	s.waitReady()

	traceID := "4bf92f3577b34da6a3ce929d0e0e4736"
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "traceparent", "00-"+traceID+"-00f067aa0ba902b7-01")
	if resp, err := s.regions["us-east"].client.Check(ctx, &limiterv1.CheckRequest{RuleId: "quota", Key: "traced"}); err != nil || !resp.GetAllowed() {
		t.Fatalf("sampled check: %v, %v", resp, err)
	}
	testenv.WaitFor(t, "the sampled check applied in eu-west", func() bool { return s.count("eu-west", "traced") == 1 })
	if resp, err := s.check("us-east", "quota", "untraced"); err != nil || !resp.GetAllowed() {
		t.Fatalf("unsampled check: %v, %v", resp, err)
	}
	testenv.WaitFor(t, "the unsampled check applied in eu-west", func() bool { return s.count("eu-west", "untraced") == 1 })

	// The messages eu-west applied: the sampled check's carries its
	// trace, the other none.
	js, err := jetstream.New(s.connectAs("ops"))
	if err != nil {
		t.Fatal(err)
	}
	in, err := js.Stream(context.Background(), gossip.InStream("eu-west"))
	if err != nil {
		t.Fatal(err)
	}
	var tracedSeq uint64
	for seq := uint64(1); seq <= in.CachedInfo().State.LastSeq; seq++ {
		m, err := in.GetMsg(context.Background(), seq)
		if err != nil {
			t.Fatal(err)
		}
		b, err := gossip.Decode(m.Data, gossip.DefaultMaxMessageBytes)
		if err != nil {
			t.Fatal(err)
		}
		sc := tracing.SpanContextFromHeader(m.Header)
		for _, sp := range b.GetSpends() {
			switch sp.GetKey() {
			case "traced":
				if sc.TraceID().String() != traceID || !sc.IsSampled() {
					t.Errorf("message %d of the sampled check: span context %v (headers %v), want trace %s, sampled", seq, sc, m.Header, traceID)
				}
				tracedSeq = seq
			case "untraced":
				if m.Header.Get("traceparent") != "" || m.Header.Get("tracestate") != "" {
					t.Errorf("message %d of the unsampled check: trace headers %v", seq, m.Header)
				}
			}
		}
	}
	if tracedSeq == 0 {
		t.Fatal("no message of the sampled check in eu-west's inbound stream")
	}

	// The spans go out within the exporter's 5 s batch.
	var check *tracepb.Span
	var applies []*tracepb.Span
	testenv.WaitFor(t, "the check's span and its apply's received", func() bool {
		check, applies = nil, nil
		for _, sp := range recv.All() {
			switch {
			case sp.Service == "limiterd" && sp.Region == "us-east" && sp.Span.GetName() == "limiter.v1.Limiter/Check":
				check = sp.Span
			case sp.Service == "reconciler" && sp.Span.GetName() == "apply":
				if sp.Region != "eu-west" {
					t.Errorf("an apply span from the reconciler of %s", sp.Region)
				}
				applies = append(applies, sp.Span)
			}
		}
		return check != nil && len(applies) > 0
	})
	time.Sleep(time.Second) // any other apply span would be in by now: there must be none
	for _, sp := range recv.All() {
		if sp.Service == "reconciler" && sp.Span.GetName() == "apply" && !slices.ContainsFunc(applies, func(a *tracepb.Span) bool { return slices.Equal(a.GetSpanId(), sp.Span.GetSpanId()) }) {
			applies = append(applies, sp.Span)
		}
	}
	if len(applies) != 1 {
		t.Fatalf("%d apply spans, want the sampled check's alone", len(applies))
	}
	apply := applies[0]
	if hex.EncodeToString(check.GetTraceId()) != traceID {
		t.Fatalf("the check's span is in trace %x, want the caller's %s", check.GetTraceId(), traceID)
	}
	if slices.Equal(apply.GetTraceId(), check.GetTraceId()) || len(apply.GetParentSpanId()) != 0 {
		t.Errorf("the apply span is in trace %x under %x: want a root of its own trace", apply.GetTraceId(), apply.GetParentSpanId())
	}
	if l := apply.GetLinks(); len(l) != 1 || !slices.Equal(l[0].GetTraceId(), check.GetTraceId()) || !slices.Equal(l[0].GetSpanId(), check.GetSpanId()) {
		t.Errorf("the apply span's links %v, want one to the check's span %x in trace %x", l, check.GetSpanId(), check.GetTraceId())
	}
	if apply.GetKind() != tracepb.Span_SPAN_KIND_CONSUMER {
		t.Errorf("the apply span's kind %v, want consumer", apply.GetKind())
	}
	attrs := map[string]string{}
	for _, kv := range apply.GetAttributes() {
		v := kv.GetValue()
		switch {
		case v.GetStringValue() != "":
			attrs[kv.GetKey()] = v.GetStringValue()
		case kv.GetKey() == "limiter.apply.replay":
			attrs[kv.GetKey()] = fmt.Sprint(v.GetBoolValue())
		default:
			attrs[kv.GetKey()] = fmt.Sprint(v.GetIntValue())
		}
	}
	part := gossip.PartitionOf("traced", DefaultPartitions)
	for k, want := range map[string]string{"limiter.apply.source_region": "us-east", "limiter.apply.partition": fmt.Sprint(part),
		"limiter.apply.stream_seq": fmt.Sprint(tracedSeq), "limiter.apply.clients_debited": "1", "limiter.apply.replay": "false"} {
		if attrs[k] != want {
			t.Errorf("apply span: %s = %q, want %q (attributes %v)", k, attrs[k], want, attrs)
		}
	}
	t.Logf("check span %x of trace %x; apply span %x of trace %x, linked to it; attributes %v",
		check.GetSpanId(), check.GetTraceId(), apply.GetSpanId(), apply.GetTraceId(), attrs)
}
