package reconciler

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/reconciler/apply"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// TestPartitionsApplyInParallel: two reconcilers of eu-west apply the
// partitions of us-east's spends side by side, and every spend is applied
// exactly once (each key's count is the sum sent), although one of them
// dies mid-run between applying messages and acknowledging them, and a
// partition message is replayed (the same flush part published again as a
// new stream message).
func TestPartitionsApplyInParallel(t *testing.T) {
	s := newStack(t, quotaRules, 200*time.Millisecond, 0)
	s.startReconciler("us-east")
	// in[i] counts the messages reconciler i holds between applying and
	// acknowledging; overlap records that both held one at once.
	var in [2]atomic.Int64
	var overlap atomic.Bool
	var acked atomic.Int64
	var dying atomic.Bool
	died := make(chan struct{})
	hook := func(i int) func(*Reconciler) {
		return func(r *Reconciler) {
			r.beforeAck = func(string, uint64) bool {
				if i == 1 && dying.Load() {
					return false // dead: applied, never acknowledged
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
	var first []byte
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
		if f == 0 {
			first = data[0]
		}
		time.Sleep(20 * time.Millisecond)
	}
	select {
	case <-died:
	case <-ctx.Done():
		t.Fatal("the second reconciler acknowledged fewer than 15 messages")
	}
	if err := b.Stop(); err != nil {
		t.Logf("stop: %v", err)
	}
	// A replay: partition 0's message of the first flush, published again
	// with another message id (past the stream's duplicate window).
	_, parts, err := gossip.SplitPartitions(first, DefaultPartitions, gossip.DefaultMaxMessageBytes)
	if err != nil {
		t.Fatal(err)
	}
	p := 0
	for parts[p] == nil {
		p++
	}
	if _, err := relay.Publish(ctx, gossip.PartitionSubject("us-east", p), parts[p], jetstream.WithMsgID("replayed")); err != nil {
		t.Fatal(err)
	}
	replayed, err := gossip.Decode(parts[p], gossip.DefaultMaxMessageBytes)
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
	// Past several ack waits: the dead reconciler's messages were
	// delivered again, and nothing more was applied.
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
		t.Errorf("duplicates %v: the dead reconciler's unacknowledged messages were not seen applied", dups)
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
		r.beforeAck = func(src string, _ uint64) bool {
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
