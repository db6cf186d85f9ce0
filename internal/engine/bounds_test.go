package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

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

// TestAttributeBounds: a check's attributes over their bounds are refused
// as invalid, naming the attribute, whatever the front door, and at the
// bounds they are decided.
func TestAttributeBounds(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte("rules:\n  - id: r\n    capacity: 10\n    refill_per_second: 1\n    match: {path: /users/*/orders}\n    key_by: user\n"))
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Store: bucket.NewMemory()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	extra := func(n int) map[string]string {
		m := map[string]string{}
		for i := range n {
			m[fmt.Sprint("a", i)] = "v"
		}
		return m
	}
	long := strings.Repeat("x", MaxAttributeBytes+1)
	for _, c := range []struct {
		name string
		a    rules.Attributes
		want string // "" = decided
	}{
		{"at the bounds", rules.Attributes{User: "u", Path: "/users/" + strings.Repeat("x", MaxAttributeBytes-14) + "/orders", Extra: extra(MaxExtraAttributes)}, ""},
		{"a long path", rules.Attributes{User: "u", Path: "/users/" + long + "/orders"}, "attributes.path: "},
		{"a long plan", rules.Attributes{User: "u", Plan: long}, "attributes.plan: "},
		{"too many extra", rules.Attributes{User: "u", Extra: extra(MaxExtraAttributes + 1)}, "attributes.extra: 33 entries"},
		{"a long extra value", rules.Attributes{User: "u", Extra: map[string]string{"k": long}}, `attributes.extra["k"]`},
		{"a long extra name", rules.Attributes{User: "u", Extra: map[string]string{long: "v"}}, `attributes.extra["xxxx`},
	} {
		t.Run(c.name, func(t *testing.T) {
			chk := e.NewCheck()
			_, _, err := chk.AddAttributes(&c.a, 1)
			var inv *InvalidError
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case c.want != "" && (!errors.As(err, &inv) || inv.Field != "attributes" || !strings.HasPrefix(err.Error(), c.want)):
				t.Fatalf("err = %v, want an invalid attributes error starting %q", err, c.want)
			}
		})
	}
}
