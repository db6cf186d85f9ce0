package reconciler

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/rulesource"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// refused publishes data on subject as the identity named who and reports
// whether the server refused it: a permissions violation arrives before
// the answer to the flush that follows the publish.
func (s *stack) refused(who, subject string, data []byte) bool {
	s.t.Helper()
	nc := s.connectAs(who)
	if err := nc.Publish(subject, data); err != nil {
		s.t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		s.t.Fatal(err)
	}
	return errors.Is(nc.LastError(), nats.ErrPermissionViolation)
}

// batch is one encoded spend message of region for key.
func batch(t *testing.T, region, instance string, seq uint64, key string, cost float64) []byte {
	t.Helper()
	now := time.Now().UnixMicro()
	parts, err := gossip.Split(gossip.Header{Region: region, Instance: instance, Sequence: seq, FirstAdmitted: now, Flushed: now},
		[]gossip.Spend{{Rule: "quota", Key: key, Cost: cost}}, gossip.DefaultMaxMessageBytes)
	if err != nil || len(parts) != 1 {
		t.Fatalf("split: %d parts, %v", len(parts), err)
	}
	return parts[0]
}

// publish publishes data on subject as who through JetStream, waiting for
// the stream's ack; msgID may be empty.
func (s *stack) publish(who, subject string, data []byte, msgID string) {
	s.t.Helper()
	js, err := jetstream.New(s.connectAs(who))
	if err != nil {
		s.t.Fatal(err)
	}
	var opts []jetstream.PublishOpt
	if msgID != "" {
		opts = append(opts, jetstream.WithMsgID(msgID))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := js.Publish(ctx, subject, data, opts...); err != nil {
		s.t.Fatalf("publish to %s as %s: %v", subject, who, err)
	}
}

// TestRepliesStayPrivate: an identity reads the replies to its own
// requests only; a limiterd's cannot subscribe to the reconciler's inbox
// (the spends it fetches) nor to every inbox.
func TestRepliesStayPrivate(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)
	for _, subject := range []string{"_INBOX.>", natsconn.InboxPrefix("reconciler-us-east") + ".>", natsconn.InboxPrefix("admin") + ".*"} {
		nc := s.connectAs("limiterd-us-east")
		if _, err := nc.SubscribeSync(subject); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		if !errors.Is(nc.LastError(), nats.ErrPermissionViolation) {
			t.Errorf("limiterd-us-east subscribed to %s (last error %v)", subject, nc.LastError())
		}
	}
	nc := s.connectAs("limiterd-us-east")
	if _, err := nc.SubscribeSync(natsconn.InboxPrefix("limiterd-us-east") + ".x"); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil || nc.LastError() != nil {
		t.Fatalf("limiterd-us-east on its own inbox: %v, %v", err, nc.LastError())
	}
}

// TestRulesBucketOnlyAdminWrites: a limiterd's identity (one any gateway
// host holds) cannot put a rule into the bucket, so a global rule of
// capacity 1 cannot be slipped past the admin API; a client without an
// identity is not let in at all.
func TestRulesBucketOnlyAdminWrites(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)
	if nc, err := nats.Connect(s.nats.URL()); err == nil {
		nc.Close()
		t.Error("a client without credentials was let in")
	} else if !errors.Is(err, nats.ErrAuthorization) {
		t.Fatalf("connect without credentials: %v, want %v", err, nats.ErrAuthorization)
	}

	// The admin writer creates the bucket and puts a rule.
	ajs, err := jetstream.New(s.connectAs("admin"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := natsconn.EnsureKeyValue(ctx, ajs, jetstream.KeyValueConfig{Bucket: rulesource.DefaultBucket, History: 5})
	if err != nil {
		t.Fatalf("the admin writer cannot create the rules bucket: %v", err)
	}
	if _, err := kv.Put(ctx, "first", []byte("id: first\ncapacity: 5\nrefill_per_second: 1\n")); err != nil {
		t.Fatalf("the admin writer cannot put a rule: %v", err)
	}

	evil := []byte("id: evil\ncapacity: 1\nrefill_per_second: 0.001\n")
	for _, who := range []string{"limiterd-us-east", "limiterd-eu-west", "reconciler-us-east"} {
		if !s.refused(who, "$KV."+rulesource.DefaultBucket+".evil", evil) {
			t.Errorf("%s put a rule into the bucket", who)
		}
		// The JetStream API's own path to the same subject.
		js, err := jetstream.New(s.connectAs(who))
		if err != nil {
			t.Fatal(err)
		}
		if rkv, err := js.KeyValue(ctx, rulesource.DefaultBucket); err != nil {
			t.Errorf("%s cannot read the rules bucket: %v", who, err)
		} else {
			pctx, cancel := context.WithTimeout(ctx, time.Second)
			if _, err := rkv.Put(pctx, "evil", evil); err == nil {
				t.Errorf("%s: KV put of a rule succeeded", who)
			}
			cancel()
		}
		for _, subject := range []string{"$JS.API.STREAM.DELETE.KV_limiter_rules", "$JS.API.STREAM.PURGE.KV_limiter_rules", "$JS.API.STREAM.UPDATE.KV_limiter_rules"} {
			if !s.refused(who, subject, []byte("{}")) {
				t.Errorf("%s may publish to %s", who, subject)
			}
		}
	}

	// A rule the admin puts after the attempts is in force everywhere, and
	// the bucket is read in order: had "evil" been stored, it would be in
	// force by then too.
	if _, err := kv.Put(ctx, "later", []byte("id: later\ncapacity: 5\nrefill_per_second: 1\n")); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, name := range stackRegions {
		rec := s.regions[name].recs[0]
		for rec.rules.Current().Get("later") == nil {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the admin's rule not in force after 30s", name)
			}
			time.Sleep(50 * time.Millisecond)
		}
		for {
			if _, err := s.check(name, "later", "k"); err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: limiterd does not know the admin's rule after 30s", name)
			}
			time.Sleep(50 * time.Millisecond)
		}
		if rec.rules.Current().Get("evil") != nil {
			t.Errorf("%s: the rule put around the admin API is in force", name)
		}
		if _, err := s.check(name, "evil", "k"); err == nil {
			t.Errorf("%s: limiterd decides with the rule put around the admin API", name)
		}
	}
	if _, err := kv.Get(ctx, "evil"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Errorf("the bucket holds the rule put around the admin API: %v", err)
	}
}

// TestForgedSpendsRefused: a limiterd's identity of us-east cannot publish
// a spend of eu-west (on either of its subjects) nor relayed spends, a
// reconciler's only its own region's partitions, and a batch naming
// another region than its subject's is terminated by the reconciler: the
// key is debited only with what was admitted.
func TestForgedSpendsRefused(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)
	forged := batch(t, "eu-west", "forger", 1, "k", 1000)
	for _, subject := range []string{gossip.PartitionSubject("eu-west", 0), gossip.LocalSubject("eu-west"), gossip.PartitionSubject("us-east", 0)} {
		if !s.refused("limiterd-us-east", subject, forged) {
			t.Errorf("limiterd-us-east published on %s", subject)
		}
	}
	// Another region's partition, or its own region's subject without a
	// partition (no stream holds it, no consumer reads it).
	for _, subject := range []string{gossip.PartitionSubject("eu-west", 0), gossip.RelaySubjectPrefix + "us-east"} {
		if !s.refused("reconciler-us-east", subject, forged) {
			t.Errorf("reconciler-us-east published on %s", subject)
		}
	}
	if !s.refused("reconciler-us-east", gossip.LocalSubject("us-east"), forged) {
		t.Errorf("reconciler-us-east published on %s", gossip.LocalSubject("us-east"))
	}
	// What a subject's own publisher can still send: another region's name.
	s.publish("limiterd-us-east", gossip.LocalSubject("us-east"), forged, "")
	s.publish("reconciler-us-east", gossip.PartitionSubject("us-east", 0), forged, "")

	s.send("us-east", "k", 2)
	s.send("eu-west", "k", 3)
	s.converge("k", 5)
	// The relayed one comes on partition 0, in order with k's spends only
	// when k is in partition 0.
	rejected := func() float64 {
		n := 0.0
		for _, name := range stackRegions {
			n += testutil.ToFloat64(s.regions[name].recs[0].m.apply.Rejected)
		}
		return n
	}
	testenv.WaitFor(t, "both misaddressed messages terminated", func() bool { return rejected() >= 2 })
	if got := rejected(); got != 2 {
		t.Errorf("%v misaddressed messages terminated, want 2", got)
	}
}

// waitCount waits until region counts want for key, failing at once when
// it counts more.
func (s *stack) waitCount(region, key string, want float64) {
	s.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		got := s.count(region, key)
		if got > want {
			s.t.Fatalf("%s counts %v for %s, more than the %v sent: a spend applied twice", region, got, key, want)
		}
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("%s counts %v for %s after 30s, want %v", region, got, key, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestReplayNotDebitedTwice: the same flush published again as a new
// stream message (without its message id, or with another one, as after
// the stream's two-minute duplicate window) debits nothing; its record
// outlives the stream's maximum age.
func TestReplayNotDebitedTwice(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)
	first := batch(t, "us-east", "replayer", 1, "r", 7)
	subject := gossip.PartitionSubject("us-east", 0)
	s.publish("reconciler-us-east", subject, first, "replayer-1-0")
	s.waitCount("eu-west", "r", 7)

	s.publish("reconciler-us-east", subject, first, "")
	s.publish("reconciler-us-east", subject, first, "replayer-1-0-after-the-window")
	// The next flush, applied after the replays (one partition in order).
	s.publish("reconciler-us-east", subject, batch(t, "us-east", "replayer", 2, "r", 1), "replayer-2-0")
	s.waitCount("eu-west", "r", 8)

	rec := s.regions["eu-west"].recs[0]
	if got := testutil.ToFloat64(rec.m.apply.Replays.WithLabelValues("us-east")); got != 2 {
		t.Errorf("replays counted: %v, want 2", got)
	}
	// The record of a partition's message is kept under the region and the
	// partition.
	ttl, err := s.regions["eu-west"].redis.PTTL(context.Background(), redisstore.MessageKey("us-east.0", "replayer", 1, 0)).Result()
	if err != nil {
		t.Fatal(err)
	}
	if ttl <= DefaultStreamMaxAge || ttl > DefaultStreamMaxAge+10*time.Second {
		t.Errorf("the flush's record lives %v, want more than the stream's max age %v", ttl, DefaultStreamMaxAge)
	}
}
