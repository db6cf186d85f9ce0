package natstest_test

import (
	"errors"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limiterd/limiterd/internal/testenv/natstest"
)

func connect(t *testing.T, url string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url, nats.Timeout(time.Second))
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("jetstream: %v", err)
	}
	return nc, js
}

func TestServerRestartKeepsStreams(t *testing.T) {
	s := natstest.NewServer(t)
	ctx := t.Context()
	url := s.URL()

	nc, js := connect(t, url)
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:     "SPEND",
		Subjects: []string{"spend.>"},
		Storage:  jetstream.FileStorage,
	})
	if err != nil {
		t.Fatalf("create stream: %v", err)
	}
	if _, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable:   "reconciler",
		AckPolicy: jetstream.AckExplicitPolicy,
	}); err != nil {
		t.Fatalf("create consumer: %v", err)
	}
	if _, err := js.Publish(ctx, "spend.eu", []byte("hello"), jetstream.WithMsgID("m1")); err != nil {
		t.Fatalf("publish: %v", err)
	}
	nc.Close()

	// An outage: clients cannot connect until the restart.
	s.Shutdown()
	if nc, err := nats.Connect(url, nats.Timeout(time.Second)); err == nil {
		nc.Close()
		t.Fatal("connect succeeds after Shutdown")
	}
	s.Restart(t)
	if got := s.URL(); got != url {
		t.Fatalf("URL() = %s after Restart, want %s", got, url)
	}

	_, js = connect(t, url)
	stream, err = js.Stream(ctx, "SPEND")
	if err != nil {
		t.Fatalf("stream after restart: %v", err)
	}
	if n := stream.CachedInfo().State.Msgs; n != 1 {
		t.Fatalf("stream holds %d messages after restart, want 1", n)
	}
	raw, err := stream.GetMsg(ctx, 1)
	if err != nil || string(raw.Data) != "hello" {
		t.Fatalf("GetMsg(1) = %v, %v; want hello", raw, err)
	}

	// The durable consumer survived, with its position.
	cons, err := stream.Consumer(ctx, "reconciler")
	if err != nil {
		t.Fatalf("consumer after restart: %v", err)
	}
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(2*time.Second))
	if err != nil {
		t.Fatalf("fetch: %v", err)
	}
	var got []string
	for msg := range batch.Messages() {
		got = append(got, string(msg.Data()))
		if err := msg.Ack(); err != nil {
			t.Fatalf("ack: %v", err)
		}
	}
	if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
		t.Fatalf("fetch: %v", err)
	}
	if len(got) != 1 || got[0] != "hello" {
		t.Fatalf("fetched %q, want [hello]", got)
	}

	// So did the duplicate window.
	ack, err := js.Publish(ctx, "spend.eu", []byte("hello"), jetstream.WithMsgID("m1"))
	if err != nil {
		t.Fatalf("publish again: %v", err)
	}
	if !ack.Duplicate {
		t.Error("republishing message m1 after restart was not detected as a duplicate")
	}
}

func TestServerKillIsACrash(t *testing.T) {
	s := natstest.NewServer(t)
	ctx := t.Context()
	pid := s.Pid()
	if pid == 0 {
		t.Fatal("Pid() = 0 for a running server")
	}
	nc, js := connect(t, s.URL())
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "K", Subjects: []string{"k"}, Storage: jetstream.FileStorage}); err != nil {
		t.Fatalf("create stream: %v", err)
	}
	if _, err := js.Publish(ctx, "k", []byte("x")); err != nil {
		t.Fatalf("publish: %v", err)
	}
	nc.Close()

	s.Kill()
	if got := s.Pid(); got != 0 {
		t.Fatalf("Pid() = %d after Kill, want 0", got)
	}
	// The process is gone: signal 0 to its pid fails.
	if p, err := os.FindProcess(pid); err == nil && p.Signal(syscall.Signal(0)) == nil {
		t.Fatalf("nats-server pid %d still runs after Kill", pid)
	}
	s.Restart(t)
	if s.Pid() == 0 || s.Pid() == pid {
		t.Fatalf("Pid() = %d after Restart (was %d)", s.Pid(), pid)
	}
	_, js = connect(t, s.URL())
	stream, err := js.Stream(ctx, "K")
	if err != nil {
		t.Fatalf("stream after a kill and restart: %v", err)
	}
	if n := stream.CachedInfo().State.Msgs; n != 1 {
		t.Fatalf("stream holds %d messages after a kill and restart, want 1", n)
	}
}
