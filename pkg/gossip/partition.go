package gossip

import (
	"fmt"
	"hash/fnv"
	"strconv"

	"google.golang.org/protobuf/proto"

	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// Partitions of a region's relayed spends.
//
// A region's reconcilers relay each limiterd flush to its spends stream
// split by client key into a fixed number of partitions, one subject each
// (PartitionSubject), so that the regions applying them read each
// partition with its own in-order consumer: the partitions apply in
// parallel, each in order, and every spend of one client, whatever its
// rule, stays in one partition and so in order. The split is the relay's,
// not limiterd's: limiterd needs no partition count, and a flush of any
// limiterd release is partitioned alike.
const (
	// MaxPartitions bounds the partitions of a region's spends.
	MaxPartitions = 32
)

// PartitionSubject is the subject of partition p of region's relayed
// spends: RelaySubjectPrefix + region + "." + p.
func PartitionSubject(region string, p int) string {
	return RelaySubjectPrefix + region + "." + strconv.Itoa(p)
}

// PartitionSubjects is the subject filter of every partition of region's
// relayed spends.
func PartitionSubjects(region string) string { return RelaySubjectPrefix + region + ".*" }

// PartitionOf is the partition of key among n (FNV-1a of the key, mod n).
func PartitionOf(key string, n int) int {
	h := fnv.New32a()
	h.Write([]byte(key))
	return int(h.Sum32() % uint32(n))
}

// SplitPartitions splits one encoded SpendBatch into n, by PartitionOf of
// each entry's key: out[p] is partition p's batch, with the header
// unchanged, or nil when no entry falls in it. Entries are kept as they
// are, invalid ones included (each applying region skips those), in
// order. The header is validated; b is the batch as decoded.
func SplitPartitions(data []byte, n, maxBytes int) (b *gossipv1.SpendBatch, out [][]byte, err error) {
	if n < 1 || n > MaxPartitions {
		return nil, nil, fmt.Errorf("partitions: must be 1 to %d, got %d", MaxPartitions, n)
	}
	if b, err = decodeHeader(data, maxBytes); err != nil {
		return nil, nil, err
	}
	parts := make([]*gossipv1.SpendBatch, n)
	for _, s := range b.GetSpends() {
		p := PartitionOf(s.GetKey(), n)
		if parts[p] == nil {
			parts[p] = &gossipv1.SpendBatch{Region: b.Region, Instance: b.Instance, Sequence: b.Sequence,
				Part: b.Part, Parts: b.Parts, FirstAdmittedUnixMicros: b.FirstAdmittedUnixMicros, FlushedUnixMicros: b.FlushedUnixMicros}
		}
		parts[p].Spends = append(parts[p].Spends, s)
	}
	out = make([][]byte, n)
	for p, part := range parts {
		if part == nil {
			continue
		}
		if out[p], err = proto.Marshal(part); err != nil {
			return nil, nil, err
		}
	}
	return b, out, nil
}
