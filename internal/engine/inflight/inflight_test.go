package inflight

import (
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func newRule(id string) *Rule {
	return &Rule{ID: id, Expired: prometheus.NewCounter(prometheus.CounterOpts{Name: "expired"}),
		Untracked: prometheus.NewCounter(prometheus.CounterOpts{Name: "untracked"})}
}

// TestTracker: a lease is tracked until removed, renewed past a sweep, and
// counted as expired when a sweep finds it past its expiry; the gauge has
// every rule in force, 0 included.
func TestTracker(t *testing.T) {
	a, b := newRule("a"), newRule("b")
	untracked := prometheus.NewCounter(prometheus.CounterOpts{Name: "all_untracked"})
	f := New(func() []string { return []string{"a", "b"} }, untracked, slog.New(slog.NewTextHandler(io.Discard, nil)))
	now := time.Now()
	f.Add("m1", []*Rule{a}, now.Add(-time.Second)) // already expired
	f.Add("m2", []*Rule{a, b}, now.Add(time.Hour))
	if n := f.Len(); n != 1 {
		t.Fatalf("Len after the second Add = %d, want 1: Add sweeps the expired lease", n)
	}
	if got := testutil.ToFloat64(a.Expired); got != 1 {
		t.Errorf("a expired = %v, want 1", got)
	}
	f.Renew("m2", now.Add(2*time.Hour))
	if n := testutil.CollectAndCount(f); n != 2 {
		t.Errorf("gauges = %d, want one per rule in force", n)
	}
	if !f.Remove("m2") || f.Remove("m2") {
		t.Error("Remove: want true once, then false")
	}
	if n := f.Len(); n != 0 {
		t.Errorf("Len after Remove = %d", n)
	}
	if got := testutil.ToFloat64(untracked); got != 0 {
		t.Errorf("untracked = %v, want 0", got)
	}
}
