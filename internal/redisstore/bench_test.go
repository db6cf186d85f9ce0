package redisstore

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// BenchmarkStoreTake is the store path alone: concurrent token bucket
// checks over 100,000 keys on a 3-primary cluster, in-process, with and
// without coalescing. Compare with redis-benchmark's EVALSHA ceiling
// (scripts/loadrun.sh prints it):
//
//	go test -run '^$' -bench StoreTake -benchtime 5s ./internal/redisstore
func BenchmarkStoreTake(b *testing.B) {
	c := testenv.RedisCluster(b, 3, 0)
	for _, coalesce := range []bool{true, false} {
		name := map[bool]string{true: "coalesced", false: "one-call-per-check"}[coalesce]
		b.Run(name, func(b *testing.B) {
			s, err := New(context.Background(), Options{Addrs: c.Addrs(), Timeout: time.Second, NoCoalesce: !coalesce}, prometheus.NewRegistry())
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			lim := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 1e6, RefillPerSecond: 1e6}
			keys := make([]string, 100_000)
			for i := range keys {
				keys[i] = "bench-" + strconv.Itoa(i)
			}
			var n atomic.Int64
			b.SetParallelism(32) // 64 callers on 2 cores
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				ctx := context.Background()
				for pb.Next() {
					i := n.Add(1)
					if _, err := s.Take(ctx, bucket.Request{Rule: "bench", Key: keys[i%int64(len(keys))], Limit: lim, Cost: 1}); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "checks/s")
		})
	}
}
