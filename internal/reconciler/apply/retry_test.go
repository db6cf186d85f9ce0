package apply

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/redisstore"
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
