package reconciler

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/proto"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/gossip"
	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// applyStream is the stream region's apply consumers read.
func applyStream(region string) string { return gossip.InStream(region) }

// TestOversizedSpendSkipped: one spend above gossip.MaxCost, between two
// good ones in the same message, is skipped and counted; the good ones are
// applied.
func TestOversizedSpendSkipped(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)
	now := time.Now().UnixMicro()
	data, err := proto.Marshal(&gossipv1.SpendBatch{Region: "us-east", Instance: "big", Sequence: 1, Parts: 1,
		FirstAdmittedUnixMicros: now, FlushedUnixMicros: now, Spends: []*gossipv1.Spend{
			{RuleId: "quota", Key: "good-1", Cost: 3},
			{RuleId: "quota", Key: "huge", Cost: 2 * gossip.MaxCost},
			{RuleId: "quota", Key: "good-2", Cost: 4},
		}})
	if err != nil {
		t.Fatal(err)
	}
	subject := gossip.PartitionSubject("us-east", 0)
	s.publish("reconciler-us-east", subject, data, "big-1-0")
	// A later message of the same partition, applied after it (in order).
	s.publish("reconciler-us-east", subject, batch(t, "us-east", "big", 2, "after", 1), "big-2-0")
	s.waitCount("eu-west", "after", 1)
	// A client whose Redis call failed on a loaded machine is debited
	// from the retry stream, after the later message's: wait for each.
	s.waitCount("eu-west", "good-1", 3)
	s.waitCount("eu-west", "good-2", 4)
	if got := s.count("eu-west", "huge"); got != 0 {
		t.Errorf("eu-west counts %v for huge, want 0", got)
	}
	rec := s.regions["eu-west"].recs[0]
	if got := testutil.ToFloat64(rec.m.apply.Invalid.WithLabelValues("us-east")); got != 1 {
		t.Errorf("invalid spends counted: %v, want 1", got)
	}
	if got := testutil.ToFloat64(rec.m.apply.Rejected); got != 0 {
		t.Errorf("messages rejected: %v, want 0", got)
	}
}

// TestRedeliveredAfterOldMarkerTTL: a message applied and not done (its
// position not stored) for longer than the markers used to live (10 s, the
// shortest the old --gossip.marker-ttl allowed with a 1 s ack wait) is read
// again many times and applied once.
func TestRedeliveredAfterOldMarkerTTL(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 0)
	const hold = 12 * time.Second
	// The first delivery's time, read by the test while the hook runs in
	// the reconciler's goroutines.
	var first atomic.Pointer[time.Time]
	var deliveries atomic.Int64
	hold12s := func(r *Reconciler) {
		r.beforeDone = func(src string, seq uint64) bool {
			deliveries.Add(1)
			now := time.Now()
			first.CompareAndSwap(nil, &now)
			return time.Since(*first.Load()) > hold
		}
	}
	s.startReconciler("us-east")
	s.startReconciler("eu-west", hold12s)
	s.waitReady()
	s.send("us-east", "k", 5)
	s.waitCount("eu-west", "k", 5)
	// The count is written before the hook runs: wait for its first call.
	testenv.WaitFor(t, "the first delivery to be applied", func() bool { return first.Load() != nil })
	start := *first.Load()
	// Held not done, read again and again; then done.
	for time.Since(start) <= hold+time.Second {
		time.Sleep(100 * time.Millisecond)
		if got := s.count("eu-west", "k"); got != 5 {
			t.Fatalf("after %v of redeliveries eu-west counts %v, want 5", time.Since(start).Round(time.Second), got)
		}
	}
	s.send("us-east", "k", 1)
	s.converge("k", 6)
	t.Logf("the first message was delivered %d times", deliveries.Load())
	if deliveries.Load() < 5 {
		t.Errorf("delivered %d times, want redeliveries throughout %v", deliveries.Load(), hold)
	}
	marker := redisstore.PartitionMarkerKey("k", "us-east", gossip.PartitionOf("k", DefaultPartitions))
	if ttl := s.regions["eu-west"].redis.PTTL(context.Background(), marker).Val(); ttl < DefaultStreamMaxAge {
		t.Errorf("the marker lives %v, less than the stream keeps a message (%v)", ttl, DefaultStreamMaxAge)
	}
}

// TestRecreatedStream: the stream eu-west applies from is deleted (as an
// operator recovering a deployment might) while eu-west's reconciler is
// down; the new stream's sequences start at 1 again, and its messages are
// applied, not taken for the old stream's.
func TestRecreatedStream(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)
	// Enough messages that the old markers are well ahead of the new
	// stream's first sequences.
	for range 10 {
		s.send("us-east", "k", 1)
		time.Sleep(250 * time.Millisecond)
	}
	s.waitCount("eu-west", "k", 10)
	s.regions["eu-west"].recs[0].Stop()
	js, err := jetstream.New(s.connectAs("ops"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := js.DeleteStream(ctx, applyStream("eu-west")); err != nil {
		t.Fatal(err)
	}
	s.startReconciler("eu-west")
	s.waitReady()
	s.send("us-east", "k", 4)
	s.waitCount("eu-west", "k", 14)
	rec := s.regions["eu-west"].recs[1]
	if got := testutil.ToFloat64(rec.m.apply.Duplicates.WithLabelValues("us-east")); got != 0 {
		t.Errorf("%v debits of the new stream taken for duplicates", got)
	}
}

// keysOnNodes returns, for each primary of region's cluster, a client key
// whose quota bucket lives there, by node address.
func (s *stack) keysOnNodes(region, prefix string) map[string]string {
	s.t.Helper()
	out := map[string]string{}
	ctx := context.Background()
	rc := s.regions[region].redis
	for i := 0; len(out) < 3; i++ {
		key := fmt.Sprint(prefix, i)
		c, err := rc.MasterForKey(ctx, redisstore.Key("quota", key))
		if err != nil {
			s.t.Fatal(err)
		}
		if _, ok := out[c.Options().Addr]; !ok {
			out[c.Options().Addr] = key
		}
		if i > 1000 {
			s.t.Fatal("no key found on every primary")
		}
	}
	return out
}

// TestRedisPrimaryDown: with one of eu-west's primaries stopped (no
// replica, the cluster told to serve the slots it still has), us-east's
// spends for keys on the other primaries are applied while it is down,
// message after message; those of its keys are applied once it is back;
// none twice.
func TestRedisPrimaryDown(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)
	ctx := context.Background()
	eu := s.regions["eu-west"]
	if err := eu.redis.ForEachShard(ctx, func(ctx context.Context, c *redis.Client) error {
		return c.ConfigSet(ctx, "cluster-require-full-coverage", "no").Err()
	}); err != nil {
		t.Fatal(err)
	}
	keys := s.keysOnNodes("eu-west", "n")
	// The node to stop holds a key, and not the first copy of the flushes'
	// records (a node holding it is not covered by a test yet: the second
	// copy, on another primary, should answer for it).
	rec, err := eu.redis.MasterForKey(ctx, redisstore.MessageKey("us-east", "limiterd-us-east", 1, 0))
	if err != nil {
		t.Fatal(err)
	}
	var down *redistest.Node
	for _, n := range eu.cluster.Nodes() {
		if n.Addr() != rec.Options().Addr {
			down = n
			break
		}
	}
	s.send("us-east", "warm", 1)
	s.waitCount("eu-west", "warm", 1)

	down.Stop()
	t.Logf("stopped %s; keys %v", down.Addr(), keys)
	sent := map[string]float64{}
	for range 3 {
		for _, key := range keys {
			s.send("us-east", key, 2)
			sent[key] += 2
		}
		time.Sleep(300 * time.Millisecond)
	}
	began := time.Now()
	for addr, key := range keys {
		if addr != down.Addr() {
			s.waitCount("eu-west", key, sent[key])
		}
	}
	t.Logf("keys on the running primaries debited %v after the last spend", time.Since(began).Round(time.Millisecond))
	// Later messages are not held behind the failed ones.
	for addr, key := range keys {
		if addr != down.Addr() {
			s.send("us-east", key, 1)
			sent[key]++
			s.waitCount("eu-west", key, sent[key])
		}
	}

	down.Start()
	eu.cluster.WaitHealthy(t)
	began = time.Now()
	// The node came back empty: its key holds what arrived while it was down.
	s.waitCount("eu-west", keys[down.Addr()], sent[keys[down.Addr()]])
	t.Logf("the stopped node's key debited %v after it was healthy again", time.Since(began).Round(time.Millisecond))
	s.send("us-east", "sentinel", 1)
	s.waitCount("eu-west", "sentinel", 1)
	time.Sleep(3 * time.Second)
	for _, key := range keys {
		if got := s.count("eu-west", key); got != sent[key] {
			t.Errorf("eu-west counts %v for %s later, want %v", got, key, sent[key])
		}
	}
}

// deletedWhileRunning sends 6 spends of key through us-east and waits for
// them in eu-west, then runs del as an operator (before, when set, runs
// just before it), sends 4 more, and checks eu-west counts exactly 10, and
// still 10 a little later: nothing lost, nothing applied twice. It returns
// the stack and the operator's JetStream, for the caller's own checks.
func deletedWhileRunning(t *testing.T, key string, before func(*stack), del func(context.Context, jetstream.JetStream) error) (*stack, jetstream.JetStream) {
	t.Helper()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)
	for range 6 {
		s.send("us-east", key, 1)
		time.Sleep(250 * time.Millisecond)
	}
	s.waitCount("eu-west", key, 6)
	if before != nil {
		before(s)
	}
	js, err := jetstream.New(s.connectAs("ops"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := del(ctx, js); err != nil {
		t.Fatal(err)
	}
	for range 4 {
		s.send("us-east", key, 1)
		time.Sleep(250 * time.Millisecond)
	}
	s.waitCount("eu-west", key, 10)
	time.Sleep(2 * time.Second)
	if got := s.count("eu-west", key); got != 10 {
		t.Fatalf("eu-west counts %v for %s, want 10", got, key)
	}
	return s, js
}

// TestStreamDeletedWhileRunning: an operator deletes eu-west's inbound
// stream while its reconciler runs. The reconciler sets its streams up
// again by itself, and every spend is applied exactly once: those before
// the deletion are not applied again from the new stream, those after it
// are applied.
func TestStreamDeletedWhileRunning(t *testing.T) {
	t.Parallel()
	deletedWhileRunning(t, "d", nil, func(ctx context.Context, js jetstream.JetStream) error {
		return js.DeleteStream(ctx, applyStream("eu-west"))
	})
}

// TestConsumerDeletedWhileRunning: an operator deletes the reader of one
// partition (the key's; not its stream) while the reconciler runs. The
// reconciler makes another, which reads on from the position stored:
// the counts stay exact.
func TestConsumerDeletedWhileRunning(t *testing.T) {
	t.Parallel()
	p := gossip.PartitionOf("c", DefaultPartitions)
	var deleted []string
	_, js := deletedWhileRunning(t, "c", nil, func(ctx context.Context, js jetstream.JetStream) error {
		st, err := js.Stream(ctx, applyStream("eu-west"))
		if err != nil {
			return err
		}
		l := st.ListConsumers(ctx)
		for ci := range l.Info() {
			if strings.HasPrefix(ci.Name, readerPrefix("eu-west", "us-east", p)) {
				if err := js.DeleteConsumer(ctx, applyStream("eu-west"), ci.Name); err != nil {
					return err
				}
				deleted = append(deleted, ci.Name)
			}
		}
		if len(deleted) == 0 {
			return errors.New("no reader of the key's partition")
		}
		return l.Err()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, applyStream("eu-west"))
	if err != nil {
		t.Fatal(err)
	}
	l := st.ListConsumers(ctx)
	var now []string
	for ci := range l.Info() {
		if strings.HasPrefix(ci.Name, readerPrefix("eu-west", "us-east", p)) && !slices.Contains(deleted, ci.Name) {
			now = append(now, ci.Name)
		}
	}
	if len(now) == 0 {
		t.Fatalf("no reader of partition %d made again (deleted %v)", p, deleted)
	}
	t.Logf("deleted %v; reading now: %v", deleted, now)
}
