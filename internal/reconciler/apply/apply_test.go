package apply

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/protobuf/proto"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/pkg/gossip"
	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

const testRules = `rules:
  - id: quota
    algorithm: fixed_window
    limit: 100
    window: 1h
    overrides:
      tenant-acme: {limit: 5000}
  - id: solo
    capacity: 10
    refill_per_second: 1
    reconcile: false
`

// fakeMsg is a delivered message; it records how it was settled.
type fakeMsg struct {
	jetstream.Msg
	data      []byte
	header    nats.Header
	seq       uint64
	delivered uint64
	settled   string // "ack", "nak" or "term"
	// terminated records a Term, which a batch's message never gets.
	terminated bool
}

func (m *fakeMsg) Data() []byte         { return m.data }
func (m *fakeMsg) Subject() string      { return "subject" }
func (m *fakeMsg) Headers() nats.Header { return m.header }
func (m *fakeMsg) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{Sequence: jetstream.SequencePair{Stream: m.seq}, NumDelivered: m.delivered}, nil
}
func (m *fakeMsg) Ack() error { m.settled = "ack"; return nil }

// applyOne applies msg alone, as a partition's loop does, and records in
// msg.settled what became of it: "ack" done, "term" rejected (done too),
// "nak" left to be read again.
func applyOne(a *Applier, src Source, msg *fakeMsg) {
	rejected := testutil.ToFloat64(a.m.Rejected)
	switch {
	case a.ApplyBatch(context.Background(), src, []Message{msg}) == 0:
		msg.settled = "nak"
	case testutil.ToFloat64(a.m.Rejected) > rejected:
		msg.settled = "term"
	default:
		msg.settled = "ack"
	}
}
func (m *fakeMsg) NakWithDelay(time.Duration) error { m.settled = "nak"; return nil }
func (m *fakeMsg) Term() error                      { m.settled, m.terminated = "term", true; return nil }

// fakeStore answers FirstSeen with first (the position itself when
// empty) and fails the debits of the keys in fail.
type fakeStore struct {
	first       string
	firstErr    error
	fail        map[string]bool
	applied     []redisstore.ClientDebits
	recordedAt  redisstore.Position
	recordedSrc string
	appliedAt   redisstore.Position
	calls       int // FirstSeenMany and ApplyMessages calls
}

func (s *fakeStore) FirstSeen(_ context.Context, src, _ string, _ uint64, _ uint32, pos redisstore.Position, _ time.Duration) (string, error) {
	s.recordedAt, s.recordedSrc = pos, src
	if s.firstErr != nil {
		return "", s.firstErr
	}
	if s.first != "" {
		return s.first, nil
	}
	return pos.String(), nil
}

func (s *fakeStore) ApplyDebits(_ context.Context, _ string, pos redisstore.Position, _ time.Duration, clients []redisstore.ClientDebits) (redisstore.DebitResult, error) {
	s.appliedAt = pos
	var res redisstore.DebitResult
	for i, c := range clients {
		if s.fail[c.Key] {
			res.Failed = append(res.Failed, i)
			continue
		}
		res.Applied++
		s.applied = append(s.applied, c)
	}
	if len(res.Failed) > 0 {
		return res, errors.New("node down")
	}
	return res, nil
}

func (s *fakeStore) FirstSeenMany(ctx context.Context, src string, recs []redisstore.Record, ttl time.Duration) ([]string, []error) {
	s.calls++
	firsts, errs := make([]string, len(recs)), make([]error, len(recs))
	for i, r := range recs {
		firsts[i], errs[i] = s.FirstSeen(ctx, src, r.Instance, r.Seq, r.Part, r.Pos, ttl)
	}
	return firsts, errs
}

func (s *fakeStore) ApplyMessages(ctx context.Context, src string, ttl time.Duration, msgs []redisstore.MessageDebits) ([]redisstore.DebitResult, error) {
	s.calls++
	res := make([]redisstore.DebitResult, len(msgs))
	var errs []error
	for i, m := range msgs {
		var err error
		res[i], err = s.ApplyDebits(ctx, src, m.Pos, ttl, m.Clients)
		errs = append(errs, err)
	}
	return res, errors.Join(errs...)
}

// fakeJS keeps what is published to the retry stream, and reports the
// subjects with entries.
type fakeJS struct {
	published map[string][][]byte
}

func (j *fakeJS) Publish(_ context.Context, subject string, data []byte, _ ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	if j.published == nil {
		j.published = map[string][][]byte{}
	}
	j.published[subject] = append(j.published[subject], data)
	return &jetstream.PubAck{}, nil
}

func (j *fakeJS) Pending(context.Context, string) (map[string]uint64, error) {
	subjects := map[string]uint64{}
	for subject, entries := range j.published {
		subjects[subject] = uint64(len(entries))
	}
	return subjects, nil
}

type fixedRules struct{ set *rules.Set }

func (r fixedRules) Current() *rules.Set { return r.set }

var testNow = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func newTestApplier(t *testing.T, store Store, js *fakeJS) (*Applier, *Metrics, *prometheus.Registry) {
	t.Helper()
	set, err := rules.Parse("rules.yml", []byte(testRules))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.AddSource("us-east")
	a := New(Options{Region: "eu-west", AckWait: time.Second, StreamMaxAge: time.Hour, MaxMessageBytes: gossip.DefaultMaxMessageBytes,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Now: func() time.Time { return testNow }}, store, js, fixedRules{set}, m)
	return a, m, reg
}

func spendBatch(t *testing.T, region string, spends ...*gossipv1.Spend) []byte {
	t.Helper()
	return spendBatchAt(t, region, testNow.Add(-1500*time.Millisecond), spends...)
}

// spendBatchAt is a batch flushed at flushed: a test of a real store,
// whose clock is the real one, flushes at time.Now(), or its spends were
// all admitted long ago.
func spendBatchAt(t *testing.T, region string, flushed time.Time, spends ...*gossipv1.Spend) []byte {
	t.Helper()
	at := flushed.UnixMicro()
	data, err := proto.Marshal(&gossipv1.SpendBatch{Region: region, Instance: "limiterd-1", Sequence: 7, Parts: 1,
		FirstAdmittedUnixMicros: at, FlushedUnixMicros: at, Spends: spends})
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func TestApply(t *testing.T) {
	usEast := Source{Name: "us-east", Epoch: 42, Partition: 2}
	tests := []struct {
		name    string
		store   *fakeStore
		region  string
		spends  []*gossipv1.Spend
		settled string
		// applied keys, deferred keys, and the counters after
		applied, deferred                          []string
		rejected, replays, dups, skipped, invalids float64
	}{
		{name: "applied", store: &fakeStore{}, region: "us-east",
			spends:  []*gossipv1.Spend{{RuleId: "quota", Key: "a", Cost: 2}, {RuleId: "quota", Key: "a", Cost: 3}, {RuleId: "quota", Key: "b", Cost: 1}},
			settled: "ack", applied: []string{"a", "b"}},
		{name: "misaddressed", store: &fakeStore{}, region: "ap-south",
			spends:  []*gossipv1.Spend{{RuleId: "quota", Key: "a", Cost: 1}},
			settled: "term", rejected: 1},
		{name: "unreconciled rule skipped", store: &fakeStore{}, region: "us-east",
			spends:  []*gossipv1.Spend{{RuleId: "solo", Key: "a", Cost: 1}, {RuleId: "gone", Key: "a", Cost: 1}},
			settled: "ack", skipped: 2},
		{name: "invalid entry skipped", store: &fakeStore{}, region: "us-east",
			spends:  []*gossipv1.Spend{{RuleId: "quota", Key: "", Cost: 1}, {RuleId: "quota", Key: "b", Cost: 1}},
			settled: "ack", applied: []string{"b"}, invalids: 1},
		{name: "replayed", store: &fakeStore{first: "1-1"}, region: "us-east",
			spends:  []*gossipv1.Spend{{RuleId: "quota", Key: "a", Cost: 1}, {RuleId: "quota", Key: "b", Cost: 1}},
			settled: "ack", replays: 1, dups: 2},
		{name: "not recorded, asked again", store: &fakeStore{firstErr: errors.New("timeout")}, region: "us-east",
			spends:  []*gossipv1.Spend{{RuleId: "quota", Key: "a", Cost: 1}},
			settled: "nak"},
		{name: "not recorded anywhere, deferred", store: &fakeStore{firstErr: redisstore.ErrNotRecorded}, region: "us-east",
			spends:  []*gossipv1.Spend{{RuleId: "quota", Key: "a", Cost: 1}},
			settled: "ack", deferred: []string{"a"}},
		{name: "node down, deferred", store: &fakeStore{fail: map[string]bool{"b": true}}, region: "us-east",
			spends:  []*gossipv1.Spend{{RuleId: "quota", Key: "a", Cost: 1}, {RuleId: "quota", Key: "b", Cost: 1}},
			settled: "ack", applied: []string{"a"}, deferred: []string{"b"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			js := &fakeJS{}
			a, m, _ := newTestApplier(t, tt.store, js)
			src := usEast
			src.Retry = js
			msg := &fakeMsg{data: spendBatch(t, tt.region, tt.spends...), seq: 9, delivered: 1}
			applyOne(a, src, msg)
			if msg.settled != tt.settled {
				t.Errorf("message settled %q, want %q", msg.settled, tt.settled)
			}
			var applied []string
			for _, c := range tt.store.applied {
				applied = append(applied, c.Key)
			}
			if !slices.Equal(applied, tt.applied) {
				t.Errorf("applied %v, want %v", applied, tt.applied)
			}
			var deferred []string
			for _, entries := range js.published {
				for _, data := range entries {
					e, err := decodeRetry(data, "us-east")
					if err != nil {
						t.Fatal(err)
					}
					if e.Epoch != 42 || e.Seq != 9 || *e.Partition != 2 {
						t.Errorf("retry entry at %d-%d of partition %d, want 42-9 of 2", e.Epoch, e.Seq, *e.Partition)
					}
					for _, c := range e.Clients {
						deferred = append(deferred, c.Key)
					}
				}
			}
			// The partition's record and markers.
			want := redisstore.Position{Epoch: 42, Seq: 9, Partition: 2}
			if tt.store.recordedSrc != "" && (tt.store.recordedSrc != "us-east.2" || tt.store.recordedAt != want) {
				t.Errorf("recorded at %+v of %q, want %+v of us-east.2", tt.store.recordedAt, tt.store.recordedSrc, want)
			}
			if len(tt.store.applied) > 0 && tt.store.appliedAt != want {
				t.Errorf("applied at %+v, want %+v", tt.store.appliedAt, want)
			}
			slices.Sort(deferred)
			if !slices.Equal(deferred, tt.deferred) {
				t.Errorf("deferred %v, want %v", deferred, tt.deferred)
			}
			for name, c := range map[string]struct {
				got, want float64
			}{
				"rejected":   {testutil.ToFloat64(m.Rejected), tt.rejected},
				"replays":    {testutil.ToFloat64(m.Replays.WithLabelValues("us-east")), tt.replays},
				"duplicates": {testutil.ToFloat64(m.Duplicates.WithLabelValues("us-east")), tt.dups},
				"skipped":    {testutil.ToFloat64(m.Skipped.WithLabelValues("us-east")), tt.skipped},
				"invalid":    {testutil.ToFloat64(m.Invalid.WithLabelValues("us-east")), tt.invalids},
				"applied":    {testutil.ToFloat64(m.Applied.WithLabelValues("us-east")), float64(len(tt.applied))},
				"deferred":   {testutil.ToFloat64(m.Deferred.WithLabelValues("us-east")), float64(len(tt.deferred))},
			} {
				if c.got != c.want {
					t.Errorf("%s = %v, want %v", name, c.got, c.want)
				}
			}
		})
	}
}

// TestApplyDebitsGrouped: a client's spends of one rule are one debit, with
// this region's limit.
func TestApplyDebitsGrouped(t *testing.T) {
	store := &fakeStore{}
	a, _, _ := newTestApplier(t, store, &fakeJS{})
	msg := &fakeMsg{data: spendBatch(t, "us-east", &gossipv1.Spend{RuleId: "quota", Key: "a", Cost: 2},
		&gossipv1.Spend{RuleId: "quota", Key: "a", Cost: 3}), seq: 1, delivered: 1}
	applyOne(a, Source{Name: "us-east", Epoch: 1, Retry: &fakeJS{}}, msg)
	if len(store.applied) != 1 || len(store.applied[0].Debits) != 1 {
		t.Fatalf("applied %+v, want one client with one debit", store.applied)
	}
	if d := store.applied[0].Debits[0]; d.Rule != "quota" || d.Amount != 5 || d.Limit.Capacity != 100 {
		t.Errorf("debit %+v, want 5 of quota with its limit of 100", d)
	}
}

// A debit of a key with an override is applied against the override's
// limit (the debt bound and the overshoot are the key's), the other keys'
// against the rule's.
func TestApplyDebitsUseOverrides(t *testing.T) {
	store := &fakeStore{}
	a, _, _ := newTestApplier(t, store, &fakeJS{})
	msg := &fakeMsg{data: spendBatch(t, "us-east", &gossipv1.Spend{RuleId: "quota", Key: "tenant-acme", Cost: 2},
		&gossipv1.Spend{RuleId: "quota", Key: "b", Cost: 3}), seq: 1, delivered: 1}
	applyOne(a, Source{Name: "us-east", Epoch: 1, Retry: &fakeJS{}}, msg)
	limits := map[string]float64{}
	for _, c := range store.applied {
		for _, d := range c.Debits {
			limits[c.Key] = d.Limit.Capacity
		}
	}
	if limits["tenant-acme"] != 5000 || limits["b"] != 100 {
		t.Fatalf("debits' limits %v, want tenant-acme's 5000 and b's 100", limits)
	}
}

// TestApplyWaitsBehindRetries: a client of a bucket with entries in the
// retry stream goes there too, behind them; the others are applied.
func TestApplyWaitsBehindRetries(t *testing.T) {
	store := &fakeStore{}
	js := &fakeJS{}
	a, _, _ := newTestApplier(t, store, js)
	waiting := "w"
	js.published = map[string][][]byte{a.retrySubject("us-east", bucketOf(waiting)): {[]byte("{}")}}
	other := "o"
	for i := 0; bucketOf(other) == bucketOf(waiting); i++ {
		other = strings.Repeat("o", i+2)
	}
	msg := &fakeMsg{data: spendBatch(t, "us-east", &gossipv1.Spend{RuleId: "quota", Key: waiting, Cost: 1},
		&gossipv1.Spend{RuleId: "quota", Key: other, Cost: 1}), seq: 3, delivered: 1}
	applyOne(a, Source{Name: "us-east", Epoch: 1, Retry: js}, msg)
	if len(store.applied) != 1 || store.applied[0].Key != other {
		t.Errorf("applied %+v, want only %s", store.applied, other)
	}
	entries := js.published[a.retrySubject("us-east", bucketOf(waiting))]
	if len(entries) != 2 {
		t.Fatalf("%d entries in the bucket, want the waiting one and %s's", len(entries), waiting)
	}
	var e retryEntry
	if err := json.Unmarshal(entries[1], &e); err != nil || len(e.Clients) != 1 || e.Clients[0].Key != waiting {
		t.Errorf("entry %+v (%v), want %s's debit", e, err, waiting)
	}
	if msg.settled != "ack" {
		t.Errorf("message settled %q, want ack", msg.settled)
	}
}

// TestApplyObservesLag: the lag runs from the batch's first admission to
// the clock's now, and each debit's overshoot is observed by rule.
func TestApplyObservesLag(t *testing.T) {
	a, m, reg := newTestApplier(t, &fakeStore{}, &fakeJS{})
	msg := &fakeMsg{data: spendBatch(t, "us-east", &gossipv1.Spend{RuleId: "quota", Key: "a", Cost: 1}), seq: 1, delivered: 1}
	applyOne(a, Source{Name: "us-east", Epoch: 1, Retry: &fakeJS{}}, msg)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		switch mf.GetName() {
		case "limiter_reconcile_lag_seconds":
			h := mf.GetMetric()[0].GetHistogram()
			if h.GetSampleCount() != 1 || h.GetSampleSum() != 1.5 {
				t.Errorf("lag: %d samples of sum %v, want one of 1.5", h.GetSampleCount(), h.GetSampleSum())
			}
		case "limiter_overshoot_tokens":
			if n := len(mf.GetMetric()); n != 1 {
				t.Errorf("overshoot has %d series, want 1", n)
			}
		}
	}
	if n := testutil.CollectAndCount(m.Lag); n != 1 {
		t.Errorf("lag has %d series, want 1", n)
	}
	testenv.Lint(t, mfs)
}

// TestApplyReset: an entry that resets its key makes the key's debit a
// reset that forgives the entries before it in the message and carries
// those after it; it goes to the retry stream and back as a reset.
func TestApplyReset(t *testing.T) {
	store := &fakeStore{}
	a, _, _ := newTestApplier(t, store, &fakeJS{})
	msg := &fakeMsg{data: spendBatch(t, "us-east", &gossipv1.Spend{RuleId: "quota", Key: "a", Cost: 2},
		&gossipv1.Spend{RuleId: "quota", Key: "a", ResetBefore: true}, &gossipv1.Spend{RuleId: "quota", Key: "a", Cost: 3},
		&gossipv1.Spend{RuleId: "quota", Key: "b", Cost: 1}), seq: 1, delivered: 1}
	applyOne(a, Source{Name: "us-east", Epoch: 1, Retry: &fakeJS{}}, msg)
	if len(store.applied) != 2 {
		t.Fatalf("applied %+v, want two clients", store.applied)
	}
	if d := store.applied[0].Debits[0]; !d.Reset || d.Amount != 3 {
		t.Errorf("a's debit %+v, want a reset then 3", d)
	}
	if d := store.applied[1].Debits[0]; d.Reset || d.Amount != 1 {
		t.Errorf("b's debit %+v, want 1 without a reset", d)
	}
	js := &fakeJS{}
	b, _, _ := newTestApplier(t, &fakeStore{}, js)
	p := 0
	entry := retryEntry{Source: "us-east", Epoch: 3, Seq: 4, Partition: &p, FirstAdmitted: 1}
	if err := b.publishRetries(context.Background(), entry, []redisstore.ClientDebits{{Key: "a", Debits: []redisstore.Debit{{Rule: "quota", Reset: true}}}}); err != nil {
		t.Fatal(err)
	}
	e, err := decodeRetry(js.published[b.retrySubject("us-east", bucketOf("a"))][0], "us-east")
	if err != nil {
		t.Fatal(err)
	}
	if d := e.Clients[0].Debits[0]; !d.Reset || d.Amount != 0 {
		t.Errorf("retry entry's debit %+v, want a reset of 0", d)
	}
}
