package natsconn_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
)

// apiCalls counts the JetStream API requests on subject (a wildcard) that
// any client of the server sends, from now on.
func apiCalls(t *testing.T, url, subject string) *atomic.Int64 {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(nc.Close)
	var n atomic.Int64
	if _, err := nc.Subscribe(subject, func(*nats.Msg) { n.Add(1) }); err != nil {
		t.Fatalf("subscribe %s: %v", subject, err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatalf("flush: %v", err)
	}
	return &n
}

func jetStream(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("jetstream: %v", err)
	}
	return js
}

func TestEnsureStreamUpdatesOnlyWhatDiffers(t *testing.T) {
	srv := natstest.NewServer(t)
	ctx := t.Context()
	creates := apiCalls(t, srv.URL(), "$JS.API.STREAM.CREATE.>")
	updates := apiCalls(t, srv.URL(), "$JS.API.STREAM.UPDATE.>")
	js := jetStream(t, srv.URL())
	cfg := jetstream.StreamConfig{
		Name: "SPENDS", Subjects: []string{"spend.>"}, Retention: jetstream.LimitsPolicy,
		MaxAge: time.Hour, MaxBytes: 1 << 20, MaxMsgSize: 1 << 16, Discard: jetstream.DiscardOld,
		Duplicates: 2 * time.Minute, Storage: jetstream.FileStorage,
	}
	for range 3 {
		if _, err := natsconn.EnsureStream(ctx, js, cfg); err != nil {
			t.Fatalf("EnsureStream: %v", err)
		}
	}
	// A second client of the same server, as another daemon starting.
	if _, err := natsconn.EnsureStream(ctx, jetStream(t, srv.URL()), cfg); err != nil {
		t.Fatalf("EnsureStream from another client: %v", err)
	}
	settle := func(c *atomic.Int64, want int64) int64 {
		deadline := time.Now().Add(2 * time.Second)
		for c.Load() < want && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(50 * time.Millisecond)
		return c.Load()
	}
	if got := settle(creates, 1); got != 1 {
		t.Errorf("stream create requests = %d, want 1", got)
	}
	if got := updates.Load(); got != 0 {
		t.Errorf("stream update requests = %d for an unchanged configuration, want 0", got)
	}

	cfg.MaxAge = 2 * time.Hour
	s, err := natsconn.EnsureStream(ctx, js, cfg)
	if err != nil {
		t.Fatalf("EnsureStream with a new max age: %v", err)
	}
	if got := settle(updates, 1); got != 1 {
		t.Errorf("stream update requests = %d after the max age changed, want 1", got)
	}
	if got := s.CachedInfo().Config.MaxAge; got != 2*time.Hour {
		t.Errorf("max age in force = %v, want 2h", got)
	}
}

func TestStreamMatches(t *testing.T) {
	want := jetstream.StreamConfig{Name: "S", Subjects: []string{"a.>"}, MaxAge: time.Hour, Storage: jetstream.FileStorage}
	// What a server reports for want: defaults filled in.
	have := want
	have.Replicas, have.MaxMsgs, have.MaxBytes, have.Duplicates = 1, -1, -1, 2*time.Minute
	tests := []struct {
		name string
		edit func(*jetstream.StreamConfig)
		want bool
	}{
		{name: "server defaults", edit: func(*jetstream.StreamConfig) {}, want: true},
		{name: "subjects", edit: func(c *jetstream.StreamConfig) { c.Subjects = []string{"b.>"} }},
		{name: "max age", edit: func(c *jetstream.StreamConfig) { c.MaxAge = time.Minute }},
		{name: "storage", edit: func(c *jetstream.StreamConfig) { c.Storage = jetstream.MemoryStorage }},
		{name: "retention", edit: func(c *jetstream.StreamConfig) { c.Retention = jetstream.WorkQueuePolicy }},
		{name: "replicas", edit: func(c *jetstream.StreamConfig) { c.Replicas = 3 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := have
			tt.edit(&h)
			if got := natsconn.StreamMatches(h, want); got != tt.want {
				t.Errorf("StreamMatches = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestEnsureKeyValueCreatesOnce(t *testing.T) {
	srv := natstest.NewServer(t)
	ctx := t.Context()
	creates := apiCalls(t, srv.URL(), "$JS.API.STREAM.CREATE.>")
	js := jetStream(t, srv.URL())
	cfg := jetstream.KeyValueConfig{Bucket: "rules", History: 5}
	kv, err := natsconn.EnsureKeyValue(ctx, js, cfg)
	if err != nil {
		t.Fatalf("EnsureKeyValue: %v", err)
	}
	if _, err := kv.Put(ctx, "r1", []byte("v1")); err != nil {
		t.Fatalf("put: %v", err)
	}
	kv, err = natsconn.EnsureKeyValue(ctx, js, cfg)
	if err != nil {
		t.Fatalf("EnsureKeyValue again: %v", err)
	}
	e, err := kv.Get(ctx, "r1")
	if err != nil || string(e.Value()) != "v1" {
		t.Fatalf("get r1 after a second EnsureKeyValue = %v, %v; want v1", e, err)
	}
	time.Sleep(50 * time.Millisecond)
	if got := creates.Load(); got != 1 {
		t.Errorf("stream create requests = %d, want 1", got)
	}
}
