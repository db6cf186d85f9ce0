package bucket

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"math"
	"slices"
	"time"
)

// Concurrency is the algorithm of a rule that counts requests in flight
// (from their start to their end) instead of their arrivals. It is not one
// of Algorithms: its state is a set of leases, changed by LeaseStore, not a
// budget spent by Store.Take.
const Concurrency Algorithm = "concurrency"

// Bounds of a concurrency limit.
const (
	// MaxConcurrency is the highest limit of a concurrency rule: every
	// lease held is a member of one sorted set, trimmed on every call.
	MaxConcurrency = 10_000
	// MinLeaseTTL and MaxLeaseTTL bound the length of a lease.
	MinLeaseTTL = time.Second
	MaxLeaseTTL = time.Hour
)

// ErrInvalidLease: a lease id that is malformed, or names what it cannot.
var ErrInvalidLease = errors.New("invalid lease")

// ErrLeasesFull: a Memory holds leases up to its byte cap (leases are never
// evicted, since a lease dropped would let another request in), so it
// takes no new one until some are released or expire: nothing was held.
var ErrLeasesFull = errors.New("lease memory full: no lease taken")

// LeaseLimit is the budget of one concurrency rule. The zero value is not
// valid: call Validate.
type LeaseLimit struct {
	// Limit is the most leases held at once per key, 1 to MaxConcurrency.
	Limit int
	// TTL is the length of a lease: one neither released nor renewed
	// within it expires, and its slot comes back.
	TTL time.Duration
	// Adaptive, when on, makes the limit of each key follow the latencies
	// its releases report, from Limit (within Adaptive's range).
	Adaptive Adaptive
}

// Validate reports whether l can make decisions; its errors are a
// *LimitError (field limit or lease_ttl) wrapping ErrInvalidLimit.
func (l LeaseLimit) Validate() error {
	if l.Limit < 1 || l.Limit > MaxConcurrency {
		return limitErr("limit", "a concurrency limit must be a whole number from 1 to %d, got %d", MaxConcurrency, l.Limit)
	}
	if l.TTL < MinLeaseTTL || l.TTL > MaxLeaseTTL || l.TTL%time.Millisecond != 0 {
		return limitErr("lease_ttl", "lease_ttl must be a whole number of milliseconds from %v to %v, got %v", MinLeaseTTL, MaxLeaseTTL, l.TTL)
	}
	if l.Adaptive.On() {
		if err := l.Adaptive.validate(l.TTL); err != nil {
			return err
		}
		if l.Limit < l.Adaptive.Min || l.Limit > l.Adaptive.Max {
			return limitErr("limit", "an adaptive limit starts at limit, which must be from adaptive.min (%d) to adaptive.max (%d), got %d", l.Adaptive.Min, l.Adaptive.Max, l.Limit)
		}
	}
	return nil
}

// LeaseRequest names one concurrency rule's leases of one key.
type LeaseRequest struct {
	Rule, Key string
	Limit     LeaseLimit
	// Keep, in an Acquire, is what the request's priority class keeps of
	// the key's limit for the classes above it, a fraction in [0, 1): the
	// lease is taken only while fewer than Limit − ⌊Keep × Limit⌋ are held
	// (Leases.AcquireKeeping). 0 keeps nothing.
	Keep float64
	// Sample, in a Release, is what the caller reports of the request:
	// it moves an adaptive limit when the lease was held. Nil: nothing
	// reported.
	Sample *LeaseSample
}

// LeaseDecision is the answer of an Acquire or a Renew for one rule.
type LeaseDecision struct {
	// Allowed: the lease is held (acquired, or renewed). For a Renew,
	// false means the lease is gone (expired, released or never held).
	Allowed bool
	// InFlight is the number of leases of the key held after the decision.
	InFlight int
	// Limit is the rule's limit; for an adaptive rule, the key's limit
	// now.
	Limit int
	// Expires is, when allowed, the instant the lease expires (the
	// store's clock).
	Expires time.Time
	// RetryAfter is, when an Acquire is refused, the time until the
	// soonest lease held expires: the latest a slot comes back (a release
	// may free one sooner). > 0. When Reserved, the time until as many
	// leases expire as the request needs to fit above what it keeps.
	RetryAfter time.Duration
	// Reserved reports an Acquire refused only for its Keep: fewer than
	// the limit are held, and keeping nothing it would have been allowed.
	Reserved bool
}

// LeaseStore holds the leases of concurrency rules. Every method trims the
// leases past their expiry first. The member is the lease's identity in
// each (rule, key) set: unguessable, chosen by the caller. Implementations
// are safe for concurrent use; an error means nothing was changed, or, when
// it wraps ErrOutcomeUnknown, that the change may have been made.
type LeaseStore interface {
	// Acquire takes a lease of member for every request, all or nothing:
	// when any is refused none is held. A member already held is renewed.
	Acquire(ctx context.Context, reqs []LeaseRequest, member string) ([]LeaseDecision, error)
	// Release gives member's leases back; a lease unknown or expired is
	// no error (released reports which were held). A request's Sample
	// moves its key's adaptive limit when its lease was held.
	Release(ctx context.Context, reqs []LeaseRequest, member string) (released []bool, err error)
	// Renew extends member's leases by their TTL from now; a decision not
	// allowed says that lease is gone.
	Renew(ctx context.Context, reqs []LeaseRequest, member string) ([]LeaseDecision, error)
}

// Leases is the state of one (rule, key): each lease held and the instant
// (µs) it expires. The zero value holds none. Not safe for concurrent use.
// Its operations take the instant now and do what the concurrency scripts
// do, in the same order, so the two make identical decisions.
type Leases struct {
	held map[string]int64
	// adaptive is the key's adaptive limit, kept until adaptiveExp (µs).
	adaptive    AdaptiveState
	adaptiveExp int64
	// bytes is what a Memory counts of s.
	bytes int64
}

// kept reports whether s holds anything at now: a lease, or an adaptive
// limit.
func (s *Leases) kept(now int64) bool { return len(s.held) > 0 || s.adaptiveExp > now }

// Len is the number of leases held, expired ones not yet trimmed included.
func (s *Leases) Len() int { return len(s.held) }

// Latest is the latest expiry of a lease held, 0 for none.
func (s *Leases) Latest() int64 {
	var m int64
	for _, e := range s.held {
		m = max(m, e)
	}
	return m
}

// trim drops the leases whose expiry is at or before now.
func (s *Leases) trim(now int64) {
	for m, e := range s.held {
		if e <= now {
			delete(s.held, m)
		}
	}
}

// Acquire takes a lease of member at now, when fewer than the key's limit
// are held (l.Limit, or its adaptive limit); a member already held is
// renewed.
func (s *Leases) Acquire(now int64, l LeaseLimit, member string) LeaseDecision {
	return s.AcquireKeeping(now, l, 0, member)
}

// AcquireKeeping is Acquire for a request that keeps keep (a fraction in
// [0, 1): see LeaseRequest.Keep) of the key's limit for more important
// priority classes: a new member takes a lease only while fewer than
// LeaseRoom(limit, keep) are held. A refusal with fewer than the limit held is
// Reserved, retried when enough leases expire for it to fit.
func (s *Leases) AcquireKeeping(now int64, l LeaseLimit, keep float64, member string) LeaseDecision {
	s.trim(now)
	exp := now + l.TTL.Microseconds()
	limit := s.limit(now, l)
	if _, ok := s.held[member]; ok || len(s.held) < LeaseRoom(limit, keep) {
		if s.held == nil {
			s.held = make(map[string]int64)
		}
		s.held[member] = exp
		return LeaseDecision{Allowed: true, InFlight: len(s.held), Limit: limit, Expires: time.UnixMicro(exp)}
	}
	return s.refusal(now, len(s.held), limit, keep)
}

// refusal is the decision of an Acquire keeping keep refused at now, with
// held leases not expired under limit: Reserved below the limit, retried
// at the soonest expiry, or for a reserved refusal when as many leases
// expire as the request needs to fit. The leases expired at now are
// passed over, not dropped.
func (s *Leases) refusal(now int64, held, limit int, keep float64) LeaseDecision {
	d := LeaseDecision{InFlight: held, Limit: limit, Reserved: held < limit}
	k := 0
	if d.Reserved {
		k = held - LeaseRoom(limit, keep)
	}
	var at int64
	if k == 0 {
		for _, e := range s.held {
			if e > now && (at == 0 || e < at) {
				at = e
			}
		}
	} else {
		exps := make([]int64, 0, held)
		for _, e := range s.held {
			if e > now {
				exps = append(exps, e)
			}
		}
		slices.Sort(exps)
		at = exps[k]
	}
	d.RetryAfter = time.Duration(at-now) * time.Microsecond
	return d
}

// LeaseRoom is how many leases a request keeping keep (a fraction in
// [0, 1): see LeaseRequest.Keep) of limit may find held and still take
// one: limit − ⌊keep × limit⌋, at least 1 since keep < 1. acquire.lua and
// lease_usage.lua reckon it with the same float64 arithmetic.
func LeaseRoom(limit int, keep float64) int {
	if !(keep > 0) {
		return limit
	}
	return limit - int(math.Floor(keep*float64(limit)))
}

// admits reports whether an Acquire of member keeping keep at now would
// be allowed.
func (s *Leases) admits(now int64, l LeaseLimit, keep float64, member string) bool {
	s.trim(now)
	_, ok := s.held[member]
	return ok || len(s.held) < LeaseRoom(s.limit(now, l), keep)
}

// Release drops member's lease; it reports whether it was held. When it
// was, sm (nil: none) moves the key's adaptive limit under l.
func (s *Leases) Release(now int64, l LeaseLimit, member string, sm *LeaseSample) bool {
	s.trim(now)
	_, ok := s.held[member]
	if ok {
		s.sample(now, l, len(s.held), sm)
	}
	delete(s.held, member)
	return ok
}

// Renew extends member's lease to now + l.TTL; not allowed when it is gone.
// Its Limit is the key's, as an Acquire's: l.Limit, or its adaptive limit.
func (s *Leases) Renew(now int64, l LeaseLimit, member string) LeaseDecision {
	s.trim(now)
	limit := s.limit(now, l)
	if _, ok := s.held[member]; !ok {
		return LeaseDecision{InFlight: len(s.held), Limit: limit}
	}
	exp := now + l.TTL.Microseconds()
	s.held[member] = exp
	return LeaseDecision{Allowed: true, InFlight: len(s.held), Limit: limit, Expires: time.UnixMicro(exp)}
}

// Share is one of n equal parts of l (at least one lease), for fail-open
// decisions while the shared store is down.
func (l LeaseLimit) Share(n int) LeaseLimit {
	if n > 1 {
		l.Limit = max(1, l.Limit/n)
		if l.Adaptive.On() {
			l.Adaptive.Min = max(1, l.Adaptive.Min/n)
			l.Adaptive.Max = max(1, l.Adaptive.Max/n)
		}
	}
	return l
}

func (l LeaseLimit) String() string {
	if l.Adaptive.On() {
		return fmt.Sprintf("%d to %d in flight from %d, target latency %v, leases of %v", l.Adaptive.Min, l.Adaptive.Max, l.Limit, l.Adaptive.Target, l.TTL)
	}
	return fmt.Sprintf("%d in flight, leases of %v", l.Limit, l.TTL)
}

// leaseOverhead is the memory counted for a lease set besides its key,
// rule id and members: the map entries and the set.
const leaseOverhead = 200

// leaseMemberOverhead is the memory counted per lease besides its member.
const leaseMemberOverhead = 48

func (sh *memoryShard) leaseSet(id bucketID) *Leases {
	if sh.leases == nil {
		sh.leases = make(map[bucketID]*Leases)
	}
	s := sh.leases[id]
	if s == nil {
		s = &Leases{}
		sh.leases[id] = s
	}
	return s
}

// leaseBytes is the memory counted for the lease set of id.
func leaseBytes(id bucketID, s *Leases, member string) int64 {
	return leaseOverhead + int64(len(id.rule)+len(id.key)) + int64(s.Len())*int64(len(member)+leaseMemberOverhead)
}

// lockLeases locks the shards of reqs in index order, and returns them per
// request and an unlock.
func (m *Memory) lockLeases(now int64, reqs []LeaseRequest) ([]*memoryShard, func()) {
	shs := make([]*memoryShard, len(reqs))
	var locked [memoryShards]bool
	for i, r := range reqs {
		j := maphash.String(m.seed, r.Key) % memoryShards
		locked[j] = true
		shs[i] = &m.shards[j]
	}
	var held []*memoryShard
	for i := range m.shards {
		if locked[i] {
			sh := &m.shards[i]
			sh.mu.Lock()
			if now >= sh.nextSweep {
				sh.sweep(now)
			}
			held = append(held, sh)
		}
	}
	return shs, func() {
		for _, sh := range held {
			sh.mu.Unlock()
		}
	}
}

// change applies f to the lease set of each request and keeps the shard's
// byte count of it, dropping a set left empty.
func (m *Memory) changeLeases(now int64, shs []*memoryShard, reqs []LeaseRequest, member string, f func(i int, s *Leases)) {
	for i, r := range reqs {
		id := bucketID{r.Rule, r.Key}
		sh := shs[i]
		s := sh.leaseSet(id)
		before := s.bytes
		f(i, s)
		s.bytes = 0
		if s.kept(now) {
			s.bytes = leaseBytes(id, s, member)
		} else {
			delete(sh.leases, id)
		}
		sh.leaseBytes += s.bytes - before
	}
}

// Acquire takes member's lease of every request, all or nothing. Its one
// error is ErrLeasesFull, when a shard holds leases up to the byte cap.
func (m *Memory) Acquire(_ context.Context, reqs []LeaseRequest, member string) ([]LeaseDecision, error) {
	now := m.nowMicros()
	shs, unlock := m.lockLeases(now, reqs)
	defer unlock()
	out := make([]LeaseDecision, len(reqs))
	m.changeLeases(now, shs, reqs, member, func(_ int, s *Leases) { s.trim(now) })
	for _, sh := range shs {
		if sh.leaseBytes >= m.perShard {
			return nil, ErrLeasesFull
		}
	}
	all := true
	for i, r := range reqs {
		s := shs[i].leases[bucketID{r.Rule, r.Key}]
		if s == nil {
			s = &Leases{}
		}
		if !s.admits(now, r.Limit, r.Keep, member) {
			all = false
			out[i] = s.AcquireKeeping(now, r.Limit, r.Keep, member) // refused: changes nothing
		}
	}
	if !all {
		for i, r := range reqs {
			if out[i].Limit == 0 {
				out[i] = LeaseDecision{Allowed: true, Limit: r.Limit.Limit}
				if s := shs[i].leases[bucketID{r.Rule, r.Key}]; s != nil {
					out[i].InFlight = s.Len()
					out[i].Limit = s.limit(now, r.Limit)
				} else if r.Limit.Adaptive.On() {
					out[i].Limit = r.Limit.Adaptive.clamp(r.Limit.Limit)
				}
			}
		}
		return out, nil
	}
	m.changeLeases(now, shs, reqs, member, func(i int, s *Leases) { out[i] = s.AcquireKeeping(now, reqs[i].Limit, reqs[i].Keep, member) })
	return out, nil
}

// Release gives member's leases back. It never returns an error.
func (m *Memory) Release(_ context.Context, reqs []LeaseRequest, member string) ([]bool, error) {
	now := m.nowMicros()
	shs, unlock := m.lockLeases(now, reqs)
	defer unlock()
	out := make([]bool, len(reqs))
	m.changeLeases(now, shs, reqs, member, func(i int, s *Leases) { out[i] = s.Release(now, reqs[i].Limit, member, reqs[i].Sample) })
	return out, nil
}

// Renew extends member's leases. It never returns an error.
func (m *Memory) Renew(_ context.Context, reqs []LeaseRequest, member string) ([]LeaseDecision, error) {
	now := m.nowMicros()
	shs, unlock := m.lockLeases(now, reqs)
	defer unlock()
	out := make([]LeaseDecision, len(reqs))
	m.changeLeases(now, shs, reqs, member, func(i int, s *Leases) { out[i] = s.Renew(now, reqs[i].Limit, member) })
	return out, nil
}

// sweepLeases drops the expired leases of the locked shard.
func (sh *memoryShard) sweepLeases(now int64) {
	for id, s := range sh.leases {
		if s.Latest() > now || s.adaptiveExp > now {
			continue
		}
		sh.leaseBytes -= s.bytes
		delete(sh.leases, id)
	}
}
