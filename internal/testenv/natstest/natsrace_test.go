//go:build natsrace

// The smallest reproduction of a data race inside nats-server itself (the
// version pinned in go.mod): a stream update (fileStore.UpdateConfig) and a
// consumer create (fileStore.ConsumerStore) on the same stream, from two
// clients at once. It is why the integration tests run nats-server as a
// process rather than in the test binary. It runs only when asked for, and
// with v2.15.2 it fails within seconds with a DATA RACE between
// (*fileStore).ConsumerStore (filestore.go:13552, from
// jsConsumerCreateRequest) and (*fileStore).UpdateConfig (from
// jsStreamUpdateRequest); it passes once the server fixes it:
//
//	go test -race -tags natsrace -run TestNATSServerRace -count=1 ./internal/testenv/natstest
package natstest_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func TestNATSServerRace(t *testing.T) {
	srv, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true,
		JetStream: true, StoreDir: t.TempDir(),
	})
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	defer srv.Shutdown()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("not ready")
	}
	js := func() jetstream.JetStream {
		nc, err := nats.Connect(srv.ClientURL())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		return js
	}
	ctx := t.Context()
	cfg := jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Storage: jetstream.FileStorage}
	if _, err := js().CreateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	a, b := js(), js()
	var wg sync.WaitGroup
	deadline := time.Now().Add(5 * time.Second)
	wg.Go(func() {
		for i := 0; time.Now().Before(deadline); i++ {
			cfg.MaxAge = time.Duration(i%2+1) * time.Hour
			_, _ = a.UpdateStream(ctx, cfg)
		}
	})
	wg.Go(func() {
		for i := 0; time.Now().Before(deadline); i++ {
			_, _ = b.CreateOrUpdateConsumer(ctx, "S", jetstream.ConsumerConfig{
				Durable: fmt.Sprintf("c%d", i%50), AckPolicy: jetstream.AckExplicitPolicy,
			})
		}
	})
	wg.Wait()
}
