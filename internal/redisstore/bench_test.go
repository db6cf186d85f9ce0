package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// BenchmarkStoreTake is the store path alone: concurrent token bucket
// checks over 100,000 keys on a 3-primary cluster, in-process: coalesced
// with the default linger, coalesced without it, and one call per check,
// with the checks per pipeline. Compare with redis-benchmark's EVALSHA
// ceiling (scripts/loadrun.sh prints it):
//
//	go test -run '^$' -bench StoreTake -benchtime 5s ./internal/redisstore
func BenchmarkStoreTake(b *testing.B) {
	c := redistest.NewCluster(b, 3, 0)
	for _, mode := range []struct {
		name     string
		coalesce bool
		linger   time.Duration
	}{{"coalesced-linger", true, pipeline.DefaultLinger}, {"coalesced", true, 0}, {"one-call-per-check", false, 0}} {
		b.Run(mode.name, func(b *testing.B) {
			reg := prometheus.NewRegistry()
			s, err := New(context.Background(), Options{Addrs: c.Addrs(), Timeout: time.Second, NoCoalesce: !mode.coalesce, Linger: mode.linger}, reg)
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
			if p := testenv.SampleCount(b, reg, "limiter_store_pipeline_checks"); p > 0 {
				b.ReportMetric(testenv.SampleSum(b, reg, "limiter_store_pipeline_checks")/float64(p), "checks/pipeline")
			}
		})
	}
}

// BenchmarkScriptCost is each lease script's Redis CPU per call next to
// the token bucket check's (far from the limit; near it, where it reads
// the key's hold, absent; and with a hold of two sources): usec_per_call of EVALSHA in INFO commandstats,
// reset before each phase, on one quiet standalone node. Each phase makes
// 20,000 calls in pipelines of 100 (the server's time per call does not
// depend on it) over 4,000 keys:
//
//	go test -run '^$' -bench ScriptCost -benchtime 1x ./internal/redisstore
func BenchmarkScriptCost(b *testing.B) {
	n := redistest.NewNode(b)
	c := redis.NewClient(&redis.Options{Addr: n.Addr()})
	defer c.Close()
	ctx := context.Background()
	for _, sc := range allScripts() {
		if err := sc.Load(ctx, c).Err(); err != nil {
			b.Fatal(err)
		}
	}
	const calls, keys = 20_000, 4_000
	tb := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 100, RefillPerSecond: 10}
	a := scriptArgs(tb, 1)
	phase := func(name string, call func(p redis.Pipeliner, i int)) {
		if err := c.ConfigResetStat(ctx).Err(); err != nil {
			b.Fatal(err)
		}
		for start := 0; start < calls; start += 100 {
			p := c.Pipeline()
			for i := start; i < start+100; i++ {
				call(p, i)
			}
			if _, err := p.Exec(ctx); err != nil {
				b.Fatalf("%s: %v", name, err)
			}
		}
		info := c.Info(ctx, "commandstats").Val()
		for _, line := range strings.Split(info, "\r\n") {
			if strings.HasPrefix(line, "cmdstat_evalsha:") {
				for _, f := range strings.Split(strings.TrimPrefix(line, "cmdstat_evalsha:"), ",") {
					if v, ok := strings.CutPrefix(f, "usec_per_call="); ok {
						us, _ := strconv.ParseFloat(v, 64)
						b.ReportMetric(us, name+"-usec/call")
						return
					}
				}
			}
		}
		b.Fatalf("%s: no cmdstat_evalsha in %q", name, info)
	}
	key := func(i int) string { return "bench-" + strconv.Itoa(i%keys) }
	member := func(i int) string { return fmt.Sprintf("m%022d", i) } // the length of a lease's member
	lease := func(i int) string { return LeaseKey("bench", "bench-"+strconv.Itoa(i%keys)) }
	// The acquire and release scripts take each set's adaptive limit too.
	leaseKeys := func(i int) []string {
		return []string{lease(i), AdaptiveKey("bench", "bench-"+strconv.Itoa(i%keys))}
	}
	for range b.N {
		phase("token_bucket", func(p redis.Pipeliner, i int) {
			singleScripts[0].EvalSha(ctx, p, []string{Key("bench", key(i))}, a[0], a[1], a[2])
		})
		// Near the limit: a spend of 60 of 100 leaves less than half, so
		// the check reads the key's hold (lua/hold.lua); the bucket refills
		// between calls, so each passes. Without a hold, then with one.
		near := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 100, RefillPerSecond: 1e9}
		an := scriptArgs(near, 60)
		phase("token_bucket_near_limit", func(p redis.Pipeliner, i int) {
			singleScripts[0].EvalSha(ctx, p, []string{Key("near", key(i))}, an[0], an[1], an[2])
		})
		now := time.Now().UnixMicro()
		for i := range keys {
			hold := fmt.Sprintf("10 %d %d 95000 10", now, now-100_000)
			if err := c.HSet(ctx, Key("held", key(i))+"~h", PartitionMarkerKey(key(i), "eu-west", 0), hold,
				PartitionMarkerKey(key(i), "ap-south", 0), hold).Err(); err != nil {
				b.Fatal(err)
			}
		}
		phase("token_bucket_held", func(p redis.Pipeliner, i int) {
			singleScripts[0].EvalSha(ctx, p, []string{Key("held", key(i))}, an[0], an[1], an[2])
		})
		// 5 leases per key, each granted: the sets hold 1 to 5.
		phase("acquire", func(p redis.Pipeliner, i int) {
			leaseScripts[0].EvalSha(ctx, p, leaseKeys(i), member(i), 10, 30_000_000, 0, 0)
		})
		phase("renew", func(p redis.Pipeliner, i int) {
			leaseScripts[2].EvalSha(ctx, p, []string{lease(i)}, member(i), 30_000_000)
		})
		// Limit 5: every key holds 5, so each of these is refused.
		phase("acquire_refused", func(p redis.Pipeliner, i int) {
			leaseScripts[0].EvalSha(ctx, p, leaseKeys(i), member(calls+i), 5, 30_000_000, 0, 0)
		})
		phase("release", func(p redis.Pipeliner, i int) {
			leaseScripts[1].EvalSha(ctx, p, leaseKeys(i), member(i), 5, 0, 0, 0, -1, 0)
		})
		// Paced: 5 reservations per key of a bucket of 1 at 10/s, so the
		// first fits now and the others wait 100 to 400 ms (within 1 s).
		paced := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 1, RefillPerSecond: 10}
		phase("reserve", func(p redis.Pipeliner, i int) {
			keys, args := groupArgs([]bucket.Request{{Rule: "bench", Key: "pace-" + key(i), Limit: paced, Cost: 1, MaxWait: time.Second}})
			args = append([]any{strconv.FormatInt(time.Second.Nanoseconds(), 10)}, args...)
			reserveScript.EvalSha(ctx, p, keys, args...)
		})
	}
}

// BenchmarkDebitCost is the Redis CPU of a debit next to a check's, on a
// 1-primary cluster, as `INFO cpu` (used_cpu_sys + used_cpu_user) counts
// it over each phase, less the server's idle rate (measured for 1 s
// first). check: 20,000 single token bucket checks through the store, 64
// callers over 4,000 keys. debit/clients=N: 20,000 debits through
// ApplyDebits, one message at a time of N distinct clients, one token
// bucket rule each; /refilled: spends of a client absent here that had
// refilled. record: a message's flush record (FirstSeen).
// message/clients=5/batch=B: a whole message of 5 clients, its record and
// its debits, B messages per round trip (FirstSeenMany and ApplyMessages,
// one call each per node): what a reconciler pays per message. d/c is a
// debit's (or a record's, or a message's) cost in checks:
//
//	go test -run '^$' -bench DebitCost -benchtime 1x ./internal/redisstore
//
// -short does a tenth of each phase and skips the idle rate.
func BenchmarkDebitCost(b *testing.B) {
	c := redistest.NewCluster(b, 1, 0)
	ctx := context.Background()
	s, err := New(ctx, Options{Addrs: c.Addrs(), Timeout: 5 * time.Second}, prometheus.NewRegistry())
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	rc := redis.NewClient(&redis.Options{Addr: c.PrimaryAddrs()[0]})
	defer rc.Close()
	cpu := func() float64 {
		info, err := rc.Info(ctx, "cpu").Result()
		if err != nil {
			b.Fatal(err)
		}
		var sum float64
		for line := range strings.Lines(info) {
			k, v, _ := strings.Cut(strings.TrimSpace(line), ":")
			if k == "used_cpu_sys" || k == "used_cpu_user" {
				f, _ := strconv.ParseFloat(v, 64)
				sum += f
			}
		}
		return sum
	}
	ops := 20_000
	idle := 0.0 // CPU s per s
	if testing.Short() {
		ops /= 10
	} else {
		c0, t0 := cpu(), time.Now()
		time.Sleep(time.Second)
		idle = (cpu() - c0) / time.Since(t0).Seconds()
	}
	// phase is the server's CPU (µs) per op of run.
	phase := func(run func()) float64 {
		c0, t0 := cpu(), time.Now()
		run()
		return max(cpu()-c0-idle*time.Since(t0).Seconds(), 0) * 1e6 / float64(ops)
	}
	lim := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 1e6, RefillPerSecond: 1e6}
	var check float64
	b.Run("check", func(b *testing.B) {
		for range b.N {
			var n atomic.Int64
			check = phase(func() {
				var wg sync.WaitGroup
				for range 64 {
					wg.Go(func() {
						for i := n.Add(1); i <= int64(ops); i = n.Add(1) {
							if _, err := s.Take(ctx, bucket.Request{Rule: "bench", Key: "check-" + strconv.FormatInt(i%4000, 10), Limit: lim, Cost: 1}); err != nil {
								b.Error(err)
								return
							}
						}
					})
				}
				wg.Wait()
			})
		}
		b.ReportMetric(check, "redis-µs/check")
	})
	// A message's flush record (FirstSeen): two script calls, one per
	// copy, on the one primary here.
	b.Run("record", func(b *testing.B) {
		var r float64
		for range b.N {
			r = phase(func() {
				for i := range ops {
					pos := Position{Epoch: 1, Seq: uint64(i + 1)}
					if _, err := s.FirstSeen(ctx, "eu.0", "bench-"+strconv.Itoa(b.N), uint64(i), 0, pos, time.Minute); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
		b.ReportMetric(r, "redis-µs/message")
		if check > 0 {
			b.ReportMetric(r/check, "d/c")
		}
	})
	seq := uint64(0)
	// The long tail: one token of a 100-a-minute rule, admitted 30 s
	// before it arrives, for a client this region has not seen.
	tail := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 100, RefillPerSecond: 100.0 / 60}
	for _, tt := range []struct {
		n        int
		refilled bool
	}{{1000, false}, {10, false}, {1000, true}, {10, true}} {
		name := fmt.Sprintf("debit/clients=%d", tt.n)
		if tt.refilled {
			name += "/refilled"
		}
		b.Run(name, func(b *testing.B) {
			var d float64
			for range b.N {
				d = phase(func() {
					for done := 0; done < ops; done += tt.n {
						seq++
						clients := make([]ClientDebits, tt.n)
						for i := range clients {
							clients[i] = ClientDebits{Key: "debit-" + strconv.Itoa(i), Debits: []Debit{{Rule: "bench", Limit: lim, Amount: 1}}}
							if tt.refilled {
								clients[i].Debits[0] = Debit{Rule: "tail", Limit: tail, Amount: 1, At: time.Now().Add(-30 * time.Second).UnixMicro()}
							}
						}
						res, err := s.ApplyDebits(ctx, "eu", Position{Epoch: 1, Seq: seq}, time.Minute, clients)
						if err != nil || res.Applied+res.Refilled != tt.n || tt.refilled != (res.Refilled == tt.n) {
							b.Fatalf("apply: %+v, %v", res, err)
						}
					}
				})
			}
			b.ReportMetric(d, "redis-µs/debit")
			if check > 0 {
				b.ReportMetric(d/check, "d/c")
			}
		})
	}
	// Whole messages of 5 clients: the record and the debits, one message
	// or 8 per round trip, 4,000 messages (20,000 debits).
	for _, per := range []int{1, 8} {
		b.Run(fmt.Sprintf("message/clients=5/batch=%d", per), func(b *testing.B) {
			const clients = 5
			msgs := ops / clients
			var m float64
			for range b.N {
				m = phase(func() {
					for done := 0; done < msgs; done += per {
						recs := make([]Record, per)
						batch := make([]MessageDebits, per)
						for k := range batch {
							seq++
							pos := Position{Epoch: 1, Seq: seq}
							recs[k] = Record{Instance: "bench-m" + strconv.Itoa(per), Seq: seq, Pos: pos}
							batch[k].Pos = pos
							for i := range clients {
								key := "msg-" + strconv.Itoa((done+k)*clients+i)
								batch[k].Clients = append(batch[k].Clients, ClientDebits{Key: key, Debits: []Debit{{Rule: "bench", Limit: lim, Amount: 1}}})
							}
						}
						_, errs := s.FirstSeenMany(ctx, "eu.0", recs, time.Minute)
						if err := errors.Join(errs...); err != nil {
							b.Fatal(err)
						}
						if _, err := s.ApplyMessages(ctx, "eu", time.Minute, batch); err != nil {
							b.Fatal(err)
						}
					}
				}) * float64(ops) / float64(msgs)
			}
			b.ReportMetric(m, "redis-µs/message")
			if check > 0 {
				b.ReportMetric(m/check, "d/c")
			}
		})
	}
}
