package limiterd

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/redisstore/evictguard"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// TestEvictionGuard: a node whose maxmemory-policy evicts any key stops
// limiterd at start, unless allowed; the readings are exported.
func TestEvictionGuard(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ctx := context.Background()
	for _, a := range c.PrimaryAddrs() {
		rc := redis.NewClient(&redis.Options{Addr: a})
		if err := rc.ConfigSet(ctx, "maxmemory", "256mb").Err(); err != nil {
			t.Fatal(err)
		}
		rc.Close()
	}
	first := redis.NewClient(&redis.Options{Addr: c.PrimaryAddrs()[0]})
	defer first.Close()
	if err := first.ConfigSet(ctx, "maxmemory-policy", "allkeys-lru").Err(); err != nil {
		t.Fatal(err)
	}
	o := DefaultOptions()
	o.Server.GRPCAddress, o.Server.HTTPAddress, o.Rules.File, o.Redis.Addrs, o.Logger = "127.0.0.1:0", "127.0.0.1:0", "testdata/rules.yml", c.Addrs(), quietLogger()
	d, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	err = d.Start(ctx)
	if !errors.Is(err, evictguard.ErrUnsafeEviction) || !strings.Contains(err.Error(), "allkeys-lru") {
		t.Fatalf("Start with an allkeys-lru node = %v, want ErrUnsafeEviction naming the policy", err)
	}

	allowed := startDaemon(t, c.Addrs(), func(o *Options) { o.RedisAllowUnsafeEviction = true })
	body := scrape(t, allowed)
	for _, want := range []string{"limiter_store_unsafe_eviction_policy 1", "limiter_store_evicted_keys_total 0", "limiter_store_memory_used_ratio 0.0"} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %q", want)
		}
	}

	if err := first.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err(); err != nil {
		t.Fatal(err)
	}
	safe := startDaemon(t, c.Addrs())
	if body := scrape(t, safe); !strings.Contains(body, "limiter_store_unsafe_eviction_policy 0") {
		t.Error("a noeviction cluster reads as unsafe")
	}
}
