package bucket

import (
	"context"
	"math"
	"time"
)

// A bucket handed off moves with its key: when a topology switch gives a
// pinned rule's key a new home region, the new home raises its own bucket
// to count at least what the old home's bucket counts (Used there, Raise
// here), once, before it decides the key. The amount is tokens, not a
// state: the two stores' clocks need not agree.

// Used is the tokens st counts against l at now: what a Debit of that
// amount into a fresh State counts again.
//   - TokenBucket, GCRA: the debt (capacity less the tokens left, and any
//     debt or reservation beyond), exactly: a fresh bucket debited by it
//     refills to full at the same instant;
//   - SlidingWindow: the estimate of the last window, previous*(1-f) +
//     current, rounded up to the millionth. Debited, it all counts in the
//     current window, so it weighs until the window after next begins,
//     longer than the previous window's part did: never less;
//   - FixedWindow: the current window's count;
//   - SlidingLog: the entries within the window. Debited, they count from
//     now, for a whole window.
//
// So a bucket seeded with Used admits no more than st would have. st is not
// changed.
func (l *Limit) Used(st *State, now int64) float64 {
	switch l.Algorithm {
	case TokenBucket, GCRA:
		cp := *st
		d := l.debt(&cp, now, spendNs(l.Capacity, l.RefillPerSecond))
		return float64(d*l.RefillPerSecond) / 1e9
	case SlidingWindow:
		w := l.windowMicros()
		now = st.windowNow(now, w)
		idx := now / w
		cur, prev := st.windowCounts(idx)
		f := float64(now-idx*w) / float64(w)
		return math.Ceil(float64(float64(prev*(1-f))+cur)*1e6) / 1e6
	case FixedWindow:
		if st.a >= now/l.windowMicros() {
			return micro(st.b)
		}
	case SlidingLog:
		cut := now - l.windowMicros()
		n := 0
		for _, t := range st.log {
			if t > cut {
				n++
			}
		}
		return float64(n)
	}
	return 0
}

// MostUsed is the most Used can report for l: the debt bound a debit stops
// at (see DebtHorizon), twice the window's for a sliding window's estimate
// (its current and previous windows). A count above it did not come from a
// bucket of l.
func (l *Limit) MostUsed() float64 {
	switch l.Algorithm {
	case TokenBucket, GCRA:
		return float64(maxDebtNs(spendNs(l.Capacity, l.RefillPerSecond))*l.RefillPerSecond) / 1e9
	case SlidingWindow:
		return 2 * l.windowMost()
	case FixedWindow:
		return l.windowMost()
	case SlidingLog:
		return float64(l.logMost())
	}
	return 0
}

// HandoffWindow is how long after a topology switch a bucket of l may still
// count what it held before: the longest a debt or a window lasts. Past it
// the old home's bucket is full again or its windows are clear, so a key
// that moves has nothing to take.
func (l Limit) HandoffWindow() time.Duration {
	switch l.Algorithm {
	case TokenBucket, GCRA:
		// Two capacities' duration and the debt horizon (maxDebtNs).
		return time.Duration(maxDebtNs(spendNs(l.Capacity, l.RefillPerSecond)))
	case SlidingWindow:
		return 2 * l.Window
	case FixedWindow, SlidingLog:
		return l.Window
	}
	return 0
}

// Raise makes st count at least used against l at now: it debits st by
// what used counts beyond st's own Used, and leaves a bucket that counts
// as much already as it is. A seed raises the new home's bucket, never
// replaces it: a second seed of the same move (a record of the first gone,
// a process whose window ends later), whose old home has refilled and
// reports about nothing, then keeps what the key spent here since.
func (l *Limit) Raise(st *State, now int64, used float64) {
	l.clampDebt(st, now) // as the script's read of the bucket does
	if more := used - l.Used(st, now); more > 0 {
		l.Debit(st, now, more)
	}
}

// Seed is the state a bucket takes from the key's old home region.
type Seed struct {
	// Rule, Key and Limit name the bucket, as in a Request.
	Rule  string
	Key   string
	Limit Limit
	// Generation is the topology generation the key moved at: a bucket is
	// seeded once per generation (and Origin).
	Generation uint64
	// Origin names what moved the key when it is not a topology switch
	// (a change of the rule's explicit homes): each origin has its own
	// record of the seed. Empty for a topology switch.
	Origin string
	// Used is what the old home's bucket counted (Limit.Used there).
	Used float64
	// TTL is how long the record that the bucket was seeded is kept: the
	// rest of the rule's HandoffWindow after the switch.
	TTL time.Duration
}

// HandoffStore is a store that can hand its buckets off: read what they
// count, and seed them with what another store's counted. Implementations
// are safe for concurrent use.
type HandoffStore interface {
	// Used reports, per request, the tokens its bucket counts now
	// (Limit.Used; a request's Cost and MaxWait are ignored).
	Used(ctx context.Context, reqs []Request) ([]float64, error)
	// Seeded reports, per seed, whether its bucket was seeded at its
	// Generation or a later one within that seed's TTL.
	Seeded(ctx context.Context, seeds []Seed) ([]bool, error)
	// Seed raises each bucket that Seeded would not report to count at
	// least Used (Limit.Raise), and records it seeded for TTL; it reports
	// which it seeded. A bucket already seeded is left as it is, with the
	// checks it decided since, so two callers racing to seed one bucket
	// seed it once; and since a seed never lowers a bucket, seeding again
	// (a record gone) gives back nothing spent since.
	Seed(ctx context.Context, seeds []Seed) ([]bool, error)
}

// SeedRecord names a seed's record among the buckets of s.Key, as a rule
// id: no rule id starts with '~', and none holds ':'.
func SeedRecord(s Seed) string {
	if s.Origin != "" {
		return "~moved:" + s.Origin + ":" + s.Rule
	}
	return "~moved:" + s.Rule
}

// Used reports the tokens each request's bucket counts now. It never
// returns an error.
func (m *Memory) Used(_ context.Context, reqs []Request) ([]float64, error) {
	now := m.nowMicros()
	out := make([]float64, len(reqs))
	for i, r := range reqs {
		sh := m.shard(r.Key)
		sh.mu.Lock()
		if e := sh.buckets[bucketID{r.Rule, r.Key}]; e != nil && e.expires > now {
			out[i] = r.Limit.Used(&e.st, now)
		}
		sh.mu.Unlock()
	}
	return out, nil
}

// Seeded reports which seeds' buckets were seeded at their generation or a
// later one. It never returns an error.
func (m *Memory) Seeded(_ context.Context, seeds []Seed) ([]bool, error) {
	now := m.nowMicros()
	out := make([]bool, len(seeds))
	for i, s := range seeds {
		sh := m.shard(s.Key)
		sh.mu.Lock()
		out[i] = sh.seeded(s, now)
		sh.mu.Unlock()
	}
	return out, nil
}

// seeded is Seeded for one seed, with its shard locked.
func (sh *memoryShard) seeded(s Seed, now int64) bool {
	e := sh.buckets[bucketID{SeedRecord(s), s.Key}]
	return e != nil && e.expires > now && uint64(e.st.a) >= s.Generation
}

// Seed raises the buckets not yet seeded at their generation to count at
// least Used (Limit.Raise). It never returns an error.
func (m *Memory) Seed(_ context.Context, seeds []Seed) ([]bool, error) {
	now := m.nowMicros()
	out := make([]bool, len(seeds))
	for i, s := range seeds {
		sh := m.shard(s.Key)
		sh.mu.Lock()
		if !sh.seeded(s, now) {
			id := bucketID{s.Rule, s.Key}
			e := sh.buckets[id]
			if e != nil && e.expires <= now {
				sh.drop(id, e)
				e = nil
			}
			var st State
			if e != nil {
				st = e.st
			}
			s.Limit.Raise(&st, now, s.Used)
			if exp := s.Limit.ExpiresAt(&st); exp > now {
				if e == nil {
					e = &memoryEntry{}
				}
				e.st, e.expires = st, exp
				sh.store(id, e)
			}
			mark := bucketID{SeedRecord(s), s.Key}
			if old := sh.buckets[mark]; old != nil {
				sh.drop(mark, old)
			}
			ttl := max(s.TTL.Microseconds(), 1)
			sh.store(mark, &memoryEntry{st: State{a: int64(s.Generation)}, expires: now + ttl})
			// Room is made keeping both: the seed record must outlive the
			// seeded bucket's window, or a later check seeds it again.
			m.makeRoom(sh, now, id, mark)
			out[i] = true
		}
		sh.mu.Unlock()
	}
	return out, nil
}
