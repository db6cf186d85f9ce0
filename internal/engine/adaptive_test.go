package engine

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

const adaptiveRules = `
rules:
  - id: search
    algorithm: concurrency
    limit: 2
    lease_ttl: 10s
    key_by: user
    adaptive: {min: 1, max: 5, target_latency: 100ms}
`

// TestAdaptiveRelease: the samples Releases report move the key's limit
// through the engine's one path, the Acquires see it, and the gauge
// follows it; a duration out of bounds is refused naming duration_ms.
func TestAdaptiveRelease(t *testing.T) {
	set, err := rules.Parse("adaptive.yml", []byte(adaptiveRules))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	e, err := New(Options{Store: newFaultStore(), Region: "local", Logger: quietLogger()}, set, reg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	gauge := func() float64 { return testutil.ToFloat64(e.m.AdaptiveLimit.WithLabelValues("search")) }
	if g := gauge(); g != 2 {
		t.Fatalf("gauge before any acquire: %v, want the starting limit 2", g)
	}
	acquire := func() (bool, string, float64) {
		t.Helper()
		c := e.NewAcquire()
		if _, err := c.AddRule("search", "user:ann", 0); err != nil {
			t.Fatal(err)
		}
		ok, l, err := e.Acquire(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		id := ""
		if ok {
			id = l.ID
		}
		return ok, id, c.Leases()[0].Decision.Limit
	}
	fast := &bucket.LeaseSample{Duration: 10 * time.Millisecond}
	// Two fast samples at a limit of 2 (each with both held) make it 3.
	var ids []string
	for range 2 {
		ok, id, _ := acquire()
		if !ok {
			t.Fatal("refused under the limit")
		}
		ids = append(ids, id)
	}
	if ok, _, _ := acquire(); ok {
		t.Fatal("a third lease at limit 2")
	}
	for _, id := range ids {
		if ok, err := e.Concurrency().Release(ctx, id, fast); !ok || err != nil {
			t.Fatalf("release: %v, %v", ok, err)
		}
		ok, id2, _ := acquire()
		if !ok {
			t.Fatal("refused after a release")
		}
		ids = append(ids, id2)
	}
	ok, _, limit := acquire()
	if !ok || limit != 3 || gauge() != 3 {
		t.Fatalf("after two fast samples: allowed %v, limit %v, gauge %v; want a third lease of 3", ok, limit, gauge())
	}
	// A failure cuts it to 2 (x0.9, at least one less).
	if ok, err := e.Concurrency().Release(ctx, ids[2], &bucket.LeaseSample{Failed: true}); !ok || err != nil {
		t.Fatalf("release: %v, %v", ok, err)
	}
	if ok, _, limit := acquire(); ok || limit != 2 || gauge() != 2 {
		t.Fatalf("after a failure, 2 held: allowed %v, limit %v, gauge %v; want refused at 2", ok, limit, gauge())
	}
	for _, d := range []time.Duration{-time.Millisecond, bucket.MaxSampleDuration + time.Millisecond} {
		_, err := e.Concurrency().Release(ctx, ids[3], &bucket.LeaseSample{Duration: d})
		var ie *request.InvalidError
		if !errors.As(err, &ie) || ie.Field != "duration_ms" {
			t.Fatalf("release with a duration of %v: %v, want an invalid duration_ms", d, err)
		}
	}
	// Refused before anything was released.
	if ok, _ := e.Concurrency().Release(ctx, ids[3], nil); !ok {
		t.Fatal("the lease was released by a refused Release")
	}
}
