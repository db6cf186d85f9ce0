package engine

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/engine/concurrency"
	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
)

// failingHome answers every forward with err, counting the calls.
type failingHome struct {
	err   error
	calls int
	// handoffs counts the buckets asked for after a switch, apart.
	handoffs int
}

func (h *failingHome) Decide(context.Context, []homes.Item) (bool, []bucket.Decision, error) {
	h.calls++
	return false, nil, h.err
}
func (h *failingHome) Refund(context.Context, []homes.Item) error { return nil }
func (h *failingHome) Settle(context.Context, bucket.Settlement) (bucket.Settled, error) {
	return bucket.Settled{}, h.err
}
func (h *failingHome) Usage(context.Context, []homes.Item) ([]bucket.Decision, error) {
	return nil, h.err
}
func (h *failingHome) Handoff(context.Context, []homes.Item) ([]float64, error) {
	h.handoffs++
	return nil, h.err
}
func (h *failingHome) AcquireLease(context.Context, string) (concurrency.HomeLease, error) {
	h.calls++
	return concurrency.HomeLease{}, h.err
}
func (h *failingHome) ReleaseLease(context.Context, string, *bucket.LeaseSample) (bool, error) {
	return false, h.err
}
func (h *failingHome) RenewLease(context.Context, string) (bool, time.Time, time.Duration, error) {
	return false, time.Time{}, 0, h.err
}

// TestHomeFailures: a check and an Acquire read a home region's failure
// the same way. A refusal as routed with a stale topology reads the
// topology again and routes the call once more under the newer one, or,
// when there is none, leaves the decision to the rules' on_failure; an
// unknown rule at the home is the answer.
func TestHomeFailures(t *testing.T) {
	set, err := rules.Parse("rules.yml", []byte(`rules:
  - id: rate
    capacity: 5
    refill_per_second: 1
    home: pinned
    on_failure: open
  - id: conc
    algorithm: concurrency
    limit: 5
    lease_ttl: 10s
    home: pinned
    on_failure: open
`))
	if err != nil {
		t.Fatal(err)
	}
	topo := func(gen int, regions ...string) *region.Topology {
		src := fmt.Sprintf("generation: %d\nregions:\n", gen)
		for i, r := range regions {
			src += fmt.Sprintf("  - name: %s\n    limiter_address: 127.0.0.1:%d\n", r, i+1)
		}
		tp, err := region.Parse("topology.yml", []byte(src))
		if err != nil {
			t.Fatal(err)
		}
		return tp
	}
	older, newer := topo(1, "us", "eu", "ap"), topo(2, "us", "ap")
	// A key homed in eu by the older topology and here by the newer one.
	key := ""
	for i := range 10_000 {
		k := fmt.Sprintf("user:%d", i)
		if older.Home(k, nil) == "eu" && newer.Home(k, nil) == "us" {
			key = k
			break
		}
	}
	if key == "" {
		t.Fatal("no key moves from eu to us")
	}
	// Each call spends 1 and returns what remains: 4 of the full limit
	// when decided here under the newer topology, less under this
	// region's share of it (limit / 3 regions) when the home failed.
	calls := map[string]func(e *Engine) (bool, float64, error){
		"check": func(e *Engine) (bool, float64, error) {
			c := e.NewCheck()
			it, err := c.AddRule("rate", key, 1)
			if err != nil {
				t.Fatal(err)
			}
			ok, err := e.Decide(context.Background(), c)
			return ok, it.Decision.Remaining, err
		},
		"acquire": func(e *Engine) (bool, float64, error) {
			c := e.NewAcquire()
			it, err := c.AddRule("conc", key, 0)
			if err != nil {
				t.Fatal(err)
			}
			ok, _, err := e.Acquire(context.Background(), c)
			return ok, it.Decision.Remaining, err
		},
	}
	stale := fmt.Errorf("refused: %w", homes.ErrStaleTopology)
	for name, call := range calls {
		for _, tc := range []struct {
			name     string
			err      error
			newer    bool // the reload finds the newer topology
			wantOK   bool
			wantFull bool // decided from the full limit
			wantErr  error
			wantGen  uint64
			staleInc float64
		}{
			{"stale, newer file", stale, true, true, true, nil, 2, 1},
			{"stale, no newer file", stale, false, true, false, nil, 1, 1},
			{"unknown rule at the home", fmt.Errorf("home: %w", request.ErrUnknownRule), true, false, false, request.ErrUnknownRule, 1, 0},
		} {
			t.Run(name+"/"+tc.name, func(t *testing.T) {
				eu, ap := &failingHome{err: tc.err}, &failingHome{err: errors.New("not called")}
				var e *Engine
				reloads := 0
				reload := func() {
					reloads++
					if tc.newer {
						if err := e.SetTopology(newer, map[string]homes.Home{"ap": ap}, nil); err != nil {
							t.Error(err)
						}
					}
				}
				e, err = New(Options{Store: bucket.NewMemory(), Region: "us", Topology: older,
					Homes: map[string]homes.Home{"eu": eu, "ap": ap}, ReloadTopology: reload, Logger: quietLogger()}, set, prometheus.NewRegistry())
				if err != nil {
					t.Fatal(err)
				}
				ok, remaining, err := call(e)
				if ok != tc.wantOK || !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) {
					t.Fatalf("%s: %v, %v; want %v, %v", name, ok, err, tc.wantOK, tc.wantErr)
				}
				if ok && (remaining == 4) != tc.wantFull {
					t.Errorf("remaining %v after spending 1; want 4 (from the full limit) %v", remaining, tc.wantFull)
				}
				if eu.calls != 1 || ap.calls != 0 {
					t.Errorf("forwards: eu %d, ap %d; want 1 to eu (never again), none to ap", eu.calls, ap.calls)
				}
				if wantReloads := int(tc.staleInc); reloads != wantReloads {
					t.Errorf("topology read again %d times, want %d", reloads, wantReloads)
				}
				if got := e.topo.Load().Gen; got != tc.wantGen {
					t.Errorf("generation in force %d, want %d", got, tc.wantGen)
				}
				if got := testutil.ToFloat64(e.m.Stale.WithLabelValues("eu")); got != tc.staleInc {
					t.Errorf("stale refusals counted %v, want %v", got, tc.staleInc)
				}
			})
		}
	}
}
