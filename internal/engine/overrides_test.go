package engine

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// overrideRules: tenant-acme has a burst of 5 and tenant-tiny of 1 under
// a rule of 2, refilling too slowly to matter within a test; the window
// rule gives tenant-acme 4 a day and everyone else 2.
const overrideRules = `rules:
  - id: api
    capacity: 2
    refill_per_second: 0.0001
    overrides:
      tenant-acme: {capacity: 5}
      tenant-tiny: {capacity: 1}
  - id: daily
    algorithm: fixed_window
    limit: 2
    window: 24h
    overrides:
      tenant-acme: {limit: 4}
  - id: reports
    algorithm: concurrency
    limit: 1
    overrides:
      tenant-acme: {limit: 3}
`

// A key with an override is decided against its own limit, every other
// key against the rule's: on the embedded store and on Redis Cluster, the
// same checks admit the same counts.
func TestOverridesPerKey(t *testing.T) {
	stores := map[string]func(t *testing.T) bucket.Backend{
		"memory": func(*testing.T) bucket.Backend { return bucket.NewMemory() },
		"redis": func(t *testing.T) bucket.Backend {
			c := redistest.NewCluster(t, 3, 0)
			s, err := redisstore.New(context.Background(), redisstore.Options{Addrs: c.Addrs(), Timeout: 2 * time.Second}, prometheus.NewRegistry())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			return s
		},
	}
	for name, store := range stores {
		t.Run(name, func(t *testing.T) {
			set, err := rules.Parse("r.yml", []byte(overrideRules))
			if err != nil {
				t.Fatal(err)
			}
			e, err := New(Options{Store: store(t)}, set, prometheus.NewRegistry())
			if err != nil {
				t.Fatal(err)
			}
			for _, tt := range []struct {
				rule, key string
				want      int
			}{
				{"api", "tenant-acme", 5},
				{"api", "tenant-tiny", 1},
				{"api", "tenant-other", 2},
				{"daily", "tenant-acme", 4},
				{"daily", "tenant-other", 2},
			} {
				admitted, limit := 0, 0.0
				for range 10 {
					c := e.NewCheck()
					it, err := c.AddRule(tt.rule, tt.key, 1)
					if err != nil {
						t.Fatal(err)
					}
					ok, err := e.Decide(context.Background(), c)
					if err != nil {
						t.Fatal(err)
					}
					if ok {
						admitted++
					}
					limit = it.Decision.Limit
				}
				if admitted != tt.want || limit != float64(tt.want) {
					t.Errorf("%s/%s: %d of 10 admitted, limit %v; want %d and %d", tt.rule, tt.key, admitted, limit, tt.want, tt.want)
				}
			}
			// A concurrency rule's leases, held and released.
			for _, tt := range []struct {
				key  string
				want int
			}{{"tenant-acme", 3}, {"tenant-other", 1}} {
				held, limit := []string{}, 0.0
				for range 5 {
					c := e.NewAcquire()
					it, err := c.AddRule("reports", tt.key, 0)
					if err != nil {
						t.Fatal(err)
					}
					ok, l, err := e.Acquire(context.Background(), c)
					if err != nil {
						t.Fatal(err)
					}
					if ok {
						held = append(held, l.ID)
					}
					limit = it.Decision.Limit
				}
				if len(held) != tt.want || limit != float64(tt.want) {
					t.Errorf("reports/%s: %d of 5 leases held, limit %v; want %d", tt.key, len(held), limit, tt.want)
				}
				for _, id := range held {
					if ok, err := e.Concurrency().Release(context.Background(), id, nil); !ok || err != nil {
						t.Errorf("release of %s: %v, %v", tt.key, ok, err)
					}
				}
			}
			// A cost within the override and above the rule's capacity is
			// valid for the overridden key only.
			c := e.NewCheck()
			if _, err := c.AddRule("api", "tenant-new", 3); err == nil {
				t.Error("cost 3 accepted for a key with the rule's capacity 2")
			}
			if _, err := e.NewCheck().AddRule("api", "tenant-acme", 3); err != nil {
				t.Errorf("cost 3 for tenant-acme (capacity 5): %v", err)
			}
		})
	}
}

// A new rule set changes an override in force for the next check.
func TestOverrideChangeInForce(t *testing.T) {
	parse := func(capacity string) *rules.Set {
		set, err := rules.Parse("r.yml", []byte("rules:\n  - id: api\n    capacity: 1\n    refill_per_second: 0.0001\n    overrides:\n      k: {capacity: "+capacity+"}\n"))
		if err != nil {
			t.Fatal(err)
		}
		return set
	}
	e, err := New(Options{Store: bucket.NewMemory()}, parse("3"), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	left := func() float64 {
		c := e.NewCheck()
		it, err := c.AddRule("api", "k", 1)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.Decide(context.Background(), c); err != nil {
			t.Fatal(err)
		}
		return it.Decision.Limit
	}
	if got := left(); got != 3 {
		t.Fatalf("limit %v, want 3", got)
	}
	if err := e.SetRules(parse("7")); err != nil {
		t.Fatal(err)
	}
	if got := left(); got != 7 {
		t.Fatalf("limit after the change %v, want 7", got)
	}
}
