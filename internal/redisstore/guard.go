package redisstore

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// GuardInterval is how often the eviction guard reads the nodes.
const GuardInterval = 10 * time.Second

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
// CONFIG is disabled (managed services).
func (s *Store) ReadMemory(ctx context.Context) ([]MemoryReading, error) {
	var mu sync.Mutex
	var out []MemoryReading
	read := func(ctx context.Context, c *redis.Client) error {
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
	}
	var err error
	if cc, ok := s.client.(*redis.ClusterClient); ok {
		err = cc.ForEachMaster(ctx, read)
	} else {
		err = read(ctx, s.client.(*redis.Client))
	}
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

// Guard reads the nodes' memory at start and every GuardInterval and
// exports it. At start, a policy other than noeviction on any node is an
// error wrapping ErrUnsafeEviction unless allowUnsafe.
type Guard struct {
	s           *Store
	allowUnsafe bool

	mu       sync.Mutex
	readings []MemoryReading
}

// NewGuard checks the nodes once and registers the guard's metrics.
func NewGuard(ctx context.Context, s *Store, allowUnsafe bool, reg prometheus.Registerer) (*Guard, error) {
	g := &Guard{s: s, allowUnsafe: allowUnsafe}
	readings, err := s.ReadMemory(ctx)
	if err != nil {
		return nil, err
	}
	for _, r := range readings {
		if r.Unsafe() && !allowUnsafe {
			return nil, fmt.Errorf("%w: node %s has maxmemory-policy %s; every bucket has an expiry, so only noeviction keeps live counters; set it, or allow the policy explicitly",
				ErrUnsafeEviction, r.Node, r.Policy)
		}
	}
	g.readings = readings
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

// Readings returns the last readings.
func (g *Guard) Readings() []MemoryReading {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]MemoryReading(nil), g.readings...)
}

// Run reads the nodes every interval until ctx ends; failed reads keep the
// last readings (the store's own errors show the outage).
func (g *Guard) Run(ctx context.Context, interval time.Duration, onUnsafe func(MemoryReading)) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, interval)
		readings, err := g.s.ReadMemory(rctx)
		cancel()
		if err != nil {
			continue
		}
		for _, r := range readings {
			if r.Unsafe() && onUnsafe != nil {
				onUnsafe(r)
			}
		}
		g.mu.Lock()
		g.readings = readings
		g.mu.Unlock()
	}
}
