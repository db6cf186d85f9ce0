package gossip

import (
	"fmt"
	"strconv"

	"google.golang.org/protobuf/proto"

	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// A region's relay merges the flushes of every limiterd that it reads in
// one go into one message per partition: the messages between regions
// then number at most one per partition per relay round, whatever the
// count of limiterd and their ticks. A merged message keeps every entry
// as it came (the applying region adds up one key's entries, in order),
// each with its last admission read again against the merged message's
// flush instant.

// MergedPartBytes bounds the entries one partition's merged message takes
// from the flushes after its first: about 3,000 clients, a batch the
// applying region finishes in some ms. A first flush larger goes alone.
const MergedPartBytes = 32 << 10

// Merger merges flushes of one region into one message per partition
// (PartitionOf). Its zero value is not usable: make it with NewMerger. It
// is not safe for concurrent use.
type Merger struct {
	region string
	n      int
	parts  [][]merged
	bytes  []int
	// count is the entries in every partition, first and flushed the
	// earliest first admission and the latest flush instant of the
	// flushes added; flushes counts them.
	count          int
	first, flushed int64
	flushes        int
}

// merged is one entry as added: at is its last admission (µs), or 0 for an
// entry whose own offset is out of bounds (kept as it came, to be refused
// where it is applied).
type merged struct {
	s  *gossipv1.Spend
	at int64
}

// NewMerger returns a Merger of region's flushes into n partitions.
func NewMerger(region string, n int) (*Merger, error) {
	if n < 1 || n > MaxPartitions {
		return nil, fmt.Errorf("partitions: must be 1 to %d, got %d", MaxPartitions, n)
	}
	return &Merger{region: region, n: n, parts: make([][]merged, n), bytes: make([]int, n)}, nil
}

// Len is the count of flushes added since the last Reset.
func (m *Merger) Len() int { return m.flushes }

// Reset empties the merger.
func (m *Merger) Reset() {
	for p := range m.parts {
		m.parts[p] = m.parts[p][:0]
		m.bytes[p] = 0
	}
	m.count, m.first, m.flushed, m.flushes = 0, 0, 0, 0
}

// Add adds the entries of flush b (its header validated) of the
// partitions skip does not name (skip nil: every partition), unless the
// merger holds flushes already and b would take a partition past
// MergedPartBytes or the merged entries past MaxSpendsPerBatch: then it
// adds nothing and returns false.
func (m *Merger) Add(b *gossipv1.SpendBatch, skip func(p int) bool) bool {
	if b.GetRegion() != m.region {
		// The caller checks it; a stray batch is never merged.
		return m.flushes == 0
	}
	type entry struct {
		p int
		e merged
	}
	var add []entry
	size := make([]int, m.n)
	for _, s := range b.GetSpends() {
		p := PartitionOf(s.GetKey(), m.n)
		if skip != nil && skip(p) {
			continue
		}
		e := merged{s: s}
		if int64(s.GetLastAdmittedMsBeforeFlush()) <= MaxAdmittedBeforeFlush.Milliseconds() {
			e.at = LastAdmitted(s, b.GetFlushedUnixMicros())
		}
		add = append(add, entry{p, e})
		size[p] += proto.Size(s) + 4
	}
	if m.flushes > 0 {
		if m.count+len(add) > MaxSpendsPerBatch {
			return false
		}
		for p, n := range size {
			if m.bytes[p]+n > MergedPartBytes {
				return false
			}
		}
	}
	for _, a := range add {
		m.parts[a.p] = append(m.parts[a.p], a.e)
	}
	for p, n := range size {
		m.bytes[p] += n
	}
	m.count += len(add)
	if m.flushes == 0 || b.GetFirstAdmittedUnixMicros() < m.first {
		m.first = b.GetFirstAdmittedUnixMicros()
	}
	m.flushed = max(m.flushed, b.GetFlushedUnixMicros())
	m.flushes++
	return true
}

// Part is one partition's merged message: its encoding, its entries, and
// its clients, the distinct keys in it (one debit script each where it is
// applied).
type Part struct {
	Data             []byte
	Entries, Clients int
}

// Messages returns the merged message of each partition that has entries
// (out[p].Data nil: none), named by instance and seq: the relay's own name
// for them, a flush of one part. Each entry's offset is its last
// admission's distance from the latest flush instant, rounded down to the
// millisecond, so an entry is never read as admitted earlier than it was.
func (m *Merger) Messages(instance string, seq uint64) ([]Part, error) {
	out := make([]Part, m.n)
	keys := make(map[string]struct{})
	for p, entries := range m.parts {
		if len(entries) == 0 {
			continue
		}
		clear(keys)
		b := &gossipv1.SpendBatch{Region: m.region, Instance: instance, Sequence: seq, Part: 0, Parts: 1,
			FirstAdmittedUnixMicros: m.first, FlushedUnixMicros: m.flushed, Spends: make([]*gossipv1.Spend, len(entries))}
		for i, e := range entries {
			s := e.s
			keys[s.GetKey()] = struct{}{}
			if e.at != 0 {
				ms := min(max(m.flushed-e.at, 0)/1000, MaxAdmittedBeforeFlush.Milliseconds())
				if uint32(ms) != s.GetLastAdmittedMsBeforeFlush() {
					s = proto.CloneOf(s)
					s.LastAdmittedMsBeforeFlush = uint32(ms)
				}
			}
			b.Spends[i] = s
		}
		data, err := proto.Marshal(b)
		if err != nil {
			return nil, err
		}
		out[p] = Part{Data: data, Entries: len(entries), Clients: len(keys)}
	}
	return out, nil
}

// RelayName is the instance name a region's relay gives its merged
// messages read from its local stream of epoch (µs): unique across
// regions and local streams, as limiterd's instance names are.
func RelayName(region string, epoch int64) string {
	return "relay-" + region + "-" + strconv.FormatInt(epoch, 10)
}
