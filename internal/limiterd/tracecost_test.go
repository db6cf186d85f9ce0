package limiterd

import (
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/testenv/otlptest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/internal/tracing"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// traceCostRules is one rule that admits every check of a benchmark.
const traceCostRules = `rules:
  - id: bench
    capacity: 1e12
    refill_per_second: 1e6
`

// BenchmarkCheckTracing is the CPU of a check through limiterd's gRPC API
// with tracing off, on at the default 1% and on at 100%, on the embedded
// store and on a Redis Cluster of one primary. One caller sends checks of
// one key in turn over loopback; the spans go to an OTLP receiver in the
// same process. cpu-µs/check is this process's CPU per check, user and
// system: the server's, the client's and the receiver's, not Redis's.
//
//	go test -run '^$' -bench CheckTracing -benchtime 20000x ./internal/limiterd
func BenchmarkCheckTracing(b *testing.B) {
	rulesFile := filepath.Join(b.TempDir(), "rules.yml")
	if err := os.WriteFile(rulesFile, []byte(traceCostRules), 0o644); err != nil {
		b.Fatal(err)
	}
	_, endpoint := otlptest.Start(b)
	var redisAddrs []string
	for _, store := range []string{"memory", "redis"} {
		if store == "redis" {
			redisAddrs = redistest.NewCluster(b, 1, 0).Addrs()
		}
		for _, tr := range []struct {
			name  string
			ratio float64
		}{{"off", 0}, {"1pct", 0.01}, {"all", 1}} {
			b.Run(store+"/"+tr.name, func(b *testing.B) {
				var addrs []string
				if store == "redis" {
					addrs = redisAddrs
				}
				d := startDaemon(b, addrs, func(o *Options) {
					o.Rules.File = rulesFile
					if tr.ratio > 0 {
						o.Tracing = tracing.Options{Endpoint: endpoint, Insecure: true, SampleRatio: tr.ratio}
					}
				})
				if store == "redis" {
					deadline := time.Now().Add(10 * time.Second)
					for !d.redis.Connected() {
						if time.Now().After(deadline) {
							b.Fatal("the store did not connect within 10 s")
						}
						time.Sleep(10 * time.Millisecond)
					}
				}
				client := limiterv1.NewLimiterClient(dial(b, d.GRPCAddr()))
				ctx := context.Background()
				req := &limiterv1.CheckRequest{RuleId: "bench", Key: "k"}
				for range 100 { // connections, scripts, pools
					if _, err := client.Check(ctx, req); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportAllocs()
				cpu0 := processCPU()
				for b.Loop() {
					resp, err := client.Check(ctx, req)
					if err != nil || !resp.GetAllowed() {
						b.Fatalf("check: %v, %v", resp, err)
					}
				}
				b.ReportMetric(float64((processCPU()-cpu0).Microseconds())/float64(b.N), "cpu-µs/check")
			})
		}
	}
}

// processCPU is the CPU time this process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
