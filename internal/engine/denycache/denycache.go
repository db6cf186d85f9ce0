// Package denycache remembers refusals until their retry time, so that a
// key flooding far over its limit costs the store one call per retry
// interval, not one per check. Remember reads what a check's decisions
// leave to remember.
package denycache

import (
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"
)

// Shards is the number of independently locked parts of a Cache.
const Shards = 64

// Cache remembers rejections: (rule, key) is denied until an instant,
// for any cost at least the one rejected. Until then a check is rejected
// here, without the store. It holds denials only, so it can never admit
// what the store would refuse: tokens only come back with time, and other
// instances and regions only spend them. It is bounded: past its size a
// random entry makes room (a forgotten denial costs one store call).
//
// Denials belong to a generation of the rules: a rule change starts a new
// one (reset), which forgets every denial, and a check that was decided
// under the old rules cannot put its denial in the new generation.
// Safe for concurrent use.
type Cache struct {
	gen      atomic.Uint64
	seed     maphash.Seed
	perShard int
	start    time.Time
	shards   [Shards]denyShard
}

type denyShard struct {
	mu sync.Mutex
	m  map[bucketKey]denial
}

type bucketKey struct{ rule, key string }

type denial struct {
	// until and reset are monotonic nanoseconds since the cache's start.
	until, reset int64
	cost         float64
	// probing: the denial expired and one check is asking the store.
	probing bool
}

func New(size int) *Cache {
	if size <= 0 {
		return nil
	}
	c := &Cache{seed: maphash.MakeSeed(), perShard: max(1, size/Shards), start: time.Now()}
	for i := range c.shards {
		c.shards[i].m = make(map[bucketKey]denial)
	}
	return c
}

func (c *Cache) Now() int64 { return int64(time.Since(c.start)) }

// ProbeWindow bounds how long the checks of a key wait for the answer of
// the one check sent to the store when its denial expired.
const ProbeWindow = 100 * time.Millisecond

// Get reports whether (rule, key) is denied for cost, and for how long.
// When a denial has just expired, the first caller gets probe true: it goes
// to the store alone while the others stay denied for up to ProbeWindow,
// and it must then call Put (denied again) or Forget (allowed, or failed).
// A flooding key then costs one store call per refill, not one per caller.
func (c *Cache) Get(rule, key string, cost float64) (retry, reset time.Duration, ok, probe bool) {
	sh := &c.shards[maphash.String(c.seed, key)%Shards]
	id := bucketKey{rule, key}
	now := c.Now()
	sh.mu.Lock()
	d, found := sh.m[id]
	if found && now >= d.until {
		if d.probing {
			// The probe never reported: forget the key.
			delete(sh.m, id)
			sh.mu.Unlock()
			return 0, 0, false, false
		}
		d.until, d.probing = now+int64(ProbeWindow), true
		sh.m[id] = d
		sh.mu.Unlock()
		return 0, 0, false, true
	}
	sh.mu.Unlock()
	if !found || cost < d.cost {
		return 0, 0, false, false
	}
	return time.Duration(d.until - now), time.Duration(max(d.reset-now, 0)), true, false
}

// GetBeyond reports whether (rule, key) is denied for cost for longer
// than wait, and for how long beyond it: a paced check (one that accepts
// wait) is refused here only when even its wait cannot reach the end of
// the denial, so the cache never refuses a paced check that a reservation
// could admit. It never probes: a paced check that may fit goes to the
// store, like any check of a key not denied.
func (c *Cache) GetBeyond(rule, key string, cost float64, wait time.Duration) (retry, reset time.Duration, ok bool) {
	sh := &c.shards[maphash.String(c.seed, key)%Shards]
	now := c.Now()
	sh.mu.Lock()
	d, found := sh.m[bucketKey{rule, key}]
	sh.mu.Unlock()
	if !found || d.probing || cost < d.cost || d.until-now <= int64(wait) {
		return 0, 0, false
	}
	return time.Duration(d.until - now - int64(wait)), time.Duration(max(d.reset-now, 0)), true
}

// Forget drops the denial of (rule, key): its probe was allowed or failed.
func (c *Cache) Forget(rule, key string) {
	sh := &c.shards[maphash.String(c.seed, key)%Shards]
	sh.mu.Lock()
	delete(sh.m, bucketKey{rule, key})
	sh.mu.Unlock()
}

// Put remembers that cost is denied for (rule, key) for retry after sent,
// the instant (c.Now) the store call that said so was sent: counting from
// then, never from the answer, keeps the denial within the store's own.
// gen is the generation of the rules the check was decided under: a denial
// of an older generation is dropped. It reports whether it remembered.
func (c *Cache) Put(gen uint64, rule, key string, cost float64, sent int64, retry, reset time.Duration) bool {
	if retry <= 0 {
		return false
	}
	sh := &c.shards[maphash.String(c.seed, key)%Shards]
	d := denial{until: sent + int64(retry), reset: sent + int64(reset), cost: cost}
	id := bucketKey{rule, key}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	// Under the shard's lock: a reset that cleared this shard has already
	// moved the generation on.
	if gen != c.gen.Load() {
		return false
	}
	if _, ok := sh.m[id]; !ok && len(sh.m) >= c.perShard {
		for victim := range sh.m {
			delete(sh.m, victim)
			break
		}
	}
	sh.m[id] = d
	return true
}

// Len is the number of denials held, expired ones not yet dropped included.
func (c *Cache) Len() int {
	n := 0
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		n += len(sh.m)
		sh.mu.Unlock()
	}
	return n
}

// Reset starts generation gen, the rules' new one, and forgets every
// denial: the limits may have grown.
func (c *Cache) Reset(gen uint64) {
	for i := range c.shards {
		c.shards[i].mu.Lock()
	}
	c.gen.Store(gen)
	for i := range c.shards {
		clear(c.shards[i].m)
		c.shards[i].mu.Unlock()
	}
}

// Clear forgets every denial, keeping the generation.
func (c *Cache) Clear() {
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		clear(sh.m)
		sh.mu.Unlock()
	}
}
