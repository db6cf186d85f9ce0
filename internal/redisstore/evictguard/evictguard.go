// Package evictguard watches the memory and eviction policy of a store's
// Redis primaries: a node that may evict keys would silently drop live
// counters, so its checks are refused (unless allowed) and the readings are
// exported.
package evictguard

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// Interval is how often the guard reads the nodes.
const Interval = 10 * time.Second

// Nodes are the primaries a Guard reads and marks: a *redisstore.Store.
type Nodes interface {
	// ForEachPrimary calls fn with a client of each primary.
	ForEachPrimary(ctx context.Context, fn func(ctx context.Context, c *redis.Client) error) error
	// Refuse makes the checks of node addr fail, unsent, with an error
	// wrapping reason; a nil reason sends them again.
	Refuse(addr string, reason error)
}

// ErrUnsafeEviction: a node evicts keys under memory pressure. Live
// counters would vanish, every request would be admitted, and every
// dashboard would stay green.
var ErrUnsafeEviction = errors.New("maxmemory-policy evicts live counters")

// MemoryReading is one primary's memory and eviction state, from INFO.
type MemoryReading struct {
	Node    string
	Policy  string
	Used    int64
	Max     int64
	Evicted int64
}

// Unsafe reports a policy that may evict keys: every policy but noeviction.
// volatile-* policies evict only keys with an expiry, but every bucket has
// one, so they evict live counters exactly like allkeys-*. With noeviction a
// full node refuses the scripts' writes with an error, which the checks see
// and answer by their rules' on_failure. A reading without a policy (an
// INFO that lacks the field) is not reported unsafe.
func (r MemoryReading) Unsafe() bool { return r.Policy != "" && r.Policy != "noeviction" }

// ReadMemory reads every primary's INFO memory and stats. It works where
// CONFIG is disabled (managed services). It returns the readings of the
// primaries that answered and, joined, the errors of those that did not.
func ReadMemory(ctx context.Context, ns Nodes) ([]MemoryReading, error) {
	var mu sync.Mutex
	var out []MemoryReading
	err := ns.ForEachPrimary(ctx, func(ctx context.Context, c *redis.Client) error {
		info, err := c.Info(ctx, "memory", "stats").Result()
		if err != nil {
			return fmt.Errorf("info %s: %w", c.Options().Addr, err)
		}
		r := parseMemory(info)
		r.Node = c.Options().Addr
		mu.Lock()
		out = append(out, r)
		mu.Unlock()
		return nil
	})
	slices.SortFunc(out, func(a, b MemoryReading) int { return strings.Compare(a.Node, b.Node) })
	return out, err
}

func parseMemory(info string) MemoryReading {
	var r MemoryReading
	for _, line := range strings.Split(info, "\r\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		n, _ := strconv.ParseInt(v, 10, 64)
		switch k {
		case "maxmemory_policy":
			r.Policy = v
		case "used_memory":
			r.Used = n
		case "maxmemory":
			r.Max = n
		case "evicted_keys":
			r.Evicted = n
		}
	}
	return r
}

// Guard reads the nodes' memory at start and every Interval and
// exports it. A node whose policy may evict keys (MemoryReading.Unsafe):
//   - found by New, is an error wrapping ErrUnsafeEviction unless
//     allowUnsafe: the caller should not start;
//   - found later by Run (a node that was unreachable at start, or whose
//     policy changed), is reported to Run's onUnsafe and exported, and unless
//     allowUnsafe its checks fail, unsent, with an error wrapping
//     ErrUnsafeEviction (not applied: the rules' on_failure decides them),
//     until a reading finds it safe again.
//
// A Guard is safe for concurrent use.
type Guard struct {
	ns          Nodes
	allowUnsafe bool

	mu       sync.Mutex
	readings map[string]MemoryReading // by node
}

// guardRetry is how soon the guard reads again after a read that did not
// reach every node (such as at start while the store is unreachable).
const guardRetry = time.Second

// New reads the nodes that answer and registers the guard's metrics.
// Nodes that do not answer (or a store not connected yet) are read later
// by Run; that is not an error.
func New(ctx context.Context, ns Nodes, allowUnsafe bool, reg prometheus.Registerer) (*Guard, error) {
	g := &Guard{ns: ns, allowUnsafe: allowUnsafe, readings: make(map[string]MemoryReading)}
	readings, _ := ReadMemory(ctx, ns)
	for _, r := range readings {
		if r.Unsafe() && !allowUnsafe {
			return nil, fmt.Errorf("%w: node %s has maxmemory-policy %s; every bucket has an expiry, so only noeviction keeps live counters; set it, or allow the policy explicitly",
				ErrUnsafeEviction, r.Node, r.Policy)
		}
	}
	g.update(readings)
	for _, c := range []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "limiter_store_memory_used_bytes",
			Help: "Memory used by the Redis primaries, summed.",
		}, func() float64 { return g.sum(func(r MemoryReading) float64 { return float64(r.Used) }) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "limiter_store_memory_used_ratio",
			Help: "Highest used_memory / maxmemory over the primaries (0 when none has a maxmemory).",
		}, g.maxRatio),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "limiter_store_evicted_keys_total",
			Help: "Keys the Redis primaries evicted, summed: any is a live counter lost.",
		}, func() float64 { return g.sum(func(r MemoryReading) float64 { return float64(r.Evicted) }) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "limiter_store_unsafe_eviction_policy",
			Help: "Primaries whose maxmemory-policy may evict keys (any but noeviction).",
		}, func() float64 {
			return g.sum(func(r MemoryReading) float64 {
				if r.Unsafe() {
					return 1
				}
				return 0
			})
		}),
	} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return g, nil
}

func (g *Guard) sum(f func(MemoryReading) float64) float64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	total := 0.0
	for _, r := range g.readings {
		total += f(r)
	}
	return total
}

func (g *Guard) maxRatio() float64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	m := 0.0
	for _, r := range g.readings {
		if r.Max > 0 {
			m = math.Max(m, float64(r.Used)/float64(r.Max))
		}
	}
	return m
}

// Readings returns the last reading of every node read so far, by node.
func (g *Guard) Readings() []MemoryReading {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]MemoryReading, 0, len(g.readings))
	for _, r := range g.readings {
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b MemoryReading) int { return strings.Compare(a.Node, b.Node) })
	return out
}

// update keeps readings as the last of their nodes and refuses the checks
// of the unsafe ones (an error wrapping ErrUnsafeEviction), or sends them
// again once safe.
func (g *Guard) update(readings []MemoryReading) {
	g.mu.Lock()
	for _, r := range readings {
		g.readings[r.Node] = r
	}
	g.mu.Unlock()
	for _, r := range readings {
		var reason error
		if r.Unsafe() && !g.allowUnsafe {
			reason = ErrUnsafeEviction
		}
		g.ns.Refuse(r.Node, reason)
	}
}

// Run reads the nodes every interval until ctx ends, and sooner (every
// second) while a read misses some node. A node that does not answer keeps
// its last reading (the store's own errors show the outage). onUnsafe, when
// not nil, is called with every reading of a node whose policy may evict
// keys.
func (g *Guard) Run(ctx context.Context, interval time.Duration, onUnsafe func(MemoryReading)) {
	t := time.NewTimer(min(interval, guardRetry))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, interval)
		readings, err := ReadMemory(rctx, g.ns)
		cancel()
		g.update(readings)
		for _, r := range readings {
			if r.Unsafe() && onUnsafe != nil {
				onUnsafe(r)
			}
		}
		next := interval
		if err != nil {
			next = min(interval, guardRetry)
		}
		t.Reset(next)
	}
}
