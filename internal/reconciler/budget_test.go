package reconciler

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/spendpub"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// TestBudgetAcrossTheWAN runs three regions with the reference
// deployment's delays and a 3 s gossip interval. A key whose spend in one
// region reaches its rule's budget (one check costing 5 of a rule with a
// limit of 100 and max_overshoot 0.05) is applied in each other region
// within the one-way delay + spendpub.BudgetTick + budgetMargin, not at
// the interval; a key spending under its budget (the quota's), checked at the
// same moment just after an interval flush, waits for the next one.
// budgetMargin is TestBudgetAcrossTheWAN's allowance for a busy machine
// over delay + tick: under make test's load (four such stacks at once,
// beside other packages) hot keys took a median 1.1 s. It stays well under
// the test's 3 s interval, unlike wanMargin: a hot key left for the
// interval, checked just after a flush, must fail the test.
const budgetMargin = 1500 * time.Millisecond

func TestBudgetAcrossTheWAN(t *testing.T) {
	t.Parallel()
	const interval = 3 * time.Second
	s := newWANStack(t, superRegions, wanDelays, quotaRules+`  - id: tight
    algorithm: fixed_window
    limit: 100
    window: 8760h
    max_overshoot: 0.05
`, interval)
	t.Logf("spends flowing between every pair of regions after %v", s.waitSpendsFlow("quota").Round(time.Millisecond))
	stored := func(region, key string) float64 {
		v, err := s.regions[region].redis.Get(context.Background(), redisstore.Key("tight", key)).Result()
		if err != nil {
			return 0
		}
		f := strings.Fields(v)
		if len(f) != 2 {
			t.Fatalf("tight state %q", v)
		}
		n, err := strconv.ParseFloat(f[1], 64)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	check := func(region, key string, cost float64) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if resp, err := s.regions[region].client.Check(ctx, &limiterv1.CheckRequest{RuleId: "tight", Key: key, Cost: cost}); err != nil || !resp.Allowed {
			t.Fatalf("%s: %v, %v", region, resp, err)
		}
	}
	// lag waits until every region but from stores want for key (of
	// rule tight, or the quota) and returns how long each took from start.
	lag := func(from, key string, want float64, start time.Time, stored func(region, key string) float64) map[string]time.Duration {
		got := map[string]time.Duration{}
		for len(got) < len(s.names)-1 {
			for _, to := range s.names {
				if _, ok := got[to]; !ok && to != from && stored(to, key) == want {
					got[to] = time.Since(start)
				}
			}
			if time.Since(start) > 30*time.Second {
				raw := map[string]string{}
				for _, r := range s.names {
					raw[r] = fmt.Sprint(stored(r, key))
				}
				t.Fatalf("a spend of %s in %s not applied everywhere after 30s: %v; stored %v", key, from, got, raw)
			}
			time.Sleep(2 * time.Millisecond)
		}
		return got
	}

	// Each region's samples back to back: the first quiet key of a
	// region arrives just after its limiterd's interval flush, so each
	// later one is checked just after a flush and waits nearly a whole
	// interval, where a hot key is not made to wait.
	const samples = 3
	hot := map[[2]string][]time.Duration{}
	var quiet []time.Duration
	for _, from := range s.names {
		for i := range samples {
			hk, qk := fmt.Sprintf("hot-%s-%d", from, i), fmt.Sprintf("quiet-%s-%d", from, i)
			start := time.Now()
			s.send(from, qk, 1)
			check(from, hk, 5) // the budget
			for to, d := range lag(from, hk, 5, start, stored) {
				hot[[2]string{from, to}] = append(hot[[2]string{from, to}], d)
			}
			for _, d := range lag(from, qk, 1, start, s.count) {
				if i > 0 {
					quiet = append(quiet, d)
				}
			}
		}
	}
	slowest := time.Duration(0)
	for pair, l := range hot {
		slices.Sort(l)
		d := s.wan[pair]
		most := d + spendpub.BudgetTick + budgetMargin
		slowest = max(slowest, most)
		if l[0] < d {
			t.Errorf("%s to %s: a hot key applied after %v, under the one-way delay %v (all: %v)", pair[0], pair[1], l[0], d, l)
		}
		// The median: a sample slowed by a busy machine does not fail
		// the test; a hot key left for the interval does.
		if med := l[len(l)/2]; med > most {
			t.Errorf("%s to %s: hot keys applied after a median %v, over delay %v + tick %v + %v (all: %v)", pair[0], pair[1], med, d, spendpub.BudgetTick, budgetMargin, l)
		}
		t.Logf("%s to %s (one-way %v): hot keys applied after %v", pair[0], pair[1], d, l)
	}
	slices.Sort(quiet)
	t.Logf("quiet keys checked just after an interval flush applied after %v", quiet)
	if med := quiet[len(quiet)/2]; med <= slowest {
		t.Errorf("quiet keys checked just after an interval flush applied after a median %v, within %v (all: %v): they did not wait for the interval %v", med, slowest, quiet, interval)
	}
}
