package limiterd

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// evalshaCalls sums the EVALSHA and EVAL calls the cluster's primaries served.
func evalshaCalls(t testing.TB, addrs []string) int64 {
	t.Helper()
	var total int64
	for _, a := range addrs {
		c := redis.NewClient(&redis.Options{Addr: a})
		info, err := c.Info(context.Background(), "commandstats").Result()
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(info, "\r\n") {
			if !strings.HasPrefix(line, "cmdstat_evalsha:") && !strings.HasPrefix(line, "cmdstat_eval:") {
				continue
			}
			_, rest, _ := strings.Cut(line, "calls=")
			n, err := strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			total += n
		}
	}
	return total
}

// flood sends checks for one key from workers goroutines for d; it returns
// the checks made and the store calls they cost.
func flood(t testing.TB, c *redistest.Cluster, cacheSize, workers int, d time.Duration) (checks, calls int64) {
	t.Helper()
	dm := startDaemon(t, c.Addrs(), func(o *Options) { o.Memory.DenyCacheSize = cacheSize })
	client := limiterv1.NewLimiterClient(dial(t, dm.GRPCAddr()))
	key := fmt.Sprint("flood-", cacheSize)
	before := evalshaCalls(t, c.Addrs())
	var n atomic.Int64
	var wg sync.WaitGroup
	end := time.Now().Add(d)
	for range workers {
		wg.Go(func() {
			for time.Now().Before(end) {
				if _, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "flood", Key: key}); err != nil {
					t.Error(err)
					return
				}
				n.Add(1)
			}
		})
	}
	wg.Wait()
	return n.Load(), evalshaCalls(t, c.Addrs()) - before
}

// TestDenyCacheSparesTheStore: one key flooding far over its limit costs
// the store about one call per refill, not one per check.
func TestDenyCacheSparesTheStore(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	const workers, capacity, rate = 16, 10, 2.0
	run := 3 * time.Second
	checks, calls := flood(t, c, DefaultOptions().Memory.DenyCacheSize, workers, run)
	// The burst (the last token's answer already denies), then a probe
	// each time a denial expires (every 1/rate s), and at most one more
	// when that probe reached Redis before the token did: a denial counts
	// from when its store call was sent (so that the cache never refuses
	// what the store would admit), and on a busy machine a call waits a
	// little between being sent and running, so the denial may end just
	// before the refill.
	bound := capacity + workers + 2*(rate*run.Seconds()+1)
	t.Logf("with the deny cache: %d checks, %d store calls (bound %.0f); %.0f checks per store call", checks, calls, bound, float64(checks)/float64(calls))
	if float64(calls) > bound {
		t.Fatalf("%d store calls for %d checks of one flooding key, bound %.0f", calls, checks, bound)
	}
	off, offCalls := flood(t, c, 0, workers, time.Second)
	if offCalls < off {
		t.Fatalf("without the cache %d checks made %d store calls, want one each", off, offCalls)
	}
}
