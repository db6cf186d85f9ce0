package redisstore

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// backend is a deterministic model of a service behind an adaptive
// concurrency rule: it serves capacity requests at once in base time, and
// past that queues them, so a request started while n are in flight takes
// base × n / capacity (Little's law at a fixed throughput).
type backend struct {
	capacity int
	base     time.Duration
}

func (b backend) latency(n int) time.Duration {
	if n <= b.capacity {
		return b.base
	}
	return b.base * time.Duration(n) / time.Duration(b.capacity)
}

// leaseStore is what converge drives.
type leaseStore interface {
	Acquire(ctx context.Context, reqs []bucket.LeaseRequest, member string) ([]bucket.LeaseDecision, error)
	Release(ctx context.Context, reqs []bucket.LeaseRequest, member string) ([]bool, error)
}

// fixedClockLeases runs the lease scripts on a Redis Cluster with the
// instant *now (µs) for the store's clock.
type fixedClockLeases struct {
	client           *redis.ClusterClient
	acquire, release *redis.Script
	now              *int64
}

func (f *fixedClockLeases) run(ctx context.Context, sc *redis.Script, reqs []bucket.LeaseRequest, args []any) ([]any, error) {
	keys := []string{LeaseKey(reqs[0].Rule, reqs[0].Key), AdaptiveKey(reqs[0].Rule, reqs[0].Key)}
	return sc.Run(ctx, f.client, keys, append(args, strconv.FormatInt(*f.now, 10))...).Slice()
}

func (f *fixedClockLeases) Acquire(ctx context.Context, reqs []bucket.LeaseRequest, member string) ([]bucket.LeaseDecision, error) {
	res, err := f.run(ctx, f.acquire, reqs, AcquireArgs(member, reqs))
	if err != nil {
		return nil, err
	}
	d, err := acquireDecision(res, 0)
	return []bucket.LeaseDecision{d}, err
}

func (f *fixedClockLeases) Release(ctx context.Context, reqs []bucket.LeaseRequest, member string) ([]bool, error) {
	res, err := f.run(ctx, f.release, reqs, ReleaseArgs(member, reqs))
	if err != nil {
		return nil, err
	}
	return []bool{res[0].(int64) == 1}, nil
}

// converge drives store with more callers than the backend can take, one
// simulated millisecond a round (*clock, µs, is the store's clock): the
// requests that finished release their leases with their latency, then
// callers acquire until refused. It returns the key's limit, as the
// Acquires saw it, after each round.
func converge(t *testing.T, store leaseStore, clock *int64, rule string, lim bucket.LeaseLimit, b backend, rounds int) []int {
	t.Helper()
	ctx := context.Background()
	req := bucket.LeaseRequest{Rule: rule, Key: "client", Limit: lim}
	type running struct {
		member string
		took   time.Duration
		done   time.Duration
	}
	var inFlight []running
	start := *clock
	limit, next := lim.Limit, 0
	out := make([]int, 0, rounds)
	for round := range rounds {
		now := time.Duration(round) * time.Millisecond
		*clock = start + now.Microseconds()
		kept := inFlight[:0]
		for _, r := range inFlight {
			if r.done > now {
				kept = append(kept, r)
				continue
			}
			rel := req
			rel.Sample = &bucket.LeaseSample{Duration: r.took}
			if held, err := store.Release(ctx, []bucket.LeaseRequest{rel}, r.member); err != nil || !held[0] {
				t.Fatalf("round %d: release of %s: %v, %v", round, r.member, held, err)
			}
		}
		inFlight = kept
		for range lim.Adaptive.Max + 1 {
			member := fmt.Sprintf("m%d", next)
			d, err := store.Acquire(ctx, []bucket.LeaseRequest{req}, member)
			if err != nil {
				t.Fatalf("round %d: acquire: %v", round, err)
			}
			limit = d[0].Limit
			if !d[0].Allowed {
				break
			}
			next++
			took := b.latency(len(inFlight) + 1)
			inFlight = append(inFlight, running{member: member, took: took, done: now + took})
		}
		out = append(out, limit)
	}
	return out
}

// TestAdaptiveConvergence: from a limit five times what a backend can
// take, and from one a tenth of it, the adaptive limit comes to the
// backend's capacity within 1,000 rounds and stays near it, in the
// embedded store and on a Redis Cluster alike.
func TestAdaptiveConvergence(t *testing.T) {
	b := backend{capacity: 20, base: 20 * time.Millisecond}
	// The target is 10% over the unloaded latency: a sample over it says
	// the backend queues.
	adaptive := bucket.Adaptive{Min: 1, Max: 200, Target: 22 * time.Millisecond}
	const rounds, settled = 3000, 1000
	// From round settled on, the limit stays within this band around the
	// capacity.
	lo, hi := b.capacity*4/5, b.capacity*5/4
	check := func(t *testing.T, from int, limits []int) {
		sum := 0
		for i, l := range limits[settled:] {
			if l < lo || l > hi {
				t.Fatalf("round %d: limit %d outside [%d, %d] around the capacity %d (limits from round %d: %v)", settled+i, l, lo, hi, b.capacity, settled, limits[settled:])
			}
			sum += l
		}
		mean := float64(sum) / float64(len(limits)-settled)
		t.Logf("from %d: mean limit %.1f over rounds %d to %d (capacity %d)", from, mean, settled, len(limits), b.capacity)
	}
	c := redistest.NewCluster(t, 3, 0)
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { client.Close() })
	for _, from := range []int{5 * b.capacity, b.capacity / 10} {
		lim := bucket.LeaseLimit{Limit: from, TTL: time.Minute, Adaptive: adaptive}
		rule := fmt.Sprintf("adaptive-from-%d", from)
		t.Run(fmt.Sprintf("memory from %d", from), func(t *testing.T) {
			t.Parallel()
			now := time.Now().UnixMicro()
			m := bucket.NewMemory(bucket.WithClock(func() time.Time { return time.UnixMicro(now) }))
			check(t, from, converge(t, m, &now, rule, lim, b, rounds))
		})
		t.Run(fmt.Sprintf("redis from %d", from), func(t *testing.T) {
			t.Parallel()
			now := time.Now().UnixMicro()
			s := &fixedClockLeases{client: client, now: &now,
				acquire: redis.NewScript(lua.Lease(lua.LeaseAcquire, lua.FixedClock)), release: redis.NewScript(lua.Lease(lua.LeaseRelease, lua.FixedClock))}
			check(t, from, converge(t, s, &now, rule, lim, b, rounds))
		})
	}
}
