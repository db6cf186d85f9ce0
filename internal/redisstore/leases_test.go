package redisstore

import (
	"context"
	"fmt"
	"math/rand/v2"
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
	key         string
	lim         bucket.LeaseLimit
	st          bucket.Leases
}

func newLeaseConformance(t *testing.T, client *redis.ClusterClient, name string, lim bucket.LeaseLimit) *leaseConformance {
	sc := map[string]*redis.Script{}
	for _, op := range []string{lua.LeaseAcquire, lua.LeaseRelease, lua.LeaseRenew} {
		sc[op] = redis.NewScript(lua.Lease(op, lua.FixedClock))
	}
	return &leaseConformance{t: t, ctx: context.Background(), client: client, scripts: sc, key: LeaseKey("conf-"+name, "client"), lim: lim,
		usageScript: redis.NewScript(lua.LeaseUsage(lua.FixedClock))}
}

// usage reads the leases held at now in both, twice, and fails when they
// differ: the steps after it hold the Lua state to the Go one, which
// Usage does not change.
func (c *leaseConformance) usage(step int, now int64) bucket.LeaseDecision {
	c.t.Helper()
	want := c.st.Usage(now, c.lim)
	for range 2 {
		res, err := c.usageScript.Run(c.ctx, c.client, []string{c.key}, c.lim.Limit, strconv.FormatInt(now, 10)).Slice()
		if err != nil {
			c.t.Fatalf("step %d: lease usage: %v", step, err)
		}
		got, err := leaseUsage(res, 0, c.lim)
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
	args := []any{member}
	switch op {
	case lua.LeaseAcquire:
		args = append(args, c.lim.Limit, c.lim.TTL.Microseconds())
	case lua.LeaseRenew:
		args = append(args, c.lim.TTL.Microseconds())
	}
	args = append(args, strconv.FormatInt(now, 10))
	res, err := c.scripts[op].Run(c.ctx, c.client, []string{c.key}, args...).Slice()
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
		held := c.st.Release(now, member)
		if r := res[0].(int64) == 1; r != held {
			c.t.Fatalf("step %d: release of %s at %d: lua %v, go %v", step, member, now, r, held)
		}
		return bucket.LeaseDecision{Allowed: held}
	case lua.LeaseAcquire:
		want = c.st.Acquire(now, c.lim, member)
	case lua.LeaseRenew:
		want = c.st.Renew(now, c.lim, member)
	}
	got, err := leaseDecision(res, 0, c.lim)
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
	c := redistest.NewCluster(t, 3, 0)
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { client.Close() })
	cases := []struct {
		name  string
		lim   bucket.LeaseLimit
		steps int
	}{
		{"limit 1", bucket.LeaseLimit{Limit: 1, TTL: time.Second}, 3000},
		{"limit 10", bucket.LeaseLimit{Limit: 10, TTL: 30 * time.Second}, 3000},
		{"limit 3 long", bucket.LeaseLimit{Limit: 3, TTL: bucket.MaxLeaseTTL}, 1000},
		{"the maximum", bucket.LeaseLimit{Limit: bucket.MaxConcurrency, TTL: 2 * time.Second}, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cf := newLeaseConformance(t, client, tc.name, tc.lim)
			rng := rand.New(rand.NewPCG(7, uint64(tc.lim.Limit)))
			now := time.Now().UnixMicro()
			ttl := tc.lim.TTL.Microseconds()
			members := 2*tc.lim.Limit + 2
			acquired, refused, gone, full := 0, 0, 0, 0
			for step := range tc.steps {
				switch rng.IntN(5) {
				case 0:
				case 1:
					now += rng.Int64N(1000)
				case 2:
					now += rng.Int64N(ttl / 4)
				case 3:
					now += ttl // exactly the lease length: an expiry at now is gone
				}
				if rng.IntN(3) == 0 {
					if u := cf.usage(step, now); !u.Allowed {
						full++
					}
				}
				m := fmt.Sprintf("m%d", rng.IntN(members))
				op := [...]string{lua.LeaseAcquire, lua.LeaseAcquire, lua.LeaseRelease, lua.LeaseRenew}[rng.IntN(4)]
				d := cf.step(step, op, now, m)
				switch {
				case op == lua.LeaseAcquire && d.Allowed:
					acquired++
				case op == lua.LeaseAcquire:
					refused++
				case op == lua.LeaseRenew && !d.Allowed:
					gone++
				}
			}
			if tc.steps > 0 && (acquired == 0 || refused == 0 || gone == 0 || full == 0) {
				t.Fatalf("the steps did not cover every outcome: %d acquired, %d refused, %d renewals of gone leases, %d usages of a full set",
					acquired, refused, gone, full)
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
