package apply

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// On Redis, another region's spend of a key with an override is debited
// up to the override's bound, not the rule's: quota allows 100 an hour, at
// most 200 counted; tenant-acme's override allows 5000, so its debit of
// 300 counts whole, while b's is cut to the rule's 200.
func TestApplyOverrideOnRedis(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	store, err := redisstore.New(context.Background(), redisstore.Options{Addrs: c.Addrs(), Timeout: 2 * time.Second}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	js := &fakeJS{}
	a, _, _ := newTestApplier(t, store, js)
	msg := &fakeMsg{data: spendBatchAt(t, "us-east", time.Now(), &gossipv1.Spend{RuleId: "quota", Key: "tenant-acme", Cost: 300},
		&gossipv1.Spend{RuleId: "quota", Key: "b", Cost: 300}), seq: 1, delivered: 1}
	applyOne(a, Source{Name: "us-east", Epoch: 1, Retry: js}, msg)
	if msg.settled != "ack" {
		t.Fatalf("message settled %q, want ack", msg.settled)
	}
	set := a.rules.Current()
	for _, tt := range []struct {
		key  string
		want float64 // remaining after the debit and one more request
	}{
		{"tenant-acme", 5000 - 300 - 1},
		{"b", 0},
	} {
		lim := set.Get("quota").BucketFor(tt.key)
		d, err := store.Take(context.Background(), bucket.Request{Rule: "quota", Key: tt.key, Limit: lim, Cost: 1})
		if err != nil {
			t.Fatal(err)
		}
		if d.Remaining != tt.want {
			t.Errorf("%s: %v remaining after the debit, want %v (%+v)", tt.key, d.Remaining, tt.want, d)
		}
	}
}
