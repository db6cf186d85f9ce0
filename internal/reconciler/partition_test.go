package reconciler

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/reconciler/apply"
	"github.com/limiterd/limiterd/internal/reconciler/lease"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// TestPartitionsApplyInParallel: two reconcilers of eu-west apply the
// partitions of us-east's spends side by side, and every spend is applied
// exactly once (each key's count is the sum sent), although one of them
// dies mid-run between applying messages and storing their position, and a
// partition message is replayed (the same flush part published again as a
// new stream message).
func TestPartitionsApplyInParallel(t *testing.T) {
	s := newStack(t, quotaRules, 200*time.Millisecond, 0)
	s.startReconciler("us-east")
	// in[i] counts the messages reconciler i holds between applying and
	// finishing; overlap records that both held one at once.
	var in [2]atomic.Int64
	var overlap atomic.Bool
	var acked atomic.Int64
	var dying atomic.Bool
	died := make(chan struct{})
	hook := func(i int) func(*Reconciler) {
		return func(r *Reconciler) {
			r.beforeDone = func(string, uint64) bool {
				if i == 1 && dying.Load() {
					return false // dead: applied, its position never stored
				}
				in[i].Add(1)
				defer in[i].Add(-1)
				if in[0].Load() > 0 && in[1].Load() > 0 {
					overlap.Store(true)
				}
				time.Sleep(5 * time.Millisecond)
				if i == 1 && acked.Add(1) == 15 {
					dying.Store(true)
					close(died)
					return false
				}
				return true
			}
		}
	}
	a := s.startReconciler("eu-west", hook(0))
	b := s.startReconciler("eu-west", hook(1))
	s.waitReady()

	nc := s.connectAs("limiterd-us-east")
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	relay, err := jetstream.New(s.connectAs("reconciler-us-east"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	const flushes, perFlush, keys = 60, 300, 1000
	want := map[string]float64{}
	rng := rand.New(rand.NewPCG(1, 2))
	for f := range flushes {
		spends := make([]gossip.Spend, perFlush)
		for i := range spends {
			spends[i] = gossip.Spend{Rule: "quota", Key: fmt.Sprintf("p-%d", rng.IntN(keys)), Cost: float64(1 + rng.IntN(5))}
			want[spends[i].Key] += spends[i].Cost
		}
		now := time.Now().UnixMicro()
		data, err := gossip.Split(gossip.Header{Region: "us-east", Instance: "load", Sequence: uint64(f + 1), FirstAdmitted: now, Flushed: now},
			spends, gossip.DefaultMaxMessageBytes)
		if err != nil || len(data) != 1 {
			t.Fatalf("split: %d parts, %v", len(data), err)
		}
		if _, err := js.Publish(ctx, gossip.LocalSubject("us-east"), data[0], jetstream.WithMsgID(fmt.Sprintf("load-%d", f))); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	select {
	case <-died:
	case <-ctx.Done():
		t.Fatal("the second reconciler finished fewer than 15 messages")
	}
	if err := b.Stop(); err != nil {
		t.Logf("stop: %v", err)
	}
	// A replay: the first message the relay published, published again
	// with another message id (past the stream's duplicate window).
	spends, err := relay.Stream(ctx, gossip.RegionStream("us-east"))
	if err != nil {
		t.Fatal(err)
	}
	firstMsg, err := spends.GetMsg(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := relay.Publish(ctx, firstMsg.Subject, firstMsg.Data, jetstream.WithMsgID("replayed")); err != nil {
		t.Fatal(err)
	}
	replayed, err := gossip.Decode(firstMsg.Data, gossip.DefaultMaxMessageBytes)
	if err != nil {
		t.Fatal(err)
	}
	replayedKeys := map[string]bool{}
	for _, sp := range replayed.GetSpends() {
		replayedKeys[sp.GetKey()] = true
	}

	deadline := time.Now().Add(45 * time.Second)
	for key, sum := range want {
		for {
			got := s.count("eu-west", key)
			if got > sum {
				t.Fatalf("eu-west counts %v for %s, more than the %v sent: a spend applied twice", got, key, sum)
			}
			if got == sum {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("eu-west counts %v for %s, want %v", got, key, sum)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// Past several lease lives: the dead reconciler's messages were read
	// again, and nothing more was applied.
	time.Sleep(3 * time.Second)
	for key, sum := range want {
		if got := s.count("eu-west", key); got != sum {
			t.Fatalf("eu-west counts %v for %s, want %v", got, key, sum)
		}
	}
	if !overlap.Load() {
		t.Error("the two reconcilers never applied at the same time")
	}
	for i, r := range []*Reconciler{a, b} {
		if n := testutil.ToFloat64(r.m.apply.Applied.WithLabelValues("us-east")); n == 0 {
			t.Errorf("reconciler %d applied nothing", i)
		}
	}
	replays := testutil.ToFloat64(a.m.apply.Replays.WithLabelValues("us-east"))
	dups := testutil.ToFloat64(a.m.apply.Duplicates.WithLabelValues("us-east"))
	t.Logf("replays %v, duplicate clients %v (the dead reconciler's messages, delivered again)", replays, dups)
	if replays < 1 {
		t.Errorf("replays counted %v, want at least the one published", replays)
	}
	if dups <= float64(len(replayedKeys)) {
		t.Errorf("duplicates %v: the dead reconciler's messages were not seen applied when read again", dups)
	}
}

// TestPartitionsFlag: --apply.partitions out of 1 to gossip.MaxPartitions
// is refused with an error naming the flag.
func TestPartitionsFlag(t *testing.T) {
	for _, tt := range []struct {
		name  string
		n     int
		valid bool
	}{{"default", DefaultPartitions, true}, {"one", 1, true}, {"most", gossip.MaxPartitions, true}, {"zero", 0, false}, {"negative", -1, false}, {"too many", gossip.MaxPartitions + 1, false}} {
		t.Run(tt.name, func(t *testing.T) {
			o := DefaultOptions()
			o.Partitions = tt.n
			err := o.validate()
			if got := err != nil && strings.Contains(err.Error(), "--apply.partitions: "); got == tt.valid {
				t.Errorf("partitions %d: %v", tt.n, err)
			}
		})
	}
}

// TestRemovedWhilePartitionsBusy: a source region removed at a topology
// switch while its partition loops hold messages has none of them applied
// once the switch is in force. The switch stops every loop of the removed
// region and waits for each; a message fetched and not begun is left to
// be delivered again, not applied.
func TestRemovedWhilePartitionsBusy(t *testing.T) {
	t.Parallel()
	s := buildStackTopo(t, stackRegions, map[string][]string{"us-east": stackRegions}, quotaRules, 200*time.Millisecond, 0,
		func(s *stack, opts ...natstest.Option) { s.nats = natstest.NewServer(t, opts...) })
	// held counts the messages of eu-west the apply loops hold before
	// applying them; late those whose debits were applied with the
	// generation without eu-west in force.
	var armed atomic.Bool
	var held, late atomic.Int64
	s.startReconciler("us-east", func(r *Reconciler) {
		r.beforeApply = func(ctx context.Context, src apply.Source) {
			if src.Name != "eu-west" || !armed.Load() {
				return
			}
			held.Add(1)
			// Until the switch is in force, or the loop is stopped.
			for r.topo.Active().Generation() < 2 && ctx.Err() == nil {
				time.Sleep(time.Millisecond)
			}
		}
		r.beforeDone = func(src string, _ uint64) bool {
			if src == "eu-west" && r.topo.Active().Generation() >= 2 {
				late.Add(1)
			}
			return true
		}
	})
	s.startReconciler("eu-west")
	s.waitReady()
	s.send("eu-west", "warm", 1)
	waitCount(t, s, "us-east", "warm", 1)

	armed.Store(true)
	for i := range 16 {
		s.send("eu-west", fmt.Sprintf("busy-%d", i), 1)
	}
	deadline := time.Now().Add(20 * time.Second)
	for held.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("%d of eu-west's partition messages held in us-east after 20s, want 2", held.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	s.replaceTopology("us-east", s.topology(2, time.Time{}, "us-east"))
	s.waitGeneration("us-east", 2)
	if n := late.Load(); n != 0 {
		t.Errorf("us-east applied %d of eu-west's messages after the switch that removed eu-west was in force, want 0", n)
	}
}

// partitionsBehind lists src's partitions whose position stored in dst's
// Redis is behind their last message in dst's inbound stream, each with
// both.
func (s *stack) partitionsBehind(ctx context.Context, js jetstream.JetStream, dst, src string) ([]string, error) {
	st, err := js.Stream(ctx, gossip.InStream(dst))
	if err != nil {
		return nil, err
	}
	epoch := max(st.CachedInfo().Created.UnixMicro(), 1)
	var left []string
	for p := range DefaultPartitions {
		last, err := st.GetLastMsgForSubject(ctx, gossip.PartitionSubject(src, p))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		pos, err := lease.ReadPosition(ctx, s.regions[dst].redis, dst, lease.Item{Source: src, Partition: p}, epoch)
		if err != nil {
			return nil, err
		}
		if pos < last.Sequence {
			left = append(left, fmt.Sprintf("%s p%d: applied up to %d of %d", src, p, pos, last.Sequence))
		}
	}
	return left, nil
}

// crash stops r as a process killed would: its leases and its heartbeat
// are left to expire, not released.
func crash(r *Reconciler) {
	r.leases.Abandon()
	r.Stop()
}

// held is how many of src's partitions r holds the lease of.
func held(r *Reconciler, src string) int {
	return int(testutil.ToFloat64(r.m.leases.Held.WithLabelValues(src)))
}

// waitHeld waits until recs, reconcilers of eu-west, hold every one of
// us-east's partitions between them and eu-west's relay lease once, their
// leases spread within one of each other, and returns how long that took.
func waitHeld(t *testing.T, recs []*Reconciler) time.Duration {
	t.Helper()
	began := time.Now()
	deadline := began.Add(20 * time.Second)
	for {
		var parts, relays []int
		lo, hi, sum, relay := 1<<30, 0, 0, 0
		for _, r := range recs {
			p, rl := held(r, "us-east"), held(r, "eu-west")
			parts, relays = append(parts, p), append(relays, rl)
			lo, hi, sum, relay = min(lo, p+rl), max(hi, p+rl), sum+p, relay+rl
		}
		if sum == DefaultPartitions && relay == 1 && hi-lo <= 1 {
			return time.Since(began)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the reconcilers hold %v of us-east's partitions and %v relay leases after 20s, want all %d and one, within one of each other",
				parts, relays, DefaultPartitions)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// scripts counts the script calls (EVALSHA and EVAL) region's primaries
// have run.
func (s *stack) scripts(region string) int {
	s.t.Helper()
	var n atomic.Int64 // the primaries are asked side by side
	err := s.regions[region].redis.ForEachMaster(context.Background(), func(ctx context.Context, c *redis.Client) error {
		info, err := c.Info(ctx, "commandstats").Result()
		if err != nil {
			return err
		}
		for line := range strings.Lines(info) {
			for _, cmd := range []string{"cmdstat_evalsha:calls=", "cmdstat_eval:calls="} {
				if rest, ok := strings.CutPrefix(line, cmd); ok {
					v, _, _ := strings.Cut(rest, ",")
					c, err := strconv.Atoi(v)
					if err != nil {
						return err
					}
					n.Add(int64(c))
				}
			}
		}
		return nil
	})
	if err != nil {
		s.t.Fatal(err)
	}
	return int(n.Load())
}

// TestPartitionsApplyBatched: messages waiting in a partition are applied
// several at a time, in one round trip per Redis node: 200 messages of 5
// clients each, held back until all are in the inbound stream, take a
// few batches and far fewer script calls than messages (one at a time,
// each took a record call and a debit call at least), and every client is
// debited once.
func TestPartitionsApplyBatched(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 0)
	s.startReconciler("us-east")
	var hold atomic.Bool
	hold.Store(true)
	holding := make(chan struct{}, 1)
	eu := s.startReconciler("eu-west", func(r *Reconciler) {
		r.beforeApply = func(ctx context.Context, src apply.Source) {
			for hold.Load() && ctx.Err() == nil {
				select {
				case holding <- struct{}{}:
				default:
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
	})
	s.waitReady()
	const messages, clients = 200, 5
	subject := gossip.PartitionSubject("us-east", 0)
	js, err := jetstream.New(s.connectAs("reconciler-us-east"))
	if err != nil {
		t.Fatal(err)
	}
	send := func(m int) {
		spends := make([]gossip.Spend, clients)
		for k := range spends {
			spends[k] = gossip.Spend{Rule: "quota", Key: fmt.Sprintf("b%d-%d", m, k), Cost: 1}
		}
		if _, err := js.PublishAsync(subject, batchOf(t, "us-east", "batched", uint64(m+1), spends...), jetstream.WithMsgID(fmt.Sprintf("batched-%d", m))); err != nil {
			t.Fatal(err)
		}
	}
	send(0)
	select {
	case <-holding:
	case <-time.After(20 * time.Second):
		t.Fatal("the first message was not read within 20s")
	}
	for m := 1; m < messages; m++ {
		send(m)
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(20 * time.Second):
		t.Fatal("not published within 20s")
	}
	// Every message in eu-west's inbound stream, then let the loop go.
	ops, err := jetstream.New(s.connectAs("ops"))
	if err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "every message in eu-west's inbound stream", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		st, err := ops.Stream(ctx, gossip.InStream("eu-west"))
		return err == nil && st.CachedInfo().State.Msgs >= messages
	})
	scriptsBefore, countBefore := s.scripts("eu-west"), histCount(t, eu)
	hold.Store(false)
	for m := range messages {
		for k := range clients {
			s.waitCount("eu-west", fmt.Sprintf("b%d-%d", m, k), 1)
		}
	}
	batches := histCount(t, eu) - countBefore
	calls := s.scripts("eu-west") - scriptsBefore
	t.Logf("%d messages of %d clients applied in %d batches, %d script calls on eu-west's 3 primaries", messages, clients, batches, calls)
	if batches == 0 || batches > messages/8 {
		t.Errorf("%d batches for %d messages, want at most %d (8 messages a batch)", batches, messages, messages/8)
	}
	if calls >= messages {
		t.Errorf("%d script calls for %d messages, want fewer than one a message", calls, messages)
	}
}

// histCount is how many batches r has applied.
func histCount(t *testing.T, r *Reconciler) uint64 {
	t.Helper()
	count, _ := testenv.Histogram(t, r.registry, "limiter_apply_batch_messages")
	return count
}

// TestPartitionsSplitAndTakeOver: two reconcilers of a region hold half
// of a source's partitions each; when one dies without releasing them,
// the other takes them all once their leases expire, and applies their
// spends.
func TestPartitionsSplitAndTakeOver(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 0)
	s.startReconciler("us-east")
	a, b := s.startReconciler("eu-west"), s.startReconciler("eu-west")
	s.waitReady()
	t.Logf("split in %v", waitHeld(t, []*Reconciler{a, b}).Round(time.Millisecond))
	keys := map[int]string{} // a key of each partition
	for i := 0; len(keys) < DefaultPartitions; i++ {
		k := fmt.Sprintf("s%d", i)
		if _, ok := keys[gossip.PartitionOf(k, DefaultPartitions)]; !ok {
			keys[gossip.PartitionOf(k, DefaultPartitions)] = k
		}
	}
	for _, k := range keys {
		s.send("us-east", k, 1)
	}
	for _, k := range keys {
		s.waitCount("eu-west", k, 1)
	}
	for i, r := range []*Reconciler{a, b} {
		if n := testutil.ToFloat64(r.m.apply.Applied.WithLabelValues("us-east")); n == 0 {
			t.Errorf("reconciler %d applied nothing", i)
		}
	}
	crash(b)
	took := waitHeld(t, []*Reconciler{a})
	t.Logf("the survivor holds every partition %v after the other died (lease TTL %v)", took.Round(time.Millisecond), s.reconcilerOptions("eu-west").LeaseTTL)
	for _, k := range keys {
		s.send("us-east", k, 1)
	}
	for _, k := range keys {
		s.waitCount("eu-west", k, 2)
	}
}

// TestPartitionsFailover: a reconciler of two dies (its leases left to
// expire) in the middle of a batch, between applying its messages and
// storing their position, while a source's spends flow; the other takes
// its partitions, reads the batch again, and every spend is applied
// exactly once.
func TestPartitionsFailover(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 100*time.Millisecond, 0)
	s.startReconciler("us-east")
	var done atomic.Int64
	var dead atomic.Bool
	died := make(chan struct{})
	a := s.startReconciler("eu-west")
	b := s.startReconciler("eu-west", func(r *Reconciler) {
		r.beforeDone = func(string, uint64) bool {
			if dead.Load() {
				return false
			}
			// The relay merges the flushes of a round: under load, 80
			// flushes made 36 messages for this reconciler's partitions.
			if done.Add(1) == 10 {
				dead.Store(true)
				close(died)
				go crash(r)
				return false // applied, its position not stored
			}
			return true
		}
	})
	s.waitReady()
	waitHeld(t, []*Reconciler{a, b})
	want := s.flood(t, "f", 80, 200, 2000, 10*time.Millisecond)
	select {
	case <-died:
	case <-time.After(30 * time.Second):
		t.Fatalf("the second reconciler finished %d messages, not 10", done.Load())
	}
	s.exact(t, "eu-west", want)
	dups := testutil.ToFloat64(a.m.apply.Duplicates.WithLabelValues("us-east"))
	t.Logf("duplicates skipped by the survivor: %v (the dead one's batch, read again)", dups)
	if dups == 0 {
		t.Error("the survivor read nothing the dead reconciler had applied")
	}
}

// flood publishes flushes flushes of perFlush spends of keys keys named
// prefix-N as us-east's limiterd, one every gap, and returns what each key
// was spent.
func (s *stack) flood(t *testing.T, prefix string, flushes, perFlush, keys int, gap time.Duration) map[string]float64 {
	t.Helper()
	js, err := jetstream.New(s.connectAs("limiterd-us-east"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rng := rand.New(rand.NewPCG(uint64(flushes), uint64(keys)))
	want := map[string]float64{}
	for f := range flushes {
		spends := make([]gossip.Spend, perFlush)
		for i := range spends {
			spends[i] = gossip.Spend{Rule: "quota", Key: fmt.Sprintf("%s-%d", prefix, rng.IntN(keys)), Cost: float64(1 + rng.IntN(5))}
			want[spends[i].Key] += spends[i].Cost
		}
		data := batchOf(t, "us-east", prefix, uint64(f+1), spends...)
		if _, err := js.Publish(ctx, gossip.LocalSubject("us-east"), data, jetstream.WithMsgID(fmt.Sprintf("%s-%d", prefix, f))); err != nil {
			t.Fatal(err)
		}
		time.Sleep(gap)
	}
	return want
}

// exact waits until region counts what want says of each key, then makes
// sure it stays so: nothing lost, nothing applied twice.
func (s *stack) exact(t *testing.T, region string, want map[string]float64) {
	t.Helper()
	deadline := time.Now().Add(45 * time.Second)
	for key, sum := range want {
		for {
			got := s.count(region, key)
			if got > sum {
				t.Fatalf("%s counts %v for %s, more than the %v sent: a spend applied twice", region, got, key, sum)
			}
			if got == sum {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s counts %v for %s, want %v; %s", region, got, key, sum, s.streamReport(region))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	time.Sleep(2 * time.Second)
	for key, sum := range want {
		if got := s.count(region, key); got != sum {
			t.Fatalf("%s counts %v for %s later, want %v", region, got, key, sum)
		}
	}
}
