package limiterd

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// TestLagOfReaders: the reconcile lag of each source is read from the
// ephemeral readers of its partitions: per partition the reader furthest
// on (a reader left by a reconciler gone falls behind), summed over the
// partitions; the durable consumers of an earlier release and consumers of
// other subjects are not counted.
func TestLagOfReaders(t *testing.T) {
	now := time.Now()
	reader := func(name, filter string, pending uint64, last time.Time) *jetstream.ConsumerInfo {
		return &jetstream.ConsumerInfo{Name: name, Config: jetstream.ConsumerConfig{Name: name, FilterSubject: filter},
			NumPending: pending, Delivered: jetstream.SequenceInfo{Last: &last}}
	}
	durable := reader("apply-eu-west-from-us-east-p0", "limiter.relay.us-east.0", 900, now)
	durable.Config.Durable = durable.Name
	lags := lagOf([]*jetstream.ConsumerInfo{
		reader("apply-eu-west-from-us-east-p0-a-1", "limiter.relay.us-east.0", 7, now.Add(-2*time.Second)),
		reader("apply-eu-west-from-us-east-p0-b-4", "limiter.relay.us-east.0", 3, now.Add(-time.Second)),
		reader("apply-eu-west-from-us-east-p1-a-2", "limiter.relay.us-east.1", 5, now.Add(-3*time.Second)),
		reader("apply-eu-west-from-ap-south-p0-a-3", "limiter.relay.ap-south.0", 0, now.Add(-time.Minute)),
		durable,
		reader("other", "limiter.retry.eu-west.us-east.>", 50, now),
	})
	if len(lags) != 2 {
		t.Fatalf("lags %+v, want ap-south and us-east", lags)
	}
	if l := lags[1]; l.Source != "us-east" || l.Pending != 8 || !l.LastApplied.Equal(now.Add(-time.Second)) {
		t.Errorf("us-east: %+v, want 8 pending (3 + 5), last applied 1s ago", l)
	}
	if l := lags[0]; l.Source != "ap-south" || l.Pending != 0 {
		t.Errorf("ap-south: %+v, want nothing pending", l)
	}
}
