// Package lease holds the tokens an instance took from shared buckets in
// batches and has not handed out yet, and serves a check's items from them
// (Serve, EndBatches): the engine's token lease stage.
package lease

import (
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"
)

// TTL bounds how long leased tokens are handed out: a lease unused by
// then is dropped (the shared bucket refills meanwhile), so a lease never
// admits what the limit would not have admitted recently.
const TTL = time.Second

// DefaultMaxKeys bounds the keys holding a lease unless New says otherwise.
const DefaultMaxKeys = 100_000

const leaseShards = 32

// Leases holds the tokens this instance took from shared buckets in
// batches and has not handed out yet. It is bounded: expired leases are
// swept (every TTL, by the checks of their shard), and past its size a
// key without a lease gets none (Take says so and the check goes to the
// store with its own cost), so memory never grows with the keys seen.
// Safe for concurrent use.
type Leases struct {
	seed     maphash.Seed
	start    time.Time
	perShard int
	full     atomic.Uint64
	shards   [leaseShards]leaseShard
}

type bucketKey struct{ rule, key string }

type leaseShard struct {
	mu        sync.Mutex
	m         map[bucketKey]*lease
	nextSweep int64
}

type lease struct {
	tokens  float64
	expires int64 // monotonic ns since start
	// fetching is open while one check takes the next batch; the others
	// of the key wait for it instead of asking the store themselves.
	fetching chan struct{}
}

// New makes an empty set of leases for at most about maxKeys keys (<= 0:
// DefaultMaxKeys).
func New(maxKeys int) *Leases {
	if maxKeys <= 0 {
		maxKeys = DefaultMaxKeys
	}
	l := &Leases{seed: maphash.MakeSeed(), start: time.Now(), perShard: (maxKeys + leaseShards - 1) / leaseShards}
	for i := range l.shards {
		l.shards[i].m = make(map[bucketKey]*lease)
	}
	return l
}

func (l *Leases) shard(key string) *leaseShard {
	return &l.shards[maphash.String(l.seed, key)%leaseShards]
}

// Take hands out cost from the lease of (rule, key), if it holds enough.
// Otherwise, when a batch is being taken, it returns a channel closed when
// that is done; when none is, the caller becomes the one to take it (fetch
// true) and must call Fetched. When the key has no lease and there is no
// room for one, it returns neither (ok, wait and fetch all false): the
// caller decides without a lease.
func (l *Leases) Take(rule, key string, cost float64) (left float64, ok bool, wait <-chan struct{}, fetch bool) {
	sh := l.shard(key)
	id := bucketKey{rule, key}
	now := int64(time.Since(l.start))
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if now >= sh.nextSweep {
		sh.sweep(now)
	}
	ls := sh.m[id]
	if ls == nil {
		if len(sh.m) >= l.perShard {
			l.full.Add(1)
			return 0, false, nil, false
		}
		ls = &lease{}
		sh.m[id] = ls
	}
	if now >= ls.expires {
		ls.tokens = 0
	}
	if ls.tokens >= cost {
		ls.tokens -= cost
		return ls.tokens, true, nil, false
	}
	if ls.fetching != nil {
		return 0, false, ls.fetching, false
	}
	ls.fetching = make(chan struct{})
	return 0, false, nil, true
}

// Fetched ends the batch taken by the caller that Take chose, adding the
// tokens it leaves over, and wakes the checks waiting for it.
func (l *Leases) Fetched(rule, key string, tokens float64) {
	sh := l.shard(key)
	id := bucketKey{rule, key}
	now := int64(time.Since(l.start))
	sh.mu.Lock()
	defer sh.mu.Unlock()
	ls := sh.m[id]
	if ls == nil {
		return
	}
	if ch := ls.fetching; ch != nil {
		close(ch)
		ls.fetching = nil
	}
	if tokens > 0 {
		if now >= ls.expires {
			ls.tokens = 0
		}
		ls.tokens += tokens
		ls.expires = now + int64(TTL)
	} else if ls.tokens <= 0 || now >= ls.expires {
		delete(sh.m, id)
	}
}

// sweep drops the shard's expired leases that no check is refilling.
func (sh *leaseShard) sweep(now int64) {
	for id, ls := range sh.m {
		if now >= ls.expires && ls.fetching == nil {
			delete(sh.m, id)
		}
	}
	sh.nextSweep = now + int64(TTL)
}

// Len is the number of keys holding a lease (or taking one), expired ones
// not yet swept included.
func (l *Leases) Len() int {
	n := 0
	for i := range l.shards {
		sh := &l.shards[i]
		sh.mu.Lock()
		n += len(sh.m)
		sh.mu.Unlock()
	}
	return n
}

// Full is the number of checks Take turned away since New because there
// was no room for another lease.
func (l *Leases) Full() uint64 { return l.full.Load() }

// MaxKeys is the most keys holding a lease.
func (l *Leases) MaxKeys() int { return l.perShard * leaseShards }

// LeftOver is what a lease still holds.
type LeftOver struct {
	Rule, Key string
	Tokens    float64
}

// Drain empties every lease and returns the unexpired leftovers, to give
// back to the shared buckets at shutdown.
func (l *Leases) Drain() []LeftOver {
	now := int64(time.Since(l.start))
	var out []LeftOver
	for i := range l.shards {
		sh := &l.shards[i]
		sh.mu.Lock()
		for id, ls := range sh.m {
			if now < ls.expires && ls.tokens > 0 {
				out = append(out, LeftOver{Rule: id.rule, Key: id.key, Tokens: ls.tokens})
			}
			ls.tokens = 0
			if ls.fetching == nil {
				delete(sh.m, id)
			}
		}
		sh.mu.Unlock()
	}
	return out
}

// GiveBack returns cost to the lease of (rule, key), when a check that took
// it was refused by another rule. Tokens of a lease that expired meanwhile
// are not given back: the shared bucket has refilled since.
func (l *Leases) GiveBack(rule, key string, cost float64) {
	sh := l.shard(key)
	id := bucketKey{rule, key}
	now := int64(time.Since(l.start))
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if ls := sh.m[id]; ls != nil && now < ls.expires {
		ls.tokens += cost
	}
}
