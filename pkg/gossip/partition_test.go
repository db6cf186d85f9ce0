package gossip_test

import (
	"errors"
	"fmt"
	"math"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/limiterd/limiterd/pkg/gossip"
	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// TestSplitPartitions: every entry, an invalid one included, lands in its
// key's partition, in order, under the flush's header; empty partitions
// make no message.
func TestSplitPartitions(t *testing.T) {
	const n = 8
	in := &gossipv1.SpendBatch{Region: "us-east", Instance: "i", Sequence: 7, Part: 1, Parts: 2,
		FirstAdmittedUnixMicros: 1, FlushedUnixMicros: 2}
	for i := range 50 {
		in.Spends = append(in.Spends, &gossipv1.Spend{RuleId: "r", Key: fmt.Sprintf("k%d", i%20), Cost: float64(i + 1)})
	}
	in.Spends = append(in.Spends, &gossipv1.Spend{RuleId: "r", Key: "bad", Cost: math.Inf(1)})
	data, err := proto.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	_, parts, err := gossip.SplitPartitions(data, n, gossip.DefaultMaxMessageBytes)
	if err != nil {
		t.Fatal(err)
	}
	var got []*gossipv1.Spend
	byKey := map[string][]float64{}
	for p, d := range parts {
		if d == nil {
			continue
		}
		var b gossipv1.SpendBatch
		if err := proto.Unmarshal(d, &b); err != nil {
			t.Fatal(err)
		}
		if b.Region != in.Region || b.Instance != in.Instance || b.Sequence != in.Sequence || b.Part != in.Part || b.Parts != in.Parts ||
			b.FirstAdmittedUnixMicros != in.FirstAdmittedUnixMicros || b.FlushedUnixMicros != in.FlushedUnixMicros {
			t.Errorf("partition %d header %v, want the flush's", p, &b)
		}
		if len(b.Spends) == 0 {
			t.Errorf("partition %d: a message without entries", p)
		}
		for _, s := range b.Spends {
			if q := gossip.PartitionOf(s.Key, n); q != p {
				t.Errorf("key %s in partition %d, want %d", s.Key, p, q)
			}
			byKey[s.Key] = append(byKey[s.Key], s.Cost)
			got = append(got, s)
		}
	}
	if len(got) != len(in.Spends) {
		t.Fatalf("%d entries after the split, want %d", len(got), len(in.Spends))
	}
	for key, costs := range byKey {
		for i := 1; i < len(costs); i++ {
			if costs[i] <= costs[i-1] {
				t.Errorf("key %s: entries out of order: %v", key, costs)
			}
		}
	}
	if _, _, err := gossip.SplitPartitions([]byte("\xff\xff"), n, gossip.DefaultMaxMessageBytes); !errors.Is(err, gossip.ErrInvalidBatch) {
		t.Errorf("garbage: %v, want ErrInvalidBatch", err)
	}
	if _, _, err := gossip.SplitPartitions(data, gossip.MaxPartitions+1, gossip.DefaultMaxMessageBytes); err == nil {
		t.Error("more than MaxPartitions accepted")
	}
}
