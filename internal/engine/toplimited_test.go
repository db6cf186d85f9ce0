package engine

import (
	"context"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/topkeys"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestTopLimited: the keys a rule refuses are counted per rule, the deny
// cache's refusals too, a shadow rule's would-be refusals under the
// shadow, an admitted check not at all; a rule removed takes its counts
// with it, and a size below 0 turns it off.
func TestTopLimited(t *testing.T) {
	const src = "rules:\n  - id: r\n    capacity: 2\n    refill_per_second: 0.001\n  - id: s\n    capacity: 1\n    refill_per_second: 0.001\n    shadow: true\n"
	set, err := rules.Parse("r.yml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	for _, deny := range []int{0, -1} {
		t.Run(fmt.Sprint("deny cache ", deny), func(t *testing.T) {
			e, err := New(Options{Store: bucket.NewMemory(), DenyCacheSize: deny}, set, prometheus.NewRegistry())
			if err != nil {
				t.Fatal(err)
			}
			check := func(key string) bool {
				c := e.NewCheck()
				if _, err := c.AddRule("r", key, 1); err != nil {
					t.Fatal(err)
				}
				if _, err := c.AddRule("s", key, 1); err != nil {
					t.Fatal(err)
				}
				ok, err := e.Decide(context.Background(), c)
				if err != nil {
					t.Fatal(err)
				}
				return ok
			}
			for range 7 {
				check("heavy")
			}
			for range 3 {
				check("light")
			}
			check("once")
			// r admits 2 of each key: heavy refused 5, light 1, once none.
			got := e.TopLimited("r", 10)
			if len(got) != 2 || got[0].Key != "heavy" || got[0].Count != 5 || got[1].Key != "light" || got[1].Count != 1 {
				t.Fatalf("TopLimited(r) = %v, want heavy 5, light 1", got)
			}
			// s (shadow, capacity 1) is checked for the checks r admitted:
			// it would have refused the second of heavy and of light.
			got = e.TopLimited("s", 10)
			if len(got) != 2 || got[0] != (topkeys.Entry{Key: "heavy", Count: 1}) || got[1] != (topkeys.Entry{Key: "light", Count: 1}) {
				t.Fatalf("TopLimited(s) = %v, want heavy 1, light 1", got)
			}
			if got := e.TopLimited("r", 1); len(got) != 1 || got[0].Key != "heavy" {
				t.Fatalf("TopLimited(r, 1) = %v, want heavy alone", got)
			}
			if ids := e.TopLimitedRules(); fmt.Sprint(ids) != "[r s]" {
				t.Fatalf("TopLimitedRules = %v", ids)
			}
			only, err := rules.Parse("r.yml", []byte("rules:\n  - id: r\n    capacity: 2\n    refill_per_second: 0.001\n"))
			if err != nil {
				t.Fatal(err)
			}
			if err := e.SetRules(only); err != nil {
				t.Fatal(err)
			}
			if got := e.TopLimited("s", 10); got != nil {
				t.Fatalf("a removed rule kept its refused keys: %v", got)
			}
		})
	}
	off, err := New(Options{Store: bucket.NewMemory(), TopLimitedSize: -1}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		c := off.NewCheck()
		if _, err := c.AddRule("r", "k", 1); err != nil {
			t.Fatal(err)
		}
		if ok, _ := off.Decide(context.Background(), c); ok != (i < 2) {
			t.Fatalf("check %d: allowed %v", i, ok)
		}
	}
	if off.TopLimited("r", 10) != nil || off.TopLimitedSize() != 0 {
		t.Fatal("TopLimitedSize -1 still counts")
	}
}

// TestTopLimitedLeases: a concurrency rule's refused Acquires count their
// keys too, and its admitted ones do not.
func TestTopLimitedLeases(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte("rules:\n  - id: jobs\n    algorithm: concurrency\n    limit: 2\n    lease_ttl: 1m\n"))
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Store: bucket.NewMemory()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	acquire := func(key string) bool {
		c := e.NewAcquire()
		if _, err := c.AddRule("jobs", key, 0); err != nil {
			t.Fatal(err)
		}
		ok, _, err := e.Acquire(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	for i := range 5 {
		if ok := acquire("busy"); ok != (i < 2) {
			t.Fatalf("acquire %d of busy: allowed %v", i, ok)
		}
	}
	acquire("idle")
	got := e.TopLimited("jobs", 10)
	if len(got) != 1 || got[0] != (topkeys.Entry{Key: "busy", Count: 3}) {
		t.Fatalf("TopLimited(jobs) = %v, want busy 3", got)
	}
}
