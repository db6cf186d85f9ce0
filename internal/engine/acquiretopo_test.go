package engine

import (
	"context"
	"math"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/leaseid"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// switchingStore switches the topology of e (once) while it holds an
// Acquire's leases, between the lease and the rate parts of the Acquire.
type switchingStore struct {
	*bucket.Memory
	switched bool
	w        *handoffWorld
	e        *Engine
}

func (s *switchingStore) Acquire(ctx context.Context, reqs []bucket.LeaseRequest, member string) ([]bucket.LeaseDecision, error) {
	ds, err := s.Memory.Acquire(ctx, reqs, member)
	if !s.switched {
		s.switched = true
		s.w.switchTo(s.e)
	}
	return ds, err
}

// TestAcquireRoutedUnderOneTopology: an Acquire's leases and rate rules
// are routed with one topology, the one in force when it starts, even
// when a switch comes in the middle: the pinned rate rule of a key homed
// in eu under that topology is decided in eu, not here under the next.
func TestAcquireRoutedUnderOneTopology(t *testing.T) {
	set, err := rules.Parse("rules.yml", []byte(`rules:
  - id: jobs
    algorithm: concurrency
    limit: 5
    lease_ttl: 1m
    key_by: user
    match: {path: /jobs}
  - id: jobs-rate
    capacity: 10
    refill_per_second: 0.001
    home: pinned
    key_by: user
    match: {path: /jobs}
`))
	if err != nil {
		t.Fatal(err)
	}
	w := newHandoffWorld(t)
	w.set = set
	w.eu, err = New(Options{Store: bucket.NewMemory(), Region: "eu", Logger: quietLogger()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	w.euHome.e = w.eu
	store := &switchingStore{Memory: w.usStore, w: w}
	us, err := New(Options{Store: w.usStore, Leases: store, Region: "us", Topology: w.older, Homes: map[string]homes.Home{"eu": w.euHome},
		Logger: quietLogger()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	store.e = us
	key := w.movedKey(0) // homed in eu under the older topology
	user := key[len("user:"):]
	c := us.NewAcquire()
	if _, _, err := c.AddAttributes(&rules.Attributes{User: user, Path: "/jobs"}, 1); err != nil {
		t.Fatal(err)
	}
	ok, l, err := us.Acquire(context.Background(), c)
	if err != nil || !ok {
		t.Fatalf("Acquire = %v, %v", ok, err)
	}
	if !store.switched {
		t.Fatal("the topology did not switch during the Acquire")
	}
	id, err := leaseid.Parse(l.ID)
	if err != nil {
		t.Fatal(err)
	}
	// Read in the stores (a check here would hand the key off from eu).
	lim := set.Get("jobs-rate").Bucket()
	used := func(s *bucket.Memory) float64 {
		u, err := s.Used(context.Background(), []bucket.Request{{Rule: "jobs-rate", Key: key, Limit: lim}})
		if err != nil {
			t.Fatal(err)
		}
		return math.Round(u[0])
	}
	euUsed, usUsed := used(w.eu.store.(*bucket.Memory)), used(w.usStore)
	if id.Gen != w.older.Generation() || euUsed != 1 || usUsed != 0 {
		t.Fatalf("lease id of generation %d; jobs-rate spent %v in eu, %v here: want generation %d, the spend in eu, none here",
			id.Gen, euUsed, usUsed, w.older.Generation())
	}
}
