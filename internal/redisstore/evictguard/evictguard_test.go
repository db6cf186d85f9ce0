package evictguard

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// newStore makes a store with its own registry, closed with the test.
func newStore(t *testing.T, opts redisstore.Options) (*redisstore.Store, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	s, err := redisstore.New(context.Background(), opts, reg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, reg
}

var testLimit = bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 1e-6}

// TestUnsafePolicy: every bucket has an expiry, so a volatile-* policy
// evicts live counters exactly like allkeys-*; only noeviction keeps them.
func TestUnsafePolicy(t *testing.T) {
	tests := []struct {
		name   string
		policy string
		unsafe bool
	}{
		{name: "noeviction", policy: "noeviction", unsafe: false},
		{name: "allkeys-lru", policy: "allkeys-lru", unsafe: true},
		{name: "allkeys-lfu", policy: "allkeys-lfu", unsafe: true},
		{name: "allkeys-random", policy: "allkeys-random", unsafe: true},
		{name: "volatile-lru", policy: "volatile-lru", unsafe: true},
		{name: "volatile-lfu", policy: "volatile-lfu", unsafe: true},
		{name: "volatile-random", policy: "volatile-random", unsafe: true},
		{name: "volatile-ttl", policy: "volatile-ttl", unsafe: true},
		{name: "a policy of a later Redis", policy: "allkeys-something-new", unsafe: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := (MemoryReading{Policy: tt.policy}).Unsafe(); got != tt.unsafe {
				t.Errorf("MemoryReading{Policy: %q}.Unsafe() = %v, want %v", tt.policy, got, tt.unsafe)
			}
		})
	}
}

// TestGuard: the eviction guard refuses an unsafe node at start; it works
// while the store is unreachable at start and reads the nodes once they
// answer; a node found unsafe then has its checks failed (not applied)
// unless unsafe policies are allowed, until it is safe again.
func TestGuard(t *testing.T) {
	ctx := context.Background()
	setPolicy := func(t *testing.T, addr, policy string) {
		t.Helper()
		c := redis.NewClient(&redis.Options{Addr: addr})
		defer c.Close()
		if err := c.ConfigSet(ctx, "maxmemory-policy", policy).Err(); err != nil {
			t.Fatal(err)
		}
		// Kept across a restart.
		if err := c.ConfigRewrite(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("unsafe at start", func(t *testing.T) {
		node := redistest.NewNode(t)
		setPolicy(t, node.Addr(), "volatile-lru")
		s, _ := newStore(t, redisstore.Options{Addrs: []string{node.Addr()}})
		if _, err := New(ctx, s, false, prometheus.NewRegistry()); !errors.Is(err, ErrUnsafeEviction) {
			t.Fatalf("NewGuard with a volatile-lru node = %v, want ErrUnsafeEviction", err)
		}
		if _, err := New(ctx, s, true, prometheus.NewRegistry()); err != nil {
			t.Fatalf("NewGuard allowing unsafe policies: %v", err)
		}
	})

	for _, allow := range []bool{false, true} {
		t.Run(map[bool]string{false: "unsafe once reachable", true: "unsafe once reachable, allowed"}[allow], func(t *testing.T) {
			node := redistest.NewNode(t)
			setPolicy(t, node.Addr(), "allkeys-lru")
			node.Stop()
			s, reg := newStore(t, redisstore.Options{Addrs: []string{node.Addr()}, Timeout: time.Second})
			g, err := New(ctx, s, allow, reg)
			if err != nil {
				t.Fatalf("NewGuard with the store unreachable: %v", err)
			}
			found := make(chan MemoryReading, 100)
			rctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() {
				g.Run(rctx, 100*time.Millisecond, func(r MemoryReading) {
					select {
					case found <- r:
					default:
					}
				})
				close(done)
			}()
			t.Cleanup(func() { cancel(); <-done })

			node.Start()
			if r := <-found; r.Policy != "allkeys-lru" || r.Node != node.Addr() {
				t.Fatalf("onUnsafe(%+v)", r)
			}
			if got := testenv.MetricValue(t, reg, "limiter_store_unsafe_eviction_policy"); got != 1 {
				t.Fatalf("limiter_store_unsafe_eviction_policy = %v, want 1", got)
			}
			req := bucket.Request{Rule: "r", Key: "guarded", Limit: testLimit, Cost: 1}
			if allow {
				testenv.WaitFor(t, "deciding", func() bool { d, err := s.Take(ctx, req); return err == nil && d.Allowed })
				return
			}
			testenv.WaitFor(t, "connected", s.Connected)
			_, err = s.Take(ctx, req)
			if !errors.Is(err, ErrUnsafeEviction) || errors.Is(err, bucket.ErrOverloaded) || errors.Is(err, bucket.ErrOutcomeUnknown) {
				t.Fatalf("Take on an unsafe node = %v, want ErrUnsafeEviction (not applied)", err)
			}
			setPolicy(t, node.Addr(), "noeviction")
			testenv.WaitFor(t, "deciding once the node is safe", func() bool { d, err := s.Take(ctx, req); return err == nil && d.Allowed })
		})
	}
}

// TestMetricsLint: the guard's metrics, beside the store's, follow
// Prometheus conventions, and it exports the node's reading.
func TestMetricsLint(t *testing.T) {
	node := redistest.NewNode(t)
	s, reg := newStore(t, redisstore.Options{Addrs: []string{node.Addr()}})
	testenv.WaitFor(t, "connected", s.Connected)
	if _, err := New(context.Background(), s, false, reg); err != nil {
		t.Fatal(err)
	}
	if used := testenv.MetricValue(t, reg, "limiter_store_memory_used_bytes"); used <= 0 {
		t.Errorf("limiter_store_memory_used_bytes = %v, want the node's used_memory", used)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	testenv.Lint(t, mfs)
}
