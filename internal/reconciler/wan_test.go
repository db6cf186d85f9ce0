package reconciler

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/limiterd/limiterd/pkg/region"
)

// wanDelays are the one-way delays between the reference deployment's
// regions, as between real datacenters of these names.
var wanDelays = map[[2]string]time.Duration{
	{"us-east", "eu-west"}:  40 * time.Millisecond,
	{"us-east", "ap-south"}: 110 * time.Millisecond,
	{"eu-west", "ap-south"}: 75 * time.Millisecond,
}

// wanMargin is how much later than delay + interval a spend may be
// applied, or a forwarded check answered, on this shared machine: the
// race detector, the limiterd flush, the relay, the stream source, the
// apply and Redis all run beside the other packages' tests of make test's
// phase 1, where medians of 490-830 ms were seen. The lower bound, no
// sooner than the delay, is what shows the delay is in force; this one
// catches a spend stuck for seconds (a lost flush waits for redelivery).
// The figures themselves are logged, not asserted.
const wanMargin = 1200 * time.Millisecond

// TestWANDelays runs three regions with the reference deployment's delays
// on their gateways and Peer links: a spend admitted in one region is
// applied in each other region no sooner than the one-way delay between
// them, and within delay + interval + margin; a pinned key's check
// forwarded to its home takes the round trip.
func TestWANDelays(t *testing.T) {
	t.Parallel()
	const interval = 200 * time.Millisecond
	s := newWANStack(t, superRegions, wanDelays, quotaRules+`  - id: hard
    capacity: 10
    refill_per_second: 0.000001
    home: pinned
    on_failure: closed
`, interval)
	t.Logf("spends flowing between every pair of regions after %v", s.waitSpendsFlow("quota").Round(time.Millisecond))
	delay := func(a, b string) time.Duration { return s.wan[[2]string{a, b}] }

	t.Run("spends", func(t *testing.T) {
		s.t = t
		defer func() { s.t = t }()
		const samples = 7
		lags := map[[2]string][]time.Duration{}
		for i := range samples {
			for _, from := range s.names {
				// Spread the samples over the flush cycle.
				time.Sleep(time.Duration(rand.Int64N(int64(interval))))
				key := fmt.Sprintf("wan-%s-%d", from, i)
				start := time.Now()
				s.send(from, key, 1)
				pending := slices.DeleteFunc(slices.Clone(s.names), func(r string) bool { return r == from })
				for len(pending) > 0 {
					for j := 0; j < len(pending); j++ {
						if to := pending[j]; s.count(to, key) == 1 {
							lags[[2]string{from, to}] = append(lags[[2]string{from, to}], time.Since(start))
							pending = slices.Delete(pending, j, j+1)
							j--
						}
					}
					if time.Since(start) > 30*time.Second {
						t.Fatalf("a spend of %s in %s not applied in %v after 30s", key, from, pending)
					}
					time.Sleep(2 * time.Millisecond)
				}
			}
		}
		for pair, l := range lags {
			slices.Sort(l)
			d := delay(pair[0], pair[1])
			most := d + interval + wanMargin
			if l[0] < d {
				t.Errorf("%s to %s: a spend applied after %v, under the one-way delay %v (all: %v)", pair[0], pair[1], l[0], d, l)
			}
			// The median: a sample slowed by a busy machine does not
			// fail the test; a path slower than the bound does.
			if med := l[len(l)/2]; med > most {
				t.Errorf("%s to %s: spends applied after a median %v, over delay %v + interval %v + %v (all: %v)", pair[0], pair[1], med, d, interval, wanMargin, l)
			}
			t.Logf("%s to %s (one-way %v): applied after %v", pair[0], pair[1], d, l)
		}
	})

	t.Run("forwarded_check", func(t *testing.T) {
		topo, err := region.Load(s.topologyFile("us-east"))
		if err != nil {
			t.Fatal(err)
		}
		for _, home := range []string{"eu-west", "ap-south"} {
			key := ""
			for i := 0; key == ""; i++ {
				if k := fmt.Sprint("user-", i); topo.Home(k, nil) == home {
					key = k
				}
			}
			rtt := 2 * delay("us-east", home)
			var took []time.Duration
			for range 5 {
				start := time.Now()
				resp, err := s.check("us-east", "hard", key)
				if err != nil || !resp.Allowed {
					t.Fatalf("check of %s homed in %s from us-east: %v, %v", key, home, resp, err)
				}
				took = append(took, time.Since(start))
			}
			slices.Sort(took)
			if took[0] < rtt {
				t.Errorf("a check forwarded from us-east to %s answered in %v, under the round trip %v (all: %v)", home, took[0], rtt, took)
			}
			if took[len(took)/2] > rtt+wanMargin {
				t.Errorf("checks forwarded from us-east to %s answered in a median %v, over the round trip %v + %v (all: %v)", home, took[len(took)/2], rtt, wanMargin, took)
			}
			t.Logf("us-east to %s (round trip %v): forwarded checks answered in %v", home, rtt, took)
		}
	})

}

// TestHoldAcrossTheWAN hammers a key of 100 a minute from the three regions
// at the reference deployment's delays: at any instant the regions
// together admit at most 10% over capacity + rate * 1 s, though the other
// regions admit more than that within one delay (the hold, lua/hold.lua).
// It wants the machine to itself (make test runs it in its second phase):
// on a loaded one the spends arrive after the key is drained, and nothing
// holds a region back.
func TestHoldAcrossTheWAN(t *testing.T) {
	const interval = 200 * time.Millisecond
	const capacity, rate = 100, 100.0 / 60
	s := newWANStack(t, superRegions, wanDelays, fmt.Sprintf(`rules:
  - id: seed
    capacity: %v
    refill_per_second: %v
`, capacity, rate), interval)
	t.Logf("spends flowing between every pair of regions after %v", s.waitSpendsFlow("seed").Round(time.Millisecond))
	h := s.hammer(2*time.Second, 10*time.Millisecond, "seed")
	h.offeredAbove(t, "seed", capacity, 3)
	peak, at := h.peak("seed", capacity, rate)
	most := 0.1 * (capacity + rate)
	remote := h.remoteWindow("seed", s.wan[[2]string{"us-east", "ap-south"}])
	if peak > most {
		t.Errorf("peak excess %+.1f at t=%v, over 10%% of capacity + rate x 1 s (%.2f); the other regions admitted %d within 110 ms", peak, at.Round(time.Millisecond), most, remote)
	}
	t.Logf("peak excess %+.1f at t=%v (at most %.2f); the other regions admitted %d within 110 ms", peak, at.Round(time.Millisecond), most, remote)
}
