package bucket

import (
	"context"
	"hash/maphash"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

const (
	memoryShards = 64
	// DefaultMaxBytes bounds a Memory's buckets unless WithMaxBytes says
	// otherwise: about 1.4M token buckets of 20-byte keys.
	DefaultMaxBytes = 256 << 20
	// bucketOverhead is the memory of one bucket besides its key, rule id
	// and log: the map entry, the entry and its state (measured: 189 B per
	// token bucket of a 21-byte key and a 4-byte rule id on go1.26, amd64).
	bucketOverhead = 164
	// MinMaxBytes is the smallest cap: every shard holds at least the
	// largest bucket (a full log of MaxLogCapacity under a long key).
	MinMaxBytes = 1 << 20
	// evictionSample is how many buckets are looked at to choose the one
	// a new bucket replaces in a full shard.
	evictionSample = 8
	// memorySweepInterval is how often a shard drops buckets that are full
	// again or windows that are clear; between sweeps they read as fresh.
	memorySweepInterval = 10 * time.Second
)

// Memory is a Store that keeps state in this process: the embedded default
// of a single limiterd and the local fallback when the shared store is down.
// Its memory is bounded twice: by the buckets active within their expiry
// (expired ones are swept), and by a cap on the memory of the buckets held
// (WithMaxBytes; a bucket counts its overhead, key, rule id and log). At
// the cap, a new bucket replaces the one closest to its expiry among a few
// sampled in its shard: the bucket nearest to full again, whose loss
// admits the least. It is safe for concurrent use; the
// zero value is not usable: call NewMemory.
type Memory struct {
	now      func() time.Time // nil: the monotonic clock below
	start    time.Time
	wallUs   int64
	seed     maphash.Seed
	perShard int64 // bytes
	evicted  atomic.Uint64
	shards   [memoryShards]memoryShard
}

type memoryShard struct {
	mu      sync.Mutex
	buckets map[bucketID]*memoryEntry
	leases  map[bucketID]*Leases // of concurrency rules, made on first use
	// settled are the settlements settled, by key and id (Settle), made
	// on first use.
	settled map[settleID]settleRecord
	// bytes counts the buckets, leaseBytes the lease sets: each has the
	// cap to itself, so leases, which are never evicted, never push rate
	// buckets out.
	bytes, leaseBytes int64
	nextSweep         int64
}

type bucketID struct{ rule, key string }

type memoryEntry struct {
	st      State
	expires int64
	size    int64 // bytes counted in the shard
}

// sizeOf is the memory counted for the bucket of id holding st.
func sizeOf(id bucketID, st *State) int64 {
	return bucketOverhead + int64(len(id.rule)+len(id.key)+8*cap(st.log))
}

// put stores e as id's bucket, or records its new size, and makes room
// for it at the cap.
func (m *Memory) put(sh *memoryShard, id bucketID, e *memoryEntry, now int64) {
	sh.store(id, e)
	m.makeRoom(sh, now, id)
}

// store is put without making room: for a call writing several buckets,
// which makes room once, keeping them all.
func (sh *memoryShard) store(id bucketID, e *memoryEntry) {
	size := sizeOf(id, &e.st)
	if sh.buckets[id] != e {
		sh.buckets[id] = e
		e.size = 0
	}
	sh.bytes += size - e.size
	e.size = size
}

// drop removes id's bucket.
func (sh *memoryShard) drop(id bucketID, e *memoryEntry) {
	sh.bytes -= e.size
	delete(sh.buckets, id)
}

// MemoryOption configures a Memory.
type MemoryOption func(*Memory)

// WithClock makes a Memory read time from now instead of time.Now.
func WithClock(now func() time.Time) MemoryOption {
	return func(m *Memory) { m.now = now }
}

// WithMaxBytes bounds the memory of a Memory's buckets to about n bytes
// (as counted by the Memory: see Bytes), at least MinMaxBytes; n <= 0
// means DefaultMaxBytes.
func WithMaxBytes(n int64) MemoryOption {
	return func(m *Memory) {
		if n <= 0 {
			n = DefaultMaxBytes
		}
		m.perShard = (max(n, MinMaxBytes) + memoryShards - 1) / memoryShards
	}
}

// NewMemory returns an empty in-process store.
func NewMemory(opts ...MemoryOption) *Memory {
	start := time.Now()
	m := &Memory{start: start, wallUs: start.UnixMicro(), seed: maphash.MakeSeed()}
	WithMaxBytes(DefaultMaxBytes)(m)
	for _, o := range opts {
		o(m)
	}
	for i := range m.shards {
		m.shards[i].buckets = make(map[bucketID]*memoryEntry)
	}
	return m
}

var _ Backend = (*Memory)(nil)

// Take decides req against the bucket of (req.Rule, req.Key). It never
// returns an error.
func (m *Memory) Take(_ context.Context, req Request) (Decision, error) {
	if req.MaxWait != 0 {
		if err := req.Limit.ValidateWait(req.MaxWait); err != nil {
			return Decision{}, err
		}
	}
	return m.take(m.nowMicros(), req), nil
}

// nowMicros reads the monotonic clock only, which costs half of time.Now
// and never steps back when the wall clock is set.
func (m *Memory) nowMicros() int64 {
	if m.now != nil {
		return m.now().UnixMicro()
	}
	return m.wallUs + int64(time.Since(m.start)/time.Microsecond)
}

func (m *Memory) shard(key string) *memoryShard {
	return &m.shards[maphash.String(m.seed, key)%memoryShards]
}

// decide is req decided on st at now: paced (Reserve) or keeping its Keep.
func (l *Limit) decide(st *State, now int64, req Request) Decision {
	if req.MaxWait > 0 {
		return l.Reserve(st, now, req.Cost, req.MaxWait)
	}
	return l.TakeKeeping(st, now, req.Cost, req.Keep)
}

func (m *Memory) take(now int64, req Request) Decision {
	id := bucketID{req.Rule, req.Key}
	sh := m.shard(req.Key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if now >= sh.nextSweep {
		sh.sweep(now)
	}
	e := sh.buckets[id]
	if e != nil && e.expires <= now {
		e.st = State{log: e.st.log[:0]}
	}
	if e == nil {
		var fresh State
		d := req.Limit.decide(&fresh, now, req)
		if d.Allowed {
			m.put(sh, id, &memoryEntry{st: fresh, expires: req.Limit.ExpiresAt(&fresh)}, now)
		}
		return d
	}
	d := req.Limit.decide(&e.st, now, req)
	if d.Allowed {
		e.expires = req.Limit.ExpiresAt(&e.st)
		m.put(sh, id, e, now)
	}
	return d
}

// Reset puts the buckets of reqs back to full. It never returns an error.
func (m *Memory) Reset(_ context.Context, reqs []Request) error {
	for _, r := range reqs {
		id := bucketID{r.Rule, r.Key}
		sh := m.shard(r.Key)
		sh.mu.Lock()
		if e, ok := sh.buckets[id]; ok {
			sh.drop(id, e)
		}
		sh.mu.Unlock()
	}
	return nil
}

// TakeAll decides reqs all or nothing. It never returns an error.
func (m *Memory) TakeAll(_ context.Context, reqs []Request) ([]Decision, error) {
	maxWait := time.Duration(0)
	for i, r := range reqs {
		if r.MaxWait != 0 {
			if err := r.Limit.ValidateWait(r.MaxWait); err != nil {
				return nil, err
			}
		}
		if i == 0 || r.MaxWait < maxWait {
			maxWait = r.MaxWait
		}
	}
	now := m.nowMicros()
	// Lock every shard involved, in index order, so that concurrent
	// TakeAlls cannot deadlock.
	idx := make([]int, len(reqs))
	var locked [memoryShards]bool
	for i, r := range reqs {
		idx[i] = int(maphash.String(m.seed, r.Key) % memoryShards)
		locked[idx[i]] = true
	}
	for i := range m.shards {
		if locked[i] {
			sh := &m.shards[i]
			sh.mu.Lock()
			defer sh.mu.Unlock()
			if now >= sh.nextSweep {
				sh.sweep(now)
			}
		}
	}
	out := make([]Decision, len(reqs))
	next := make([]State, len(reqs))
	all := true
	for i, r := range reqs {
		if e := m.shards[idx[i]].buckets[bucketID{r.Rule, r.Key}]; e != nil && e.expires > now {
			// Kept whatever the outcome, as a single Take keeps it.
			r.Limit.clampDebt(&e.st, now)
			next[i] = e.st
			// Decide on a copy: the log is changed in place.
			next[i].log = append([]int64(nil), e.st.log...)
		}
		if maxWait == 0 {
			out[i] = r.Limit.TakeKeeping(&next[i], now, r.Cost, r.Keep)
			all = all && out[i].Allowed
		}
	}
	if maxWait > 0 {
		ls, sts, costs := make([]*Limit, len(reqs)), make([]*State, len(reqs)), make([]float64, len(reqs))
		for i := range reqs {
			ls[i], sts[i], costs[i] = &reqs[i].Limit, &next[i], reqs[i].Cost
		}
		all = reserveAll(ls, sts, now, costs, float64(maxWait), out)
	}
	if !all {
		return out, nil
	}
	for i, r := range reqs {
		sh := &m.shards[idx[i]]
		id := bucketID{r.Rule, r.Key}
		e := sh.buckets[id]
		if e == nil {
			e = &memoryEntry{}
		}
		e.st, e.expires = next[i], r.Limit.ExpiresAt(&next[i])
		sh.store(id, e)
	}
	// Room is made once every bucket is written, so that writing one never
	// evicts another of the same call.
	var keep []bucketID // made only for a shard past its cap
	for i := range m.shards {
		if !locked[i] || m.shards[i].bytes <= m.perShard {
			continue
		}
		if keep == nil {
			keep = make([]bucketID, len(reqs))
			for j, r := range reqs {
				keep[j] = bucketID{r.Rule, r.Key}
			}
		}
		m.makeRoom(&m.shards[i], now, keep...)
	}
	return out, nil
}

func (sh *memoryShard) sweep(now int64) {
	for id, e := range sh.buckets {
		if e.expires <= now {
			sh.drop(id, e)
		}
	}
	sh.sweepLeases(now)
	sh.sweepSettled(now)
	sh.nextSweep = now + memorySweepInterval.Microseconds()
}

// makeRoom brings the locked shard sh back under its cap after keep's
// buckets grew or arrived: it drops expired buckets when those sampled
// are, else the sampled bucket closest to its expiry (counted in Evicted),
// never one of keep.
func (m *Memory) makeRoom(sh *memoryShard, now int64, keep ...bucketID) {
	for sh.bytes > m.perShard && len(sh.buckets) > len(keep) {
		var victim bucketID
		var ve *memoryEntry
		n := 0
		// A map's iteration starts at a random place: the first few
		// entries are a random sample.
		for id, e := range sh.buckets {
			if slices.Contains(keep, id) {
				continue
			}
			if e.expires <= now {
				victim, ve = id, e
				break
			}
			if ve == nil || e.expires < ve.expires {
				victim, ve = id, e
			}
			if n++; n == evictionSample {
				break
			}
		}
		if ve == nil {
			return // every bucket sampled is one to keep
		}
		if ve.expires > now {
			m.evicted.Add(1)
		}
		sh.drop(victim, ve)
	}
}

// Evicted is the number of unexpired buckets dropped to make room for new
// ones since the Memory was made: each such key's next check starts from
// a fresh bucket.
func (m *Memory) Evicted() uint64 { return m.evicted.Load() }

// MaxBytes is the most memory the Memory's buckets may take, as Bytes
// counts it.
func (m *Memory) MaxBytes() int64 { return m.perShard * memoryShards }

// Bytes is the memory of the buckets held, as counted for the cap: each
// bucket's overhead, key, rule id and log.
func (m *Memory) Bytes() int64 {
	var n int64
	for i := range m.shards {
		sh := &m.shards[i]
		sh.mu.Lock()
		n += sh.bytes + sh.leaseBytes
		sh.mu.Unlock()
	}
	return n
}

// Len returns the number of buckets held, expired ones not yet swept included.
func (m *Memory) Len() int {
	n := 0
	for i := range m.shards {
		sh := &m.shards[i]
		sh.mu.Lock()
		n += len(sh.buckets)
		sh.mu.Unlock()
	}
	return n
}

// Unreserve gives back the spend of a paced request that will not be sent
// (see Unreserver); it never returns an error.
func (m *Memory) Unreserve(_ context.Context, req Request, reservation int64) (bool, error) {
	if req.Limit.Algorithm != TokenBucket && req.Limit.Algorithm != GCRA {
		return false, nil
	}
	now := m.nowMicros()
	sh := m.shard(req.Key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	id := bucketID{req.Rule, req.Key}
	e := sh.buckets[id]
	if e == nil || e.expires <= now || !req.Limit.Unreserve(&e.st, now, reservation, req.Cost) {
		return false, nil
	}
	e.expires = req.Limit.ExpiresAt(&e.st)
	m.put(sh, id, e, now)
	return true, nil
}
