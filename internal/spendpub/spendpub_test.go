package spendpub

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/tracing"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// TestSpoolSurvivesACrashDuringAnOutage: spends flushed while NATS is down
// are on disk before the next interval; a new process finds them and
// publishes them, once, when NATS is back.
func TestSpoolSurvivesACrashDuringAnOutage(t *testing.T) {
	srv := natstest.NewServer(t)
	ctx := t.Context()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	nc, err := nats.Connect(srv.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := natsconn.EnsureStream(ctx, js, jetstream.StreamConfig{Name: gossip.LocalStream("us-east"),
		Subjects: []string{gossip.LocalSubject("us-east")}, Storage: jetstream.FileStorage, Duplicates: time.Minute}); err != nil {
		t.Fatal(err)
	}
	spool := filepath.Join(t.TempDir(), "spool")

	srv.Shutdown()
	p1, err := New(nc, "us-east", "i1", time.Second, 0, spool, log, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	p1.Accumulator().Add("r", "k", 3, 0, time.Now().UnixMicro())
	fctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	p1.flush(fctx)
	cancel()
	files, _ := filepath.Glob(filepath.Join(spool, "*"+spoolExt))
	if len(files) != 1 || len(p1.backlog) != 1 {
		t.Fatalf("after a failed publish: %d spool files, backlog %d; want 1 and 1", len(files), len(p1.backlog))
	}
	// p1 dies here, without its final flush.

	srv.Restart(t)
	p2, err := New(nc, "us-east", "i2", time.Second, 0, spool, log, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if len(p2.backlog) != 1 {
		t.Fatalf("a new publisher found %d spooled flushes, want 1", len(p2.backlog))
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(p2.backlog) > 0 {
		if time.Now().After(deadline) {
			t.Fatal("the spooled flush was not published within 10 s of NATS coming back")
		}
		fctx, cancel := context.WithTimeout(ctx, time.Second)
		p2.flush(fctx)
		cancel()
	}
	if files, _ := filepath.Glob(filepath.Join(spool, "*")); len(files) != 0 {
		t.Fatalf("spool files left after publishing: %v", files)
	}
	// Published again (as a restart that could not remove its file would):
	// the stream drops it as a duplicate.
	_, err = js.Publish(ctx, gossip.LocalSubject("us-east"), []byte("x"), jetstream.WithMsgID("i1-1-0"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctx, gossip.LocalStream("us-east"))
	if err != nil {
		t.Fatal(err)
	}
	if n := s.CachedInfo().State.Msgs; n != 1 {
		t.Fatalf("the local stream holds %d messages, want the one spooled flush", n)
	}
	b, err := s.GetMsg(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	batch, err := gossip.Decode(b.Data, gossip.DefaultMaxMessageBytes)
	if err != nil || batch.GetInstance() != "i1" {
		t.Fatalf("the published flush: %v, %v; want i1's", batch, err)
	}
}

// TestFlushCarriesASampledCheck: a flush with the spend of a sampled check
// carries its span context in the message's headers (W3C traceparent); the
// next flush, of an unsampled check's spend, carries no trace header.
func TestFlushCarriesASampledCheck(t *testing.T) {
	srv := natstest.NewServer(t)
	ctx := t.Context()
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	s, err := natsconn.EnsureStream(ctx, js, jetstream.StreamConfig{Name: gossip.LocalStream("us-east"),
		Subjects: []string{gossip.LocalSubject("us-east")}, Storage: jetstream.FileStorage, Duplicates: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(nc, "us-east", "i1", time.Second, 0, "", slog.New(slog.NewTextHandler(io.Discard, nil)), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{0xaa, 1}, SpanID: trace.SpanID{0xbb, 2}, TraceFlags: trace.FlagsSampled})
	p.Accumulator().Add("r", "sampled", 1, 0, time.Now().UnixMicro())
	p.SampledSpend(sc)
	p.flush(ctx)
	p.Accumulator().Add("r", "unsampled", 1, 0, time.Now().UnixMicro())
	p.flush(ctx)
	for seq, want := range map[uint64]trace.SpanContext{1: sc, 2: {}} {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		got := tracing.SpanContextFromHeader(m.Header)
		if !got.Equal(want.WithRemote(want.IsValid())) {
			t.Errorf("flush %d: span context %v in headers %v, want %v", seq, got, m.Header, want)
		}
		if want.IsValid() && m.Header.Get("traceparent") != "00-aa010000000000000000000000000000-bb02000000000000-01" {
			t.Errorf("flush %d: traceparent %q", seq, m.Header.Get("traceparent"))
		}
		if !want.IsValid() && (m.Header.Get("traceparent") != "" || m.Header.Get("tracestate") != "") {
			t.Errorf("flush %d of an unsampled check: trace headers %v", seq, m.Header)
		}
	}
}
