package redisstore

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// leaseConformance runs the lease scripts with a fixed clock, beside
// bucket.Leases, on one key.
type leaseConformance struct {
	t           *testing.T
	ctx         context.Context
	client      *redis.ClusterClient
	scripts     map[string]*redis.Script
	usageScript *redis.Script
	key, akey   string
	lim         bucket.LeaseLimit
	// sample is what the next release reports (nil: nothing).
	sample *bucket.LeaseSample
	// keep is what the next acquire keeps of the limit (Keep).
	keep float64
	st   bucket.Leases
}

func newLeaseConformance(t *testing.T, client *redis.ClusterClient, name string, lim bucket.LeaseLimit) *leaseConformance {
	sc := map[string]*redis.Script{}
	for _, op := range []string{lua.LeaseAcquire, lua.LeaseRelease, lua.LeaseRenew} {
		sc[op] = redis.NewScript(lua.Lease(op, lua.FixedClock))
	}
	return &leaseConformance{t: t, ctx: context.Background(), client: client, scripts: sc, key: LeaseKey("conf-"+name, "client"), akey: AdaptiveKey("conf-"+name, "client"), lim: lim,
		usageScript: redis.NewScript(lua.LeaseUsage(lua.FixedClock))}
}

// usage reads the leases held at now in both, for an Acquire keeping
// c.keep, twice, and fails when they differ: the steps after it hold the
// Lua state to the Go one, which a usage does not change.
func (c *leaseConformance) usage(step int, now int64) bucket.LeaseDecision {
	c.t.Helper()
	want := c.st.UsageKeeping(now, c.lim, c.keep)
	for range 2 {
		args := append(LeaseUsageArgs([]bucket.LeaseRequest{{Limit: c.lim, Keep: c.keep}}), strconv.FormatInt(now, 10))
		res, err := c.usageScript.Run(c.ctx, c.client, []string{c.key, c.akey}, args...).Slice()
		if err != nil {
			c.t.Fatalf("step %d: lease usage: %v", step, err)
		}
		got, err := leaseUsage(res, 0)
		if err != nil {
			c.t.Fatal(err)
		}
		if !got.Expires.Equal(want.Expires) {
			c.t.Fatalf("step %d: lease usage at %d expires lua %v, go %v", step, now, got.Expires, want.Expires)
		}
		got.Expires = want.Expires
		if got != want {
			c.t.Fatalf("step %d: lease usage at %d:\nlua %+v\ngo  %+v", step, now, got, want)
		}
	}
	return want
}

func (c *leaseConformance) run(op string, now int64, member string) []any {
	c.t.Helper()
	keys := []string{c.key, c.akey}
	reqs := []bucket.LeaseRequest{{Limit: c.lim, Sample: c.sample, Keep: c.keep}}
	var args []any
	switch op {
	case lua.LeaseAcquire:
		args = AcquireArgs(member, reqs)
	case lua.LeaseRelease:
		args = ReleaseArgs(member, reqs)
	case lua.LeaseRenew:
		args = AcquireArgs(member, reqs)
	}
	args = append(args, strconv.FormatInt(now, 10))
	res, err := c.scripts[op].Run(c.ctx, c.client, keys, args...).Slice()
	if err != nil {
		c.t.Fatalf("%s: %v", op, err)
	}
	return res
}

// step does op at now in both and fails when they differ.
func (c *leaseConformance) step(step int, op string, now int64, member string) bucket.LeaseDecision {
	c.t.Helper()
	res := c.run(op, now, member)
	var want bucket.LeaseDecision
	var got bucket.LeaseDecision
	switch op {
	case lua.LeaseRelease:
		held := c.st.Release(now, c.lim, member, c.sample)
		if r := res[0].(int64) == 1; r != held {
			c.t.Fatalf("step %d: release of %s at %d: lua %v, go %v", step, member, now, r, held)
		}
		return bucket.LeaseDecision{Allowed: held}
	case lua.LeaseAcquire:
		want = c.st.AcquireKeeping(now, c.lim, c.keep, member)
	case lua.LeaseRenew:
		want = c.st.Renew(now, c.lim, member)
	}
	got, err := acquireDecision(res, 0)
	if err != nil {
		c.t.Fatal(err)
	}
	if got != want {
		c.t.Fatalf("step %d: %s of %s at %d:\nlua %+v\ngo  %+v", step, op, member, now, got, want)
	}
	// Every key the scripts leave has an expiry.
	if ttl := c.client.PTTL(c.ctx, c.key).Val(); ttl == -1 {
		c.t.Fatalf("step %d: %s left %s without an expiry", step, op, c.key)
	}
	return got
}

func TestLeaseConformance(t *testing.T) {
	t.Parallel() // its own cluster; the package's two longest tests overlap
	c := redistest.NewCluster(t, 3, 0)
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { client.Close() })
	cases := []struct {
		name  string
		lim   bucket.LeaseLimit
		steps int
		// keeps: each acquire keeps one of them, at random (none: 0).
		keeps []float64
	}{
		{"limit 1", bucket.LeaseLimit{Limit: 1, TTL: time.Second}, 3000, nil},
		{"limit 10", bucket.LeaseLimit{Limit: 10, TTL: 30 * time.Second}, 3000, nil},
		{"limit 3 long", bucket.LeaseLimit{Limit: 3, TTL: bucket.MaxLeaseTTL}, 1000, nil},
		{"the maximum", bucket.LeaseLimit{Limit: bucket.MaxConcurrency, TTL: 2 * time.Second}, 0, nil},
		// Adaptive: releases report random latencies and failures.
		{"adaptive", bucket.LeaseLimit{Limit: 5, TTL: 30 * time.Second, Adaptive: bucket.Adaptive{Min: 1, Max: 12, Target: 100 * time.Millisecond}}, 4000, nil},
		{"adaptive wide", bucket.LeaseLimit{Limit: 4, TTL: 5 * time.Minute, Adaptive: bucket.Adaptive{Min: 2, Max: 30, Target: time.Second}}, 3000, nil},
		// Steps of a whole lease_ttl (1h) go past bucket.AdaptiveTTL.
		{"adaptive forgotten", bucket.LeaseLimit{Limit: 2, TTL: bucket.MaxLeaseTTL, Adaptive: bucket.Adaptive{Min: 1, Max: 6, Target: time.Second}}, 1000, nil},
		// A reserve: acquires keep what a class of {critical: 0.2, default:
		// 0.05} keeps, or an odd fraction.
		{"reserve", bucket.LeaseLimit{Limit: 10, TTL: 30 * time.Second}, 4000, []float64{0, 0.2, 0.2 + 0.05, 0.1 + 0.2, 0.999}},
		{"reserve small", bucket.LeaseLimit{Limit: 3, TTL: time.Second}, 3000, []float64{0, 0.34, 0.5, 0.7}},
		{"reserve adaptive", bucket.LeaseLimit{Limit: 5, TTL: 30 * time.Second, Adaptive: bucket.Adaptive{Min: 1, Max: 12, Target: 100 * time.Millisecond}}, 4000, []float64{0, 0.2, 0.25, 0.45}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cf := newLeaseConformance(t, client, tc.name, tc.lim)
			rng := rand.New(rand.NewPCG(7, uint64(tc.lim.Limit)))
			now := time.Now().UnixMicro()
			ttl := tc.lim.TTL.Microseconds()
			members := 2*tc.lim.Limit + 2
			acquired, refused, gone, full, reserved, usageReserved := 0, 0, 0, 0, 0, 0
			limits := map[int]bool{}
			for step := range tc.steps {
				if a := tc.lim.Adaptive; a.On() {
					// Phases of 300 steps: a healthy backend (1 sample in 25
					// over the target or failed), then an overloaded one
					// (1 in 2).
					bad := rng.IntN(25) == 0
					if (step/300)%2 == 1 {
						bad = rng.IntN(2) == 0
					}
					target := a.Target.Microseconds()
					switch r := rng.IntN(8); {
					case r == 0:
						cf.sample = nil
					case bad && r < 3:
						cf.sample = &bucket.LeaseSample{Duration: time.Duration(rng.Int64N(2*target)) * time.Microsecond, Failed: true}
					case bad:
						cf.sample = &bucket.LeaseSample{Duration: time.Duration(target+1+rng.Int64N(target)) * time.Microsecond}
					case r == 1:
						cf.sample = &bucket.LeaseSample{Duration: a.Target} // exactly the target: under it
					default:
						cf.sample = &bucket.LeaseSample{Duration: time.Duration(rng.Int64N(target)) * time.Microsecond}
					}
				}
				switch rng.IntN(5) {
				case 0:
				case 1:
					now += rng.Int64N(1000)
				case 2:
					now += rng.Int64N(ttl / 4)
				case 3:
					if len(tc.keeps) > 0 && (step/200)%2 == 0 {
						break // a reserve's phase keeping nothing fills the set
					}
					now += ttl // exactly the lease length: an expiry at now is gone
				}
				if len(tc.keeps) > 0 {
					// Phases of 200 steps: every acquire keeps nothing, no
					// lease expires all at once (the set fills, an adaptive
					// limit grows), then each, and the usage before it,
					// keeps one of tc.keeps.
					cf.keep = 0
					if (step/200)%2 == 1 {
						cf.keep = tc.keeps[rng.IntN(len(tc.keeps))]
					}
				}
				if rng.IntN(3) == 0 {
					switch u := cf.usage(step, now); {
					case u.Reserved:
						usageReserved++
						fallthrough
					case !u.Allowed:
						full++
					}
				}
				m := fmt.Sprintf("m%d", rng.IntN(members))
				op := [...]string{lua.LeaseAcquire, lua.LeaseAcquire, lua.LeaseRelease, lua.LeaseRenew}[rng.IntN(4)]
				d := cf.step(step, op, now, m)
				switch {
				case op == lua.LeaseAcquire && d.Allowed:
					acquired++
					limits[d.Limit] = true
				case op == lua.LeaseAcquire:
					refused++
					if d.Reserved {
						reserved++
					}
				case op == lua.LeaseRenew && !d.Allowed:
					gone++
				}
			}
			if tc.steps > 0 && (acquired == 0 || refused == 0 || gone == 0 || full == 0) {
				t.Fatalf("the steps did not cover every outcome: %d acquired, %d refused, %d renewals of gone leases, %d usages of a full set",
					acquired, refused, gone, full)
			}
			// The limit moved both ways (only one when the steps forget it
			// often).
			if len(tc.keeps) > 0 && (reserved == 0 || reserved == refused || usageReserved == 0 || usageReserved == full) {
				t.Fatalf("the steps did not cover both refusals: %d refused, %d of them for the reserve; %d usages refused, %d of them for the reserve",
					refused, reserved, full, usageReserved)
			}
			if seen := slices.Sorted(maps.Keys(limits)); tc.lim.Adaptive.On() && (len(seen) < 2 || tc.lim.TTL < bucket.AdaptiveTTL && (seen[0] >= tc.lim.Limit || seen[len(seen)-1] <= tc.lim.Limit)) {
				t.Fatalf("the adaptive limit did not move both ways from %d: %v", tc.lim.Limit, seen)
			}
			if tc.lim.Limit == bucket.MaxConcurrency {
				// Fill it, one over, then release one and take it.
				for i := range tc.lim.Limit {
					if d := cf.step(i, lua.LeaseAcquire, now+int64(i), fmt.Sprintf("m%d", i)); !d.Allowed {
						t.Fatalf("lease %d of %d refused", i+1, tc.lim.Limit)
					}
				}
				end := now + int64(tc.lim.Limit)
				if d := cf.step(0, lua.LeaseAcquire, end, "over"); d.Allowed || d.RetryAfter != time.Duration(ttl-int64(tc.lim.Limit))*time.Microsecond {
					t.Fatalf("one over the maximum: %+v", d)
				}
				cf.step(0, lua.LeaseRelease, end, "m5")
				if d := cf.step(0, lua.LeaseAcquire, end, "over"); !d.Allowed || d.InFlight != tc.lim.Limit {
					t.Fatalf("after a release: %+v", d)
				}
			}
		})
	}
}

// TestLeaseScripts follows one lease through the store's own scripts (the
// Redis clock): release is idempotent, renewal of an expired lease says it
// is gone, and an expired lease frees its slot.
func TestLeaseScripts(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	s, _ := newTestStore(t, Options{Addrs: c.Addrs(), Timeout: time.Second})
	ctx := context.Background()
	lim := bucket.LeaseLimit{Limit: 1, TTL: time.Second}
	reqs := []bucket.LeaseRequest{{Rule: "reports", Key: "alice", Limit: lim}}
	d, err := s.Acquire(ctx, reqs, "a")
	if err != nil || !d[0].Allowed || d[0].InFlight != 1 {
		t.Fatalf("acquire: %+v, %v", d, err)
	}
	if d, _ := s.Acquire(ctx, reqs, "b"); d[0].Allowed || d[0].RetryAfter <= 0 || d[0].RetryAfter > time.Second {
		t.Fatalf("second acquire at limit 1: %+v", d)
	}
	for i, want := range []bool{true, false} {
		if r, err := s.Release(ctx, reqs, "a"); err != nil || r[0] != want {
			t.Fatalf("release %d: %v, %v; want %v", i, r, err, want)
		}
	}
	if d, _ := s.Renew(ctx, reqs, "a"); d[0].Allowed {
		t.Fatalf("renew of a released lease: %+v", d)
	}
	if d, _ := s.Acquire(ctx, reqs, "b"); !d[0].Allowed {
		t.Fatalf("acquire after release: %+v", d)
	}
	time.Sleep(lim.TTL + 50*time.Millisecond)
	if d, _ := s.Renew(ctx, reqs, "b"); d[0].Allowed {
		t.Fatalf("renew of an expired lease: %+v", d)
	}
	if d, _ := s.Acquire(ctx, reqs, "c"); !d[0].Allowed {
		t.Fatalf("acquire after expiry: %+v", d)
	}
}

// TestLeaseScriptsAdaptiveRenew: the renew script reports the key's
// adaptive limit, as the acquire script does.
func TestLeaseScriptsAdaptiveRenew(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	s, _ := newTestStore(t, Options{Addrs: c.Addrs(), Timeout: time.Second})
	ctx := context.Background()
	lim := bucket.LeaseLimit{Limit: 4, TTL: time.Minute, Adaptive: bucket.Adaptive{Min: 1, Max: 8, Target: 100 * time.Millisecond}}
	reqs := []bucket.LeaseRequest{{Rule: "search", Key: "global", Limit: lim}}
	for _, m := range []string{"a", "b"} {
		if d, err := s.Acquire(ctx, reqs, m); err != nil || !d[0].Allowed {
			t.Fatalf("acquire %s: %+v, %v", m, d, err)
		}
	}
	failed := []bucket.LeaseRequest{{Rule: "search", Key: "global", Limit: lim, Sample: &bucket.LeaseSample{Failed: true}}}
	if r, err := s.Release(ctx, failed, "b"); err != nil || !r[0] {
		t.Fatalf("release: %v, %v", r, err)
	}
	if d, err := s.Renew(ctx, reqs, "a"); err != nil || !d[0].Allowed || d[0].Limit != 3 {
		t.Fatalf("renew after a cut to 3: %+v, %v", d, err)
	}
	if d, err := s.Renew(ctx, reqs, "gone"); err != nil || d[0].Allowed || d[0].Limit != 3 {
		t.Fatalf("renew of a lease not held after a cut to 3: %+v, %v", d, err)
	}
}
