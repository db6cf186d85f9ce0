package apply

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/redisstore"
	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

func TestDecodeRetry(t *testing.T) {
	const good = `{"source":"us-east","epoch":5,"seq":9,"partition":3,"first_admitted_unix_micros":1,"clients":[{"key":"k","debits":[{"rule":"quota","amount":2}]}]}`
	tests := []struct {
		name, data string
		ok         bool
	}{
		{"good", good, true},
		{"good with flush", strings.Replace(good, `"clients"`, `"flush":{"instance":"i","sequence":1,"part":0},"clients"`, 1), true},
		{"not json", `{`, false},
		{"unknown field", strings.Replace(good, `"seq"`, `"extra":1,"seq"`, 1), false},
		{"another source", strings.Replace(good, `"us-east"`, `"ap-south"`, 1), false},
		{"no epoch", strings.Replace(good, `"epoch":5`, `"epoch":0`, 1), false},
		{"no seq", strings.Replace(good, `"seq":9`, `"seq":0`, 1), false},
		{"no partition", strings.Replace(good, `"partition":3,`, ``, 1), false},
		{"null partition", strings.Replace(good, `"partition":3`, `"partition":null`, 1), false},
		{"negative partition", strings.Replace(good, `"partition":3`, `"partition":-1`, 1), false},
		{"partition out of range", strings.Replace(good, `"partition":3`, `"partition":32`, 1), false},
		{"no first admission", strings.Replace(good, `"first_admitted_unix_micros":1`, `"first_admitted_unix_micros":0`, 1), false},
		{"no clients", `{"source":"us-east","epoch":5,"seq":9,"partition":3,"first_admitted_unix_micros":1,"clients":[]}`, false},
		{"flush without instance", strings.Replace(good, `"clients"`, `"flush":{"instance":"","sequence":1,"part":0},"clients"`, 1), false},
		{"client without debits", strings.Replace(good, `"debits":[{"rule":"quota","amount":2}]`, `"debits":[]`, 1), false},
		{"zero amount", strings.Replace(good, `"amount":2`, `"amount":0`, 1), false},
		{"bad rule id", strings.Replace(good, `"rule":"quota"`, `"rule":"no such rule!"`, 1), false},
		{"no key", strings.Replace(good, `"key":"k"`, `"key":""`, 1), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e, err := decodeRetry([]byte(tt.data), "us-east")
			if tt.ok {
				if err != nil {
					t.Fatalf("decodeRetry: %v", err)
				}
				if e.Seq != 9 || *e.Partition != 3 || len(e.Clients) != 1 {
					t.Errorf("decoded %+v", e)
				}
				return
			}
			if !errors.Is(err, errInvalidRetry) {
				t.Fatalf("decodeRetry = %v, want errInvalidRetry", err)
			}
		})
	}
}

// TestPublishRetriesByBucket: clients' debits go out one entry per bucket,
// on the bucket's subject, in the order the buckets first appear, and
// decode back to the same debits.
func TestPublishRetriesByBucket(t *testing.T) {
	js := &fakeJS{}
	a, _, _ := newTestApplier(t, &fakeStore{}, js)
	var clients []redisstore.ClientDebits
	buckets := map[int]int{}
	for i := 0; len(clients) < 20; i++ {
		key := strings.Repeat("k", i+1)
		clients = append(clients, redisstore.ClientDebits{Key: key, Debits: []redisstore.Debit{{Rule: "quota", Amount: float64(i + 1)}}})
		buckets[bucketOf(key)]++
	}
	p := 5
	entry := retryEntry{Source: "us-east", Epoch: 3, Seq: 4, Partition: &p, FirstAdmitted: 1}
	if err := a.publishRetries(context.Background(), entry, clients); err != nil {
		t.Fatal(err)
	}
	if len(js.published) != len(buckets) {
		t.Fatalf("%d subjects published to, want one per bucket (%d)", len(js.published), len(buckets))
	}
	for b, n := range buckets {
		entries := js.published[a.retrySubject("us-east", b)]
		if len(entries) != 1 {
			t.Fatalf("bucket %d: %d entries, want 1", b, len(entries))
		}
		e, err := decodeRetry(entries[0], "us-east")
		if err != nil {
			t.Fatal(err)
		}
		if *e.Partition != p {
			t.Errorf("bucket %d: entry of partition %d, want %d", b, *e.Partition, p)
		}
		if len(e.Clients) != n {
			t.Errorf("bucket %d: %d clients, want %d", b, len(e.Clients), n)
		}
		for _, c := range e.Clients {
			if bucketOf(c.Key) != b {
				t.Errorf("client %s in bucket %d's entry, its bucket is %d", c.Key, b, bucketOf(c.Key))
			}
		}
	}
	pending, err := a.pendingBuckets(context.Background(), Source{Name: "us-east", Retry: js})
	if err != nil {
		t.Fatal(err)
	}
	if len(pending) != len(buckets) {
		t.Errorf("pending buckets %v, want %d", pending, len(buckets))
	}
	for b := range buckets {
		if !pending[b] {
			t.Errorf("bucket %d not pending", b)
		}
	}
}

// TestRetry: an entry is applied with its message's position and acked;
// one whose flush was applied from another message is skipped; one that
// fails again is asked for later; garbage is rejected.
func TestRetry(t *testing.T) {
	const entry = `{"source":"us-east","epoch":5,"seq":9,"partition":3,"first_admitted_unix_micros":1,"flush":{"instance":"i","sequence":1,"part":0},"clients":[{"key":"k","debits":[{"rule":"quota","amount":2}]}]}`
	tests := []struct {
		name                      string
		store                     *fakeStore
		data, settled             string
		retried, replays, rejects float64
	}{
		{"applied", &fakeStore{}, entry, "ack", 1, 0, 0},
		{"replayed", &fakeStore{first: "1-1"}, entry, "ack", 0, 1, 0},
		{"node still down", &fakeStore{fail: map[string]bool{"k": true}}, entry, "nak", 0, 0, 0},
		{"garbage", &fakeStore{}, "{", "term", 0, 0, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, m, _ := newTestApplier(t, tt.store, &fakeJS{})
			msg := &fakeMsg{data: []byte(tt.data), seq: 1, delivered: 1}
			a.Retry(context.Background(), Source{Name: "us-east", Epoch: 77}, msg)
			if msg.settled != tt.settled {
				t.Errorf("settled %q, want %q", msg.settled, tt.settled)
			}
			// The message's position and partition: its record and markers
			// are the partition's.
			want := redisstore.Position{Epoch: 5, Seq: 9, Partition: 3}
			if tt.data == entry && (tt.store.recordedAt != want || tt.store.recordedSrc != "us-east.3") {
				t.Errorf("recorded at %+v of %q, want the message's position %+v of us-east.3", tt.store.recordedAt, tt.store.recordedSrc, want)
			}
			if tt.data == entry && tt.store.appliedAt != (redisstore.Position{}) && tt.store.appliedAt != want {
				t.Errorf("applied at %+v, want the message's position %+v", tt.store.appliedAt, want)
			}
			if got := testutil.ToFloat64(m.Retried.WithLabelValues("us-east")); got != tt.retried {
				t.Errorf("retried = %v, want %v", got, tt.retried)
			}
			if got := testutil.ToFloat64(m.Replays.WithLabelValues("us-east")); got != tt.replays {
				t.Errorf("replays = %v, want %v", got, tt.replays)
			}
			if got := testutil.ToFloat64(m.Rejected); got != tt.rejects {
				t.Errorf("rejected = %v, want %v", got, tt.rejects)
			}
		})
	}
}

// TestBucketOfKey: a key's retry bucket is that of the hash slot of its
// buckets and of its markers of every source and partition.
func TestBucketOfKey(t *testing.T) {
	for _, key := range []string{"k", "user:42", "{tagged}rest", "a{b}c", "%7B", "}{"} {
		b := bucketOf(key)
		for _, other := range []string{redisstore.Key("quota", key), redisstore.PartitionMarkerKey(key, "us-east", 0), redisstore.PartitionMarkerKey(key, "eu-west", 7)} {
			if got := redisstore.Slot(other) * retryBuckets / 16384; got != b {
				t.Errorf("%q: bucket %d, but %q is in bucket %d", key, b, other, got)
			}
		}
	}
}

// TestDebitAsOfLastAdmission: each debit is applied as of its spend's last
// admission, its message's flush less the entry's ms before it, plus the
// clock allowance; two entries of one key and rule go as of the later. A
// debit that waits in the retry stream keeps its instant. A message or
// entry of a publisher that does not say is applied as of the flush; a
// retry entry of an older reconciler, as of now.
func TestDebitAsOfLastAdmission(t *testing.T) {
	store := &fakeStore{fail: map[string]bool{"down": true}}
	js := &fakeJS{}
	a, _, _ := newTestApplier(t, store, js)
	a.opts.ClockAllowance = 250 * time.Millisecond
	flushed := time.Now()
	f := flushed.UnixMicro()
	msg := &fakeMsg{data: spendBatchAt(t, "us-east", flushed,
		&gossipv1.Spend{RuleId: "quota", Key: "a", Cost: 1, LastAdmittedMsBeforeFlush: 4000},
		&gossipv1.Spend{RuleId: "quota", Key: "b", Cost: 1},
		&gossipv1.Spend{RuleId: "quota", Key: "a", Cost: 2, LastAdmittedMsBeforeFlush: 1500},
		&gossipv1.Spend{RuleId: "quota", Key: "down", Cost: 3, LastAdmittedMsBeforeFlush: 2000}), seq: 1, delivered: 1}
	applyOne(a, Source{Name: "us-east", Epoch: 1, Retry: js}, msg)
	if msg.settled != "ack" {
		t.Fatalf("message settled %q, want ack (the failed client deferred)", msg.settled)
	}
	at := map[string]int64{}
	for _, c := range store.applied {
		at[c.Key] = c.Debits[0].At
	}
	allowance := int64(250_000)
	if want := f - 1_500_000 + allowance; at["a"] != want {
		t.Errorf("a as of %d, want %d: the later entry's admission, plus the allowance", at["a"], want)
	}
	if want := f + allowance; at["b"] != want {
		t.Errorf("b as of %d, want %d: the flush, plus the allowance", at["b"], want)
	}
	var entries [][]byte
	for _, e := range js.published {
		entries = append(entries, e...)
	}
	if len(entries) != 1 {
		t.Fatalf("%d retry entries, want 1", len(entries))
	}
	delete(store.fail, "down")
	store.applied = nil
	retry := &fakeMsg{data: entries[0], seq: 1, delivered: 1}
	a.Retry(context.Background(), Source{Name: "us-east", Epoch: 77}, retry)
	if retry.settled != "ack" || len(store.applied) != 1 {
		t.Fatalf("retry settled %q, %d clients applied; want ack, 1", retry.settled, len(store.applied))
	}
	if got, want := store.applied[0].Debits[0].At, f-2_000_000+allowance; got != want {
		t.Errorf("retried debit as of %d, want %d: its admission, as first received", got, want)
	}
	store.applied = nil
	old := &fakeMsg{data: []byte(`{"source":"us-east","epoch":5,"seq":9,"partition":3,"first_admitted_unix_micros":1,"clients":[{"key":"k","debits":[{"rule":"quota","amount":2}]}]}`), seq: 2, delivered: 1}
	a.Retry(context.Background(), Source{Name: "us-east", Epoch: 77}, old)
	if len(store.applied) != 1 || store.applied[0].Debits[0].At != 0 {
		t.Errorf("an older reconciler's retry entry applied as %+v, want as of now (At 0)", store.applied)
	}
}
