package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/engine/concurrency"
	"github.com/limiterd/limiterd/internal/engine/inflight"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestLeaseTableFull: with more keys of a lease rule than the lease table
// holds, the keys without a lease are decided by the store alone, with
// their own cost: every key is admitted exactly its capacity, the table
// never exceeds its size, and the checks turned away are counted.
func TestLeaseTableFull(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte("rules:\n  - id: leased\n    capacity: 10\n    refill_per_second: 0.001\n    lease: 5\n"))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	e, err := New(Options{Store: bucket.NewMemory(), MaxLeaseKeys: 32}, set, reg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const keys, checks = 200, 12
	admitted := make([]int, keys)
	for range checks {
		// Round robin, so that every key wants a lease at once.
		for k := range keys {
			c := e.NewCheck()
			if _, err := c.AddRule("leased", fmt.Sprint("user:", k), 1); err != nil {
				t.Fatal(err)
			}
			ok, err := e.Decide(ctx, c)
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				admitted[k]++
			}
			if n := e.leases.Len(); n > 32 {
				t.Fatalf("%d keys hold a lease, the table holds 32", n)
			}
		}
	}
	for k, n := range admitted {
		if n != 10 {
			t.Fatalf("key %d admitted %d of %d, want exactly its capacity 10", k, n, checks)
		}
	}
	if full := sumOf(t, reg, "limiter_lease_table_full_total"); full == 0 {
		t.Fatal("limiter_lease_table_full_total is 0 with 200 keys for a table of 32")
	}
}

// sumOf is the sum of the values of metric family name on reg.
func sumOf(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		sum := 0.0
		for _, m := range mf.GetMetric() {
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
		return sum
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// TestFallbackBounded: while the store is down, a flood of distinct keys
// decided by the fallback never takes more than its cap, the fallback's
// size is exported, and it still refuses a key over its share.
func TestFallbackBounded(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte("rules:\n  - id: open\n    algorithm: sliding_log\n    limit: 3\n    window: 1h\n    on_failure: open\n"))
	if err != nil {
		t.Fatal(err)
	}
	store := newFaultStore()
	store.setFail(errors.New("connection refused"))
	reg := prometheus.NewRegistry()
	e, err := New(Options{Store: store, FallbackMaxBytes: bucket.MinMaxBytes, Logger: quietLogger()}, set, reg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	check := func(key string) bool {
		c := e.NewCheck()
		if _, err := c.AddRule("open", key, 1); err != nil {
			t.Fatal(err)
		}
		ok, err := e.Decide(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	for i := range 20_000 {
		if !check(fmt.Sprint("flood:", i)) {
			t.Fatalf("flood key %d refused on its first check", i)
		}
	}
	bytes, limit := sumOf(t, reg, "limiter_memory_bytes"), sumOf(t, reg, "limiter_memory_max_bytes")
	if bytes > limit || limit != bucket.MinMaxBytes {
		t.Fatalf("fallback holds %v bytes, cap %v (want %d)", bytes, limit, bucket.MinMaxBytes)
	}
	if ev := sumOf(t, reg, "limiter_memory_evictions_total"); ev == 0 {
		t.Fatal("20,000 keys fit in the fallback's 1 MiB without an eviction")
	}
	for i := range 3 {
		if !check("user:steady") {
			t.Fatalf("check %d of a fresh key refused", i)
		}
	}
	if check("user:steady") {
		t.Fatal("a 4th check within the hour admitted by the fallback")
	}
}

// TestTrackedLeasesBoundPerRule: an instance tracks at most
// inflight.MaxTrackedLeasesPerRule leases of one rule for the in-flight gauge. Past
// it the Acquire is still allowed (the lease is held in the store; a flood
// of one rule's keys must not lock its other clients out) but left out of
// the gauge, counted as untracked under its rule and logged once; the
// other rules are tracked as before, and a release makes room again.
func TestTrackedLeasesBoundPerRule(t *testing.T) {
	set, err := rules.Parse("rules.yml", []byte(`rules:
  - id: flood
    algorithm: concurrency
    limit: 1
    lease_ttl: 1h
  - id: other
    algorithm: concurrency
    limit: 1
    lease_ttl: 1h
`))
	if err != nil {
		t.Fatal(err)
	}
	var logs strings.Builder
	reg := prometheus.NewRegistry()
	e, err := New(Options{Store: bucket.NewMemory(), Region: "local", Logger: slog.New(slog.NewTextHandler(&logs, nil))}, set, reg)
	if err != nil {
		t.Fatal(err)
	}
	acquire := func(rule, key string) *concurrency.Lease {
		t.Helper()
		ok, l, err := acquireRule(t, e, rule, key)
		if !ok || err != nil {
			t.Fatalf("Acquire %s %s: %v, %v", rule, key, ok, err)
		}
		return l
	}
	var first *concurrency.Lease
	for i := range inflight.MaxTrackedLeasesPerRule + 10 {
		l := acquire("flood", fmt.Sprint("k", i))
		if i == 0 {
			first = l
		}
	}
	acquire("other", "k")
	inFlight := func(rule string) float64 {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != "limiter_concurrency_leases_in_flight" {
				continue
			}
			for _, m := range mf.GetMetric() {
				if m.GetLabel()[0].GetValue() == rule {
					return m.GetGauge().GetValue()
				}
			}
		}
		t.Fatalf("no in-flight gauge of %s", rule)
		return 0
	}
	if got := inFlight("flood"); got != inflight.MaxTrackedLeasesPerRule {
		t.Errorf("flood in flight = %v, want the bound %d", got, inflight.MaxTrackedLeasesPerRule)
	}
	if got := inFlight("other"); got != 1 {
		t.Errorf("other in flight = %v, want 1: one rule's flood left another untracked", got)
	}
	if got := testutil.ToFloat64(e.m.Leases.WithLabelValues("flood", metrics.EventUntracked)); got != 10 {
		t.Errorf("flood untracked = %v, want 10", got)
	}
	if n := strings.Count(logs.String(), "rule=flood"); n != 1 || !strings.Contains(logs.String(), fmt.Sprint(inflight.MaxTrackedLeasesPerRule)) {
		t.Errorf("want one warning naming the rule and the bound, got:\n%s", logs.String())
	}
	if ok, err := e.Concurrency().Release(context.Background(), first.ID, nil); !ok || err != nil {
		t.Fatalf("Release: %v, %v", ok, err)
	}
	acquire("flood", "again")
	if got := inFlight("flood"); got != inflight.MaxTrackedLeasesPerRule {
		t.Errorf("flood in flight after a release and an acquire = %v, want %d", got, inflight.MaxTrackedLeasesPerRule)
	}
	if got := testutil.ToFloat64(e.m.Leases.WithLabelValues("flood", metrics.EventUntracked)); got != 10 {
		t.Errorf("the acquire after a release was not tracked (untracked %v)", got)
	}
}

// TestTrackedLeasesSweptIncrementally: the leases this instance tracks are
// swept a few at a time, the soonest expiry first: an Acquire after 5,000
// leases expired drops at most inflight.SweepBatch of them under the lock, not the
// whole table; a scrape drops every expired one, each counted as expired.
func TestTrackedLeasesSweptIncrementally(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		set, err := rules.Parse("rules.yml", []byte("rules:\n  - id: r\n    algorithm: concurrency\n    limit: 1\n    lease_ttl: 1s\n"))
		if err != nil {
			t.Fatal(err)
		}
		reg := prometheus.NewRegistry()
		e, err := New(Options{Store: bucket.NewMemory(), Region: "local", Logger: quietLogger()}, set, reg)
		if err != nil {
			t.Fatal(err)
		}
		const n = 5000
		for i := range n {
			if ok, _, err := acquireRule(t, e, "r", fmt.Sprint("k", i)); !ok || err != nil {
				t.Fatalf("Acquire %d: %v, %v", i, ok, err)
			}
		}
		time.Sleep(2 * time.Second)
		if ok, _, err := acquireRule(t, e, "r", "late"); !ok || err != nil {
			t.Fatalf("Acquire after the expiry: %v, %v", ok, err)
		}
		left := e.inflight.Len()
		if dropped := n + 1 - left; dropped > inflight.SweepBatch {
			t.Errorf("one Acquire swept %d expired leases under the lock, want at most %d", dropped, inflight.SweepBatch)
		}
		if got := sumOf(t, reg, "limiter_concurrency_leases_in_flight"); got != 1 {
			t.Errorf("in flight after a scrape = %v, want 1", got)
		}
		if got := testutil.ToFloat64(e.m.Leases.WithLabelValues("r", metrics.EventExpired)); got != n {
			t.Errorf("expired = %v, want %d", got, n)
		}
	})
}

// budgetRecorder records the budget each spend was given with.
type budgetRecorder struct{ budgets []float64 }

func (b *budgetRecorder) AddPaced(_, _ string, _, budget, _ float64, _ int64) {
	b.budgets = append(b.budgets, budget)
}

// TestSpendBudgetSharedByTheFleet: each instance of a region holds its own
// unpublished spends, so a key's budget (max_overshoot × capacity) is
// divided by the region's live instance count; otherwise N instances
// could hold N budgets of one key unpublished. With key affinity (each
// key's checks come to one instance) the instance holds the whole budget.
func TestSpendBudgetSharedByTheFleet(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte("rules:\n  - id: r\n    capacity: 100\n    refill_per_second: 10\n    max_overshoot: 0.2\n"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		fleet    int
		affinity bool
		want     float64
	}{{0, false, 20}, {1, false, 20}, {4, false, 5}, {4, true, 20}} {
		rec := &budgetRecorder{}
		opts := Options{Store: bucket.NewMemory(), Spends: rec, KeyAffinity: tc.affinity}
		if tc.fleet > 0 {
			opts.FleetSize = func() int { return tc.fleet }
		}
		e, err := New(opts, set, prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		c := e.NewCheck()
		if _, err := c.AddRule("r", "k", 1); err != nil {
			t.Fatal(err)
		}
		if ok, err := e.Decide(context.Background(), c); !ok || err != nil {
			t.Fatalf("fleet %d: Decide = %v, %v", tc.fleet, ok, err)
		}
		if len(rec.budgets) != 1 || rec.budgets[0] != tc.want {
			t.Fatalf("fleet %d: spends recorded with budgets %v, want [%v]", tc.fleet, rec.budgets, tc.want)
		}
	}
}
