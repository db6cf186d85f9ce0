package reconciler

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/pkg/gossip"
)

// TestRelayFailover: three reconcilers of us-east, one relaying at a time,
// merge the flushes of its limiterd into fewer messages than flushes; the
// first relay dies after publishing a round and before acknowledging its
// flushes, the second dies before publishing its first, and eu-west still counts
// every spend exactly once: the next relay reads where each partition
// ends and merges no flush into a partition twice, however the relay
// before grouped it.
func TestRelayFailover(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 100*time.Millisecond, 0)
	s.startReconciler("eu-west")
	var rounds atomic.Int64
	var crashes [2]atomic.Bool // after publishing, before publishing
	var dead [3]atomic.Bool
	var recs [3]*Reconciler
	for i := range recs {
		recs[i] = s.startReconciler("us-east", func(r *Reconciler) {
			r.beforeRelayPublish = func(uint64) bool {
				if dead[i].Load() {
					return false
				}
				rounds.Add(1)
				// The next holder's first round.
				if crashes[0].Load() && !crashes[1].Swap(true) {
					dead[i].Store(true)
					go crash(r)
					return false
				}
				return true
			}
			r.beforeRelayAck = func() bool {
				if dead[i].Load() {
					return false
				}
				if rounds.Load() >= 15 && !crashes[0].Swap(true) {
					dead[i].Store(true)
					go crash(r)
					return false // published, not acknowledged
				}
				return true
			}
		})
	}
	s.waitReady()
	const flushes = 300
	want := s.flood(t, "r", flushes, 40, 2000, 2*time.Millisecond)
	s.exact(t, "eu-west", want)
	if !crashes[0].Load() || !crashes[1].Load() {
		t.Fatalf("crashed after publishing %v, before publishing %v, after %d rounds: want both", crashes[0].Load(), crashes[1].Load(), rounds.Load())
	}
	var msgs float64
	for _, r := range recs {
		msgs += testutil.ToFloat64(r.m.relayMsgs)
	}
	dups := testutil.ToFloat64(s.regions["eu-west"].recs[0].m.apply.Duplicates.WithLabelValues("us-east"))
	t.Logf("%d flushes relayed in %d rounds as %v messages over %d partitions; duplicates at eu-west %v", flushes, rounds.Load(), msgs, DefaultPartitions, dups)
	if msgs >= flushes*DefaultPartitions/2 {
		t.Errorf("%v messages for %d flushes of %d partitions: the relay merged few", msgs, flushes, DefaultPartitions)
	}
}

// TestRelayDropsFlushPublishedAgain: a flush that limiterd publishes again
// under another message id (from its spool, past the local stream's
// duplicate window) is relayed once: the relay's record of it drops the
// second copy.
func TestRelayDropsFlushPublishedAgain(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 100*time.Millisecond, 0)
	us := s.startReconciler("us-east")
	s.startReconciler("eu-west")
	s.waitReady()
	js, err := jetstream.New(s.connectAs("limiterd-us-east"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	data := batchOf(t, "us-east", "spool", 1, gossip.Spend{Rule: "quota", Key: "k", Cost: 3})
	for i := range 2 {
		if _, err := js.Publish(ctx, gossip.LocalSubject("us-east"), data, jetstream.WithMsgID(fmt.Sprintf("spool-%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	// A later flush shows when the copies are behind.
	later := batchOf(t, "us-east", "spool", 2, gossip.Spend{Rule: "quota", Key: "after", Cost: 1})
	if _, err := js.Publish(ctx, gossip.LocalSubject("us-east"), later, jetstream.WithMsgID("spool-later")); err != nil {
		t.Fatal(err)
	}
	s.exact(t, "eu-west", map[string]float64{"k": 3, "after": 1})
	if n := testutil.ToFloat64(us.m.relayReplays); n != 1 {
		t.Errorf("relay replays counted %v, want 1", n)
	}
}
