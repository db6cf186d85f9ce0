package gossip_test

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/limiterd/limiterd/pkg/gossip"
	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// TestMergerKeepsEveryEntry: flushes of several instances merged into one
// message per partition keep every entry, each in its key's partition,
// with its last admission never read earlier than it was nor more than a
// millisecond later; a partition skipped takes nothing.
func TestMergerKeepsEveryEntry(t *testing.T) {
	const n = 8
	m, err := gossip.NewMerger("us-east", n)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	type entry struct {
		cost float64
		at   int64
	}
	want := map[string][]entry{}
	base := int64(1_700_000_000_000_000)
	for f := range 20 {
		flushed := base + int64(rng.IntN(50_000))
		b := &gossipv1.SpendBatch{Region: "us-east", Instance: fmt.Sprintf("gw-%d", f%4), Sequence: uint64(f + 1), Parts: 1,
			FirstAdmittedUnixMicros: flushed - 900_000, FlushedUnixMicros: flushed}
		for range 30 {
			s := &gossipv1.Spend{RuleId: "quota", Key: fmt.Sprintf("k%d", rng.IntN(100)), Cost: float64(1 + rng.IntN(5)),
				LastAdmittedMsBeforeFlush: uint32(rng.IntN(900))}
			b.Spends = append(b.Spends, s)
			if gossip.PartitionOf(s.GetKey(), n) != 3 {
				want[s.GetKey()] = append(want[s.GetKey()], entry{s.GetCost(), gossip.LastAdmitted(s, flushed)})
			}
		}
		if !m.Add(b, func(p int) bool { return p == 3 }) {
			t.Fatalf("flush %d refused", f)
		}
	}
	out, err := m.Messages(gossip.RelayName("us-east", 42), 20)
	if err != nil {
		t.Fatal(err)
	}
	if out[3].Data != nil {
		t.Error("partition 3, skipped, has a message")
	}
	got := map[string][]entry{}
	for p, part := range out {
		if part.Data == nil {
			continue
		}
		b, err := gossip.Decode(part.Data, gossip.DefaultMaxMessageBytes)
		if err != nil {
			t.Fatalf("partition %d: %v", p, err)
		}
		if b.GetInstance() != "relay-us-east-42" || b.GetSequence() != 20 || b.GetFirstAdmittedUnixMicros() > base {
			t.Errorf("partition %d: header %v", p, b)
		}
		keys := map[string]bool{}
		for _, s := range b.GetSpends() {
			keys[s.GetKey()] = true
			if gossip.PartitionOf(s.GetKey(), n) != p {
				t.Errorf("key %s in partition %d", s.GetKey(), p)
			}
			got[s.GetKey()] = append(got[s.GetKey()], entry{s.GetCost(), gossip.LastAdmitted(s, b.GetFlushedUnixMicros())})
		}
		if part.Clients != len(keys) || part.Entries != len(b.GetSpends()) {
			t.Errorf("partition %d: %d clients and %d entries counted, %d keys and %d entries in it", p, part.Clients, part.Entries, len(keys), len(b.GetSpends()))
		}
	}
	if len(got) != len(want) {
		t.Fatalf("%d keys merged, want %d", len(got), len(want))
	}
	for k, w := range want {
		g := got[k]
		if len(g) != len(w) {
			t.Fatalf("key %s: %d entries, want %d", k, len(g), len(w))
		}
		for i := range w {
			if g[i].cost != w[i].cost || g[i].at < w[i].at || g[i].at >= w[i].at+1000 {
				t.Errorf("key %s entry %d: %+v, want %+v (admitted up to 1 ms later)", k, i, g[i], w[i])
			}
		}
	}
}

// TestMergerBounds: a flush that would take a partition past
// MergedPartBytes is refused once the merger holds one, and taken alone.
func TestMergerBounds(t *testing.T) {
	m, err := gossip.NewMerger("us-east", 1)
	if err != nil {
		t.Fatal(err)
	}
	flush := func(seq uint64, entries int) *gossipv1.SpendBatch {
		b := &gossipv1.SpendBatch{Region: "us-east", Instance: "gw", Sequence: seq, Parts: 1, FirstAdmittedUnixMicros: 1, FlushedUnixMicros: 2}
		for i := range entries {
			b.Spends = append(b.Spends, &gossipv1.Spend{RuleId: "quota", Key: fmt.Sprintf("key-%06d", i), Cost: 1})
		}
		return b
	}
	big := flush(1, 2*gossip.MergedPartBytes/20)
	if !m.Add(flush(1, 10), nil) {
		t.Fatal("a small flush refused")
	}
	if m.Add(big, nil) {
		t.Fatal("a flush past the bound taken beside another")
	}
	m.Reset()
	if !m.Add(big, nil) || m.Len() != 1 {
		t.Fatal("a large flush refused alone")
	}
	if _, err := gossip.NewMerger("us-east", gossip.MaxPartitions+1); err == nil {
		t.Error("a merger of too many partitions made")
	}
}
