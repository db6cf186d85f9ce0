package engine

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/rules"
)

const cornerRules = `
rules:
  - id: lx
    capacity: 100
    refill_per_second: 0.000001
    lease: 5
  - id: ly
    capacity: 100
    refill_per_second: 0.000001
    lease: 5
`

func cornerEngine(t *testing.T, store *faultStore) *Engine {
	t.Helper()
	set, err := rules.Parse("corners.yml", []byte(cornerRules))
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Store: store, Region: "local", Logger: quietLogger()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func decideRules(ctx context.Context, t *testing.T, e *Engine, key string, ids ...string) (bool, error) {
	t.Helper()
	c := e.NewCheck()
	for _, id := range ids {
		if _, err := c.AddRule(id, key, 1); err != nil {
			t.Fatal(err)
		}
	}
	return e.Decide(ctx, c)
}

// TestLeasedKeyNotJammedWhenAWaitEnds: a check that becomes rule lx's
// batch fetcher and then gives up waiting for rule ly's batch (another
// check is taking it) must end lx's fetch, or every later check of
// (lx, key) waits for a batch that never comes.
func TestLeasedKeyNotJammedWhenAWaitEnds(t *testing.T) {
	store := newFaultStore()
	e := cornerEngine(t, store)
	block := make(chan struct{})
	store.mu.Lock()
	store.block = block
	store.mu.Unlock()

	// Check A takes ly's batch and waits in the store.
	aDone := make(chan error, 1)
	go func() {
		_, err := decideRules(context.Background(), t, e, "k", "ly")
		aDone <- err
	}()
	for store.calls.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	// Check C becomes lx's fetcher, then waits for A's ly batch until
	// its deadline.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	_, err := decideRules(ctx, t, e, "k", "lx", "ly")
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("check of lx and ly while ly's batch is taken = %v; want its deadline", err)
	}
	store.mu.Lock()
	store.block = nil
	store.mu.Unlock()
	close(block)
	if err := <-aDone; err != nil {
		t.Fatal(err)
	}

	ctx, cancel = context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ok, err := decideRules(ctx, t, e, "k", "lx")
	if err != nil || !ok {
		t.Fatalf("later check of lx = %v, %v; want allowed (the key is jammed by a fetch never ended)", ok, err)
	}
}
