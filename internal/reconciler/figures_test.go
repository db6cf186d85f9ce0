package reconciler

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// The figures in docs/multi-region.md and docs/performance.md:
//
//	go test -run '^$' -bench . -benchtime 1x ./internal/reconciler

// figureShapes are the shapes of the overshoot table: a slow rule (a big
// burst, a low rate), a fast one (a small burst, a high rate, where one
// interval of remote spending is many bursts) and a seed-like one (100 a
// minute, at the default interval only: the docs' benchmarks run in the
// tests).
var figureShapes = []struct {
	name           string
	capacity, rate float64
	onlyDefault    bool
}{{"slow", 50, 20, false}, {"fast", 10, 100, false}, {"seed", 100, 100.0 / 60, true}}

// BenchmarkOvershoot hammers one key through the three regions of a NATS
// supercluster (one server each, joined by gateways) at 100 checks/s each
// for 10 s, for each shape, and reports the overshoot over capacity +
// refill*T, with and without reconciliation: the regions on loopback
// (wan=0), and as far apart as real ones (wan=ref: wanDelays on the
// gateways and the Peer links). msgs/s/link and bytes/s/link are what one
// region's spends stream carried to each other region during the run.
// bound is the design's goal for the peak: max_overshoot × capacity +
// what the other regions admitted within one network delay (the longest
// one-way delay of the run; 1 ms on loopback), for the region it is
// largest for; within_bound is 1 when the peak is at most that.
func BenchmarkOvershoot(b *testing.B) {
	regions := []string{"us-east", "eu-west", "ap-south"}
	for _, shape := range figureShapes {
		rulesYAML := fmt.Sprintf(`rules:
  - id: global
    capacity: %[1]v
    refill_per_second: %[2]v
  - id: solo
    capacity: %[1]v
    refill_per_second: %[2]v
    reconcile: false
`, shape.capacity, shape.rate)
		for _, interval := range []time.Duration{time.Second, 250 * time.Millisecond, 100 * time.Millisecond} {
			if shape.onlyDefault && interval != gossip.DefaultInterval {
				continue
			}
			for _, wan := range []string{"0", "ref"} {
				b.Run(fmt.Sprintf("shape=%s/interval=%v/wan=%s", shape.name, interval, wan), func(b *testing.B) {
					for b.Loop() {
						var s *stack
						if wan == "0" {
							s = newSuperStack(b, regions, 1, rulesYAML, interval)
						} else {
							s = newWANStack(b, regions, wanDelays, rulesYAML, interval)
						}
						b.Logf("spends flowing between every pair of regions %v after the streams were made", s.waitSpendsFlow("global").Round(time.Millisecond))
						before := s.spendMessages(b)
						h := s.hammer(10*time.Second, 10*time.Millisecond, "global", "solo")
						msgs, bytes := s.spendMessages(b).since(before)
						b.ReportMetric(msgs/h.elapsed, "msgs/s/link")
						b.ReportMetric(bytes/h.elapsed, "bytes/s/link")
						base := shape.capacity + shape.rate*h.elapsed
						over := float64(h.total("global")) - base
						remote := h.remoteWindow("global", interval)
						b.ReportMetric(over, "overshoot")
						b.ReportMetric(over/float64(remote), "x_remote_interval")
						b.ReportMetric(float64(remote), "remote_interval_admits")
						peak, at := h.peak("global", shape.capacity, shape.rate)
						b.Logf("peak at t=%v", at.Round(time.Millisecond))
						b.ReportMetric(peak, "peak")
						b.ReportMetric(peak/float64(remote), "peak_x_remote_interval")
						delay := time.Millisecond
						if wan != "0" {
							delay = slices.Max(slices.Collect(maps.Values(wanDelays)))
						}
						inDelay := h.remoteWindow("global", delay)
						bound := rules.DefaultMaxOvershoot*shape.capacity + float64(inDelay)
						b.ReportMetric(bound, "bound")
						within := 0.0
						if peak <= bound {
							within = 1
						}
						b.ReportMetric(within, "within_bound")
						b.Logf("peak excess %+.1f; bound %.1f = %v x %v + %d admitted remotely within %v", peak, bound, rules.DefaultMaxOvershoot, shape.capacity, inDelay, delay)
						b.ReportMetric(float64(h.total("solo"))-base, "overshoot_unreconciled")
					}
				})
			}
		}
	}
}

// spendCounts are the messages and bytes each region's spends stream has
// held: what every other region's inbound stream reads of it.
type spendCounts map[string][2]uint64

func (s *stack) spendMessages(t testing.TB) spendCounts {
	t.Helper()
	out := spendCounts{}
	for _, r := range s.names {
		st, err := s.opsJetStream(t, r).Stream(context.Background(), gossip.RegionStream(r))
		if err != nil {
			t.Fatal(err)
		}
		out[r] = [2]uint64{st.CachedInfo().State.LastSeq, st.CachedInfo().State.Bytes}
	}
	return out
}

// since is the messages and bytes per region published since before, on
// average over the regions.
func (c spendCounts) since(before spendCounts) (msgs, bytes float64) {
	for r, n := range c {
		msgs += float64(n[0] - before[r][0])
		bytes += float64(n[1] - before[r][1])
	}
	return msgs / float64(len(c)), bytes / float64(len(c))
}

// BenchmarkReconcileLag measures, 60 times, from a check admitted in
// us-east to its debit visible in eu-west's Redis.
func BenchmarkReconcileLag(b *testing.B) {
	for _, interval := range []time.Duration{time.Second, 100 * time.Millisecond} {
		b.Run("interval="+interval.String(), func(b *testing.B) {
			for b.Loop() {
				s := newStack(b, quotaRules, interval, 1)
				var lags []time.Duration
				for i := range 60 {
					// Spread the samples over the flush cycle.
					time.Sleep(time.Duration(rand.Int64N(int64(interval))))
					key := fmt.Sprint("lag-", i)
					start := time.Now()
					s.send("us-east", key, 1)
					for s.count("eu-west", key) != 1 {
						if time.Since(start) > 30*time.Second {
							b.Fatalf("spend of %s not applied after 30s", key)
						}
						time.Sleep(2 * time.Millisecond)
					}
					lags = append(lags, time.Since(start))
				}
				slices.Sort(lags)
				b.ReportMetric(float64(lags[len(lags)/2].Milliseconds()), "p50_ms")
				b.ReportMetric(float64(lags[len(lags)*99/100].Milliseconds()), "p99_ms")
			}
		})
	}
}

// BenchmarkApplyThroughput publishes 40 flushes of 5,000 distinct keys as
// us-east's spends, split into partitions as us-east's relay splits them,
// and reports how fast eu-west's reconcilers apply them: one partition and
// one reconciler (the serial path of earlier releases), then
// DefaultPartitions partitions and 1, 2 and 4 reconcilers of eu-west (in
// this process: each its own connections, loops and Redis pipelines).
// The small/ cases publish 1,000 flushes of 40 keys instead: messages of
// about 5 clients each, as the design's long tail makes them, where a
// message's fixed cost weighs most. keys/s/core divides by the machine's
// cores (GOMAXPROCS), which the reconcilers share with NATS and Redis.
func BenchmarkApplyThroughput(b *testing.B) {
	type shape struct{ flushes, keys int }
	large, small := shape{40, 5000}, shape{1000, 40}
	for _, c := range []struct {
		name                    string
		shape                   shape
		partitions, reconcilers int
	}{
		{"", large, 1, 1}, {"", large, DefaultPartitions, 1}, {"", large, DefaultPartitions, 2}, {"", large, DefaultPartitions, 4},
		{"small/", small, DefaultPartitions, 1}, {"small/", small, DefaultPartitions, 2}, {"small/", small, DefaultPartitions, 4},
	} {
		b.Run(fmt.Sprintf("%spartitions=%d/reconcilers=%d", c.name, c.partitions, c.reconcilers), func(b *testing.B) {
			for b.Loop() {
				applyThroughput(b, c.partitions, c.reconcilers, c.shape.flushes, c.shape.keys)
			}
		})
	}
}

func applyThroughput(b *testing.B, partitions, reconcilers, messages, keys int) {
	s := newStack(b, quotaRules, 100*time.Millisecond, 0)
	s.recOpts = func(o *Options) { o.Partitions = partitions }
	s.startReconciler("us-east")
	for range reconcilers {
		s.startReconciler("eu-west")
	}
	s.waitReady()
	// The partitions spread over eu-west's reconcilers first.
	recs := s.regions["eu-west"].recs
	share := make([]int, len(recs))
	for i := range share {
		share[i] = partitions / len(recs)
		if i < partitions%len(recs) {
			share[i]++
		}
	}
	spread := func() bool {
		var got []int
		for _, r := range recs {
			got = append(got, held(r, "us-east"))
		}
		slices.Sort(got)
		slices.Reverse(got)
		return slices.Equal(got, share)
	}
	for deadline := time.Now().Add(30 * time.Second); !spread(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			b.Fatal("the partitions not spread over eu-west's reconcilers after 30s")
		}
	}
	// As us-east's reconciler, the one identity allowed to publish the
	// region's relayed spends on a locked NATS.
	nc := s.connectAs("reconciler-us-east")
	js, err := jetstream.New(nc)
	if err != nil {
		b.Fatal(err)
	}
	var payloads []benchMsg
	for m := range messages {
		spends := make([]gossip.Spend, keys)
		for k := range spends {
			spends[k] = gossip.Spend{Rule: "quota", Key: fmt.Sprintf("t%d-%d", m, k), Cost: 1}
		}
		now := time.Now().UnixMicro()
		parts, err := gossip.Split(gossip.Header{Region: "us-east", Instance: "bench", Sequence: uint64(m + 1),
			FirstAdmitted: now, Flushed: now}, spends, gossip.DefaultMaxMessageBytes)
		if err != nil || len(parts) != 1 {
			b.Fatalf("split: %d parts, %v", len(parts), err)
		}
		_, split, err := gossip.SplitPartitions(parts[0], partitions, gossip.DefaultMaxMessageBytes)
		if err != nil {
			b.Fatal(err)
		}
		for p, data := range split {
			if data != nil {
				payloads = append(payloads, benchMsg{gossip.PartitionSubject("us-east", p), fmt.Sprintf("bench-%d-%d", m, p), data})
			}
		}
	}
	applied := func() float64 {
		var n float64
		for _, rec := range s.regions["eu-west"].recs {
			// Debited at once, or from the retry stream (a batch's
			// debits cut short by its lease's deadline on a busy machine).
			n += testutil.ToFloat64(rec.m.apply.Applied.WithLabelValues("us-east")) + testutil.ToFloat64(rec.m.apply.Retried.WithLabelValues("us-east"))
		}
		return n
	}
	duplicates := func() float64 {
		var n float64
		for _, rec := range s.regions["eu-west"].recs {
			n += testutil.ToFloat64(rec.m.apply.Duplicates.WithLabelValues("us-east"))
		}
		return n
	}
	start, cpu0 := time.Now(), processCPU()
	publish(b, js, payloads)
	// Done when the counters say every client was applied, or, when
	// they count some as duplicates (a batch applied whose reply came
	// after its lease's deadline, then replayed by the next holder), when
	// Redis holds every client's debit.
	for applied() < float64(messages*keys) {
		if dup := duplicates(); dup > 0 && applied()+dup >= float64(messages*keys) && s.appliedOnce(b, "eu-west", messages, keys) {
			break
		}
		if time.Since(start) > 2*time.Minute {
			// Where the clients went, to tell a stalled partition from a
			// slow machine.
			for i, rec := range recs {
				v := func(c *prometheus.CounterVec) float64 { return testutil.ToFloat64(c.WithLabelValues("us-east")) }
				b.Logf("reconciler %d: holds %d partitions; applied %v, deferred %v, retried %v, duplicates %v, refilled %v",
					i, held(rec, "us-east"), v(rec.m.apply.Applied), v(rec.m.apply.Deferred), v(rec.m.apply.Retried), v(rec.m.apply.Duplicates), v(rec.m.apply.Refilled))
			}
			s.appliedOnce(b, "eu-west", messages, keys)
			b.Fatalf("not applied after 2 minutes: %v of %d clients", applied(), messages*keys)
		}
		time.Sleep(10 * time.Millisecond)
	}
	rate := float64(messages*keys) / time.Since(start).Seconds()
	b.ReportMetric(rate, "keys/s")
	b.ReportMetric(rate/float64(runtime.GOMAXPROCS(0)), "keys/s/core")
	// This process's CPU is the reconcilers' (limiterd is idle, NATS and
	// Redis run in processes of their own), publishing included.
	b.ReportMetric(float64(messages*keys)/(processCPU()-cpu0).Seconds(), "keys/reconciler-cpu-s")
	nc.Close()
}

// benchMsg is a message to publish: its subject, its id (Nats-Msg-Id)
// and its bytes.
type benchMsg struct {
	subject, id string
	data        []byte
}

// publish publishes every payload asynchronously, each with its message
// id, and publishes again, one at a time, those whose acknowledgement
// failed (on a busy machine, a publish may time out): the stream's
// duplicate window drops a copy stored already. It fails b when one is
// not stored within a minute.
func publish(b *testing.B, js jetstream.JetStream, payloads []benchMsg) {
	b.Helper()
	futures := make([]jetstream.PubAckFuture, len(payloads))
	for i, p := range payloads {
		f, err := js.PublishAsync(p.subject, p.data, jetstream.WithMsgID(p.id))
		if err != nil {
			b.Fatal(err)
		}
		futures[i] = f
	}
	deadline := time.Now().Add(time.Minute)
	for i, f := range futures {
		var err error
		select {
		case <-f.Ok():
			continue
		case err = <-f.Err():
		case <-time.After(time.Until(deadline)):
			b.Fatal("not published after a minute")
		}
		for err != nil {
			if time.Now().After(deadline) {
				b.Fatalf("%s not published after a minute: %v", payloads[i].id, err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, err = js.Publish(ctx, payloads[i].subject, payloads[i].data, jetstream.WithMsgID(payloads[i].id))
			cancel()
		}
	}
}

// appliedOnce reads, in region's Redis, the quota's count of each key
// that applyThroughput published (messages × keys, each spent once) and
// says whether every key holds exactly 1. It logs how many hold 0 and
// fails b when one holds more: a spend applied twice.
func (s *stack) appliedOnce(b *testing.B, region string, messages, keys int) bool {
	b.Helper()
	ctx := context.Background()
	var missing, twice int
	for m := range messages {
		cmds := make([]*redis.StringCmd, keys)
		_, err := s.regions[region].redis.Pipelined(ctx, func(p redis.Pipeliner) error {
			for k := range keys {
				cmds[k] = p.Get(ctx, redisstore.Key("quota", fmt.Sprintf("t%d-%d", m, k)))
			}
			return nil
		})
		if err != nil && !errors.Is(err, redis.Nil) {
			b.Logf("read the counts: %v", err)
			return false
		}
		for k, c := range cmds {
			v, err := c.Result()
			if err != nil {
				missing++
				continue
			}
			switch f := strings.Fields(v); {
			case len(f) != 2:
				b.Fatalf("t%d-%d: quota state %q", m, k, v)
			case f[1] == "0":
				missing++
			case f[1] != "1":
				twice++
			}
		}
	}
	if twice > 0 {
		b.Fatalf("%d of %d clients debited more than once", twice, messages*keys)
	}
	if missing > 0 {
		b.Logf("%s's Redis: %d of %d clients not debited yet", region, missing, messages*keys)
	}
	return missing == 0
}

// processCPU is the CPU time this process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
