package apply

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/proto"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// flushMsg is message seq of a batch: flush seq of limiterd-1, flushed
// at flushed, spending 1 of quota for each key.
func flushMsg(t *testing.T, seq uint64, flushed time.Time, keys ...string) *fakeMsg {
	t.Helper()
	at := flushed.UnixMicro()
	b := &gossipv1.SpendBatch{Region: "us-east", Instance: "limiterd-1", Sequence: seq, Parts: 1, FirstAdmittedUnixMicros: at, FlushedUnixMicros: at}
	for _, k := range keys {
		b.Spends = append(b.Spends, &gossipv1.Spend{RuleId: "quota", Key: k, Cost: 1})
	}
	data, err := proto.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	return &fakeMsg{data: data, seq: seq, delivered: 1}
}

// applyBatch applies ms as one batch and records each message done as
// "ack" in its settled.
func applyBatch(ctx context.Context, a *Applier, src Source, ms []*fakeMsg) int {
	in := make([]Message, len(ms))
	for i, m := range ms {
		in[i] = m
	}
	done := a.ApplyBatch(ctx, src, in)
	for _, m := range ms[:done] {
		m.settled = "ack"
	}
	return done
}

// seqStore is a fakeStore whose records answer per stream sequence:
// replayed names the sequences whose flush came first elsewhere, failRec
// those whose record does not answer.
type seqStore struct {
	fakeStore
	replayed, failRec map[uint64]bool
}

func (s *seqStore) FirstSeenMany(_ context.Context, _ string, recs []redisstore.Record, _ time.Duration) ([]string, []error) {
	s.calls++
	firsts, errs := make([]string, len(recs)), make([]error, len(recs))
	for i, r := range recs {
		switch {
		case s.failRec[r.Pos.Seq]:
			errs[i] = errors.New("timeout")
		case s.replayed[r.Pos.Seq]:
			firsts[i] = "1:1"
		default:
			firsts[i] = r.Pos.String()
		}
	}
	return firsts, errs
}

// TestApplyBatch: a batch of messages costs one record call and one debit
// call; a replayed message in it is acknowledged and debits nothing; a
// message whose record does not answer stops the batch, and it and every
// later one are left to be delivered again, in order, with nothing of the
// later ones debited before it; a retry stream that does not answer stops it
// at the first message with debits to defer.
func TestApplyBatch(t *testing.T) {
	batch := func() []*fakeMsg {
		var out []*fakeMsg
		for i := range 6 {
			out = append(out, flushMsg(t, uint64(i+1), testNow, "a", "k"+strconv.Itoa(i)))
		}
		return out
	}
	settled := func(ms []*fakeMsg) (out []string) {
		for _, m := range ms {
			out = append(out, m.settled)
		}
		return out
	}
	t.Run("one round trip", func(t *testing.T) {
		store := &seqStore{fakeStore: fakeStore{}, replayed: map[uint64]bool{3: true}}
		js := &fakeJS{}
		a, _, reg := newTestApplier(t, store, js)
		src := Source{Name: "us-east", Epoch: 42, Retry: js}
		ms := batch()
		if done := applyBatch(context.Background(), a, src, ms); done != len(ms) {
			t.Fatalf("ApplyBatch stopped at %d", done)
		}
		if store.calls != 2 {
			t.Errorf("6 messages took %d store calls, want 2 (the records, the debits)", store.calls)
		}
		if got := settled(ms); !equal(got, []string{"ack", "ack", "ack", "ack", "ack", "ack"}) {
			t.Errorf("settled %v, want every one acked", got)
		}
		if len(store.applied) != 10 {
			t.Errorf("%d clients applied, want 10: 2 of each message but the replayed one", len(store.applied))
		}
		for _, c := range store.applied {
			if c.Key == "k2" {
				t.Errorf("the replayed message's client %s was debited", c.Key)
			}
		}
		if got := counter(t, reg, "limiter_spend_replays_total"); got != 1 {
			t.Errorf("replays = %v, want 1", got)
		}
	})
	t.Run("record fails", func(t *testing.T) {
		store := &seqStore{fakeStore: fakeStore{}, failRec: map[uint64]bool{4: true}}
		js := &fakeJS{}
		a, _, _ := newTestApplier(t, store, js)
		src := Source{Name: "us-east", Epoch: 42, Retry: js}
		ms := batch()
		if done := applyBatch(context.Background(), a, src, ms); done != 3 {
			t.Fatalf("ApplyBatch stopped at %d, want 3 (message 4)", done)
		}
		if got := settled(ms); !equal(got, []string{"ack", "ack", "ack", "", "", ""}) {
			t.Errorf("settled %v, want 1 to 3 acked, 4 to 6 left to be delivered again", got)
		}
		for _, c := range store.applied {
			if c.Key == "k3" || c.Key == "k4" || c.Key == "k5" {
				t.Errorf("client %s of a message at or after the failed one was debited", c.Key)
			}
		}
		if len(store.applied) != 6 {
			t.Errorf("%d clients applied, want 6", len(store.applied))
		}
	})
	t.Run("node down", func(t *testing.T) {
		store := &seqStore{fakeStore: fakeStore{fail: map[string]bool{"a": true, "k1": true}}}
		js := &fakeJS{}
		a, _, _ := newTestApplier(t, store, js)
		src := Source{Name: "us-east", Epoch: 42, Retry: js}
		ms := batch()
		if done := applyBatch(context.Background(), a, src, ms); done != len(ms) {
			t.Fatalf("ApplyBatch stopped at %d", done)
		}
		if got := settled(ms); !equal(got, []string{"ack", "ack", "ack", "ack", "ack", "ack"}) {
			t.Errorf("settled %v, want every one acked", got)
		}
		var entries []retryEntry
		for _, data := range js.published[a.retrySubject("us-east", bucketOf("a"))] {
			e, err := decodeRetry(data, "us-east")
			if err != nil {
				t.Fatal(err)
			}
			entries = append(entries, *e)
		}
		if len(entries) != 6 {
			t.Fatalf("%d retry entries of a's bucket, want one per message", len(entries))
		}
		for i, e := range entries {
			if e.Seq != uint64(i+1) {
				t.Errorf("retry entry %d is of message %d, want %d: in order", i, e.Seq, i+1)
			}
		}
		if len(store.applied) != 5 {
			t.Errorf("%d clients applied, want 5 (k0, k2 to k5)", len(store.applied))
		}
	})
	t.Run("rejected passed", func(t *testing.T) {
		store := &seqStore{fakeStore: fakeStore{}}
		js := &fakeJS{}
		a, m, _ := newTestApplier(t, store, js)
		src := Source{Name: "us-east", Epoch: 42, Retry: js}
		ms := batch()
		ms[2].data = []byte("not a spend message")
		if done := applyBatch(context.Background(), a, src, ms); done != len(ms) {
			t.Fatalf("ApplyBatch stopped at %d, want the rejected message passed", done)
		}
		for _, msg := range ms {
			if msg.terminated {
				t.Errorf("message %d terminated: the batch's messages are not acknowledged", msg.seq)
			}
		}
		if got := testutil.ToFloat64(m.Rejected); got != 1 {
			t.Errorf("rejected = %v, want 1", got)
		}
		if len(store.applied) != 10 {
			t.Errorf("%d clients applied, want 10: 2 of each message but the rejected one", len(store.applied))
		}
	})
	t.Run("stopped before done", func(t *testing.T) {
		store := &seqStore{fakeStore: fakeStore{}}
		js := &fakeJS{}
		a, _, _ := newTestApplier(t, store, js)
		a.opts.BeforeDone = func(_ string, seq uint64) bool { return seq != 4 }
		src := Source{Name: "us-east", Epoch: 42, Retry: js}
		ms := batch()
		if done := applyBatch(context.Background(), a, src, ms); done != 3 {
			t.Fatalf("ApplyBatch stopped at %d, want 3: message 4 is not done", done)
		}
	})
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// TestApplyBatchNodeDownOnRedis: on a 3-primary cluster with one primary
// stopped, a batch of 8 messages sharing a client of each primary applies
// the live primaries' clients once per message, sends the stopped one's to
// the retry stream (one entry per message, in order) and acknowledges
// each message once; the same batch delivered again debits nothing more.
func TestApplyBatchNodeDownOnRedis(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ctx := context.Background()
	store, err := redisstore.New(ctx, redisstore.Options{Addrs: c.Addrs(), Timeout: time.Second}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { cc.Close() })
	// One key per primary, and which primary serves it.
	byNode := map[string]string{}
	var keys []string
	for i := 0; len(keys) < 3; i++ {
		k := "n-" + strconv.Itoa(i)
		n, err := cc.MasterForKey(ctx, redisstore.Key("quota", k))
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := byNode[n.Options().Addr]; !ok {
			byNode[n.Options().Addr] = k
			keys = append(keys, k)
		}
	}
	down := keys[0]
	var downAddr string
	for addr, k := range byNode {
		if k == down {
			downAddr = addr
		}
	}
	js := &fakeJS{}
	a, _, _ := newTestApplier(t, store, js)
	src := Source{Name: "us-east", Epoch: 1, Retry: js}
	var ms []*fakeMsg
	for i := range 8 {
		ms = append(ms, flushMsg(t, uint64(i+1), time.Now(), keys...))
	}
	for _, n := range c.Nodes() {
		if n.Addr() == downAddr {
			n.Stop()
		}
	}
	// The flush records' copies are on two primaries: one answers.
	if done := applyBatch(ctx, a, src, ms); done != len(ms) {
		t.Fatalf("ApplyBatch stopped at %d", done)
	}
	for i, m := range ms {
		if m.settled != "ack" {
			t.Errorf("message %d settled %q, want ack", i+1, m.settled)
		}
	}
	var seqs []uint64
	for _, data := range js.published[a.retrySubject("us-east", bucketOf(down))] {
		e, err := decodeRetry(data, "us-east")
		if err != nil {
			t.Fatal(err)
		}
		if len(e.Clients) != 1 || e.Clients[0].Key != down {
			t.Errorf("retry entry of message %d holds %+v, want %s alone", e.Seq, e.Clients, down)
		}
		seqs = append(seqs, e.Seq)
	}
	if len(seqs) != 8 {
		t.Fatalf("retry entries of messages %v, want 1 to 8", seqs)
	}
	for i, s := range seqs {
		if s != uint64(i+1) {
			t.Errorf("retry entries of messages %v, want 1 to 8 in order", seqs)
			break
		}
	}
	used := func() []float64 {
		lim := a.rules.Current().Get("quota").BucketFor("x")
		u, err := store.Used(ctx, []bucket.Request{{Rule: "quota", Key: keys[1], Limit: lim}, {Rule: "quota", Key: keys[2], Limit: lim}})
		if err != nil {
			t.Fatal(err)
		}
		return u
	}
	if u := used(); u[0] != 8 || u[1] != 8 {
		t.Errorf("the live primaries' clients count %v, want 8 each", u)
	}
	for _, m := range ms {
		m.settled, m.delivered = "", 2
	}
	if done := applyBatch(ctx, a, src, ms); done != len(ms) {
		t.Fatalf("delivered again, ApplyBatch stopped at %d", done)
	}
	if u := used(); u[0] != 8 || u[1] != 8 {
		t.Errorf("delivered again, the live primaries' clients count %v, want 8 each", u)
	}
}
