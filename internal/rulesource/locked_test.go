package rulesource_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/natsauth"
	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/rulesource"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
)

// TestReadOnlyIdentity: on a server locked with the generated identities,
// a limiterd's source watches and resyncs the bucket (every 100 ms here)
// without one permission violation, sees the admin's rule, and its own
// Put fails at once with ErrReadOnly.
func TestReadOnlyIdentity(t *testing.T) {
	dir := t.TempDir()
	ids, err := natsauth.Write(dir, []string{"us-east"})
	if err != nil {
		t.Fatal(err)
	}
	ns := natstest.NewServer(t, natstest.Config(natsauth.Config(ids)))
	var mu sync.Mutex
	var violations []error
	connect := func(identity string) *nats.Conn {
		a := natsconn.Auth{NkeySeedFile: natsauth.SeedFile(dir, identity)}
		opts, err := a.Options(nil)
		if err != nil {
			t.Fatal(err)
		}
		opts = append(opts, natsconn.Inbox(identity), nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			if errors.Is(err, nats.ErrPermissionViolation) {
				mu.Lock()
				violations = append(violations, err)
				mu.Unlock()
			}
		}))
		nc, err := nats.Connect(ns.URL(), opts...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return nc
	}
	file := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(file, []byte("rules:\n  - id: f\n    capacity: 1\n    refill_per_second: 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	got := make(chan *rules.Set, 16)
	start := func(o rulesource.Options) *rulesource.Source {
		o.File, o.ResyncInterval, o.Logger = file, 100*time.Millisecond, slog.New(slog.NewTextHandler(io.Discard, nil))
		s, err := rulesource.New(o, prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { s.Run(ctx); close(done) }()
		t.Cleanup(func() { cancel(); <-done })
		return s
	}
	reader := start(rulesource.Options{NATS: connect("limiterd-us-east"), ReadOnly: true, OnChange: func(set *rules.Set) error {
		got <- set
		return nil
	}})
	admin := start(rulesource.Options{NATS: connect("limiterd-us-east"), Writer: connect("admin")})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := admin.Put(ctx, []byte("id: dyn\ncapacity: 3\nrefill_per_second: 1\n")); err != nil {
		t.Fatalf("the admin's put: %v", err)
	}
	for set := range got {
		if set.Get("dyn") != nil {
			break
		}
	}
	time.Sleep(time.Second) // ten resyncs
	if _, err := reader.Put(ctx, []byte("id: mine\ncapacity: 3\nrefill_per_second: 1\n")); !errors.Is(err, rulesource.ErrReadOnly) {
		t.Fatalf("the reader's put: %v, want ErrReadOnly", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(violations) > 0 {
		t.Fatalf("%d permission violations while watching, the first: %v", len(violations), violations[0])
	}
}
