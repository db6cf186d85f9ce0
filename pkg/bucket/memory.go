package bucket

import (
	"context"
	"hash/maphash"
	"sync"
	"time"
)

const (
	memoryShards = 64
	// memorySweepInterval is how often a shard drops buckets that are full
	// again or windows that are clear; between sweeps they read as fresh.
	memorySweepInterval = 10 * time.Second
)

// Memory is a Store that keeps state in this process: the embedded default
// of a single limiterd and the local fallback when the shared store is down.
// Its memory is bounded by the buckets active within their expiry. It is
// safe for concurrent use; the zero value is not usable: call NewMemory.
type Memory struct {
	now    func() time.Time // nil: the monotonic clock below
	start  time.Time
	wallUs int64
	seed   maphash.Seed
	shards [memoryShards]memoryShard
}

type memoryShard struct {
	mu        sync.Mutex
	buckets   map[bucketID]*memoryEntry
	nextSweep int64
}

type bucketID struct{ rule, key string }

type memoryEntry struct {
	st      State
	expires int64
}

// MemoryOption configures a Memory.
type MemoryOption func(*Memory)

// WithClock makes a Memory read time from now instead of time.Now.
func WithClock(now func() time.Time) MemoryOption {
	return func(m *Memory) { m.now = now }
}

// NewMemory returns an empty in-process store.
func NewMemory(opts ...MemoryOption) *Memory {
	start := time.Now()
	m := &Memory{start: start, wallUs: start.UnixMicro(), seed: maphash.MakeSeed()}
	for _, o := range opts {
		o(m)
	}
	for i := range m.shards {
		m.shards[i].buckets = make(map[bucketID]*memoryEntry)
	}
	return m
}

// Take decides req against the bucket of (req.Rule, req.Key). It never
// returns an error.
func (m *Memory) Take(_ context.Context, req Request) (Decision, error) {
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
		d := req.Limit.Take(&fresh, now, req.Cost)
		if d.Allowed {
			sh.buckets[id] = &memoryEntry{st: fresh, expires: req.Limit.ExpiresAt(&fresh)}
		}
		return d
	}
	d := req.Limit.Take(&e.st, now, req.Cost)
	if d.Allowed {
		e.expires = req.Limit.ExpiresAt(&e.st)
	}
	return d
}

// TakeAll decides reqs all or nothing. It never returns an error.
func (m *Memory) TakeAll(_ context.Context, reqs []Request) ([]Decision, error) {
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
			m.shards[i].mu.Lock()
			defer m.shards[i].mu.Unlock()
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
		out[i] = r.Limit.Take(&next[i], now, r.Cost)
		all = all && out[i].Allowed
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
			sh.buckets[id] = e
		}
		e.st, e.expires = next[i], r.Limit.ExpiresAt(&next[i])
	}
	return out, nil
}

func (sh *memoryShard) sweep(now int64) {
	for id, e := range sh.buckets {
		if e.expires <= now {
			delete(sh.buckets, id)
		}
	}
	sh.nextSweep = now + memorySweepInterval.Microseconds()
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
