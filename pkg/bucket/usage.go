package bucket

import (
	"context"
	"math"
	"sort"
	"time"
)

// Usager tells what a check would see now, without spending and without
// changing any state: no refill is written, no debt clamped, no log
// trimmed, no lease dropped. Implementations are safe for concurrent use.
type Usager interface {
	// Usage answers, for each request, what a Take of its cost keeping
	// its Keep would see now (see Limit.UsageKeeping), in the order of
	// reqs.
	Usage(ctx context.Context, reqs []Request) ([]Decision, error)
	// LeaseUsage answers, for each request, the leases held now and
	// what an Acquire keeping its Keep would see (see
	// Leases.UsageKeeping), in the order of reqs.
	LeaseUsage(ctx context.Context, reqs []LeaseRequest) ([]LeaseDecision, error)
}

// Usage is what a Take of cost under l would see at now, without
// spending and without changing st:
//   - Allowed: whether the Take would pass;
//   - Remaining: what is left before the spend (a refused Take reports the
//     same; an allowed one reports it less the cost);
//   - RetryAfter: when refused, what the refused Take reports; 0 otherwise;
//   - ResetAfter: how long until the bucket is full again or the windows
//     clear, 0 when they are.
//
// At is now. cost must be normalized (NormalizeCost) and l valid. The Lua
// usage script computes the same, in the same order.
func (l *Limit) Usage(st *State, now int64, cost float64) Decision {
	return l.UsageKeeping(st, now, cost, 0)
}

// UsageKeeping is Usage for a request that keeps keep (a fraction of the
// capacity, in [0, 1): see Request.Keep), as TakeKeeping decides it: a
// token bucket or GCRA allows it only while, after its spend, at least
// keep × capacity is left; a refusal that keeping nothing would have
// allowed is Reserved, and its RetryAfter is until it fits above what it
// keeps. Remaining is the bucket's, whatever keep. The window algorithms
// do not read keep.
func (l *Limit) UsageKeeping(st *State, now int64, cost, keep float64) Decision {
	var d Decision
	switch l.Algorithm {
	case TokenBucket, GCRA:
		d = l.usageInstant(st, now, cost, keep)
	case SlidingWindow:
		d = l.usageSlidingWindow(st, now, cost)
	case FixedWindow:
		d = l.usageFixedWindow(st, now, cost)
	case SlidingLog:
		d = l.usageSlidingLog(st, now, cost)
	default:
		d = Decision{Limit: l.Capacity}
	}
	d.At = now
	return d
}

func (l *Limit) usageInstant(st *State, now int64, cost, keep float64) Decision {
	rate := l.RefillPerSecond
	full := spendNs(l.Capacity, rate)
	d := math.Min(debtNs(st.a, now), maxDebtNs(full))
	s := spendNs(cost, rate)
	room := full - keepNs(keep, full)
	u := Decision{
		Allowed:    d+s <= room,
		Remaining:  l.remaining(d, full, l.Algorithm == GCRA),
		Limit:      l.Capacity,
		ResetAfter: micros(upMicros(d)),
	}
	if !u.Allowed {
		u.RetryAfter = micros(upMicros(float64(d+s) - room))
		u.Reserved = keep > 0 && d+s <= full
	}
	return u
}

func (l *Limit) usageSlidingWindow(st *State, now int64, cost float64) Decision {
	w := l.windowMicros()
	now = st.windowNow(now, w)
	idx := now / w
	f := float64(now-idx*w) / float64(w)
	cur, prev := st.windowCounts(idx)
	limit, cost := micro(l.Capacity), windowCost(cost)
	est := float64(prev*(1-f)) + cur
	u := Decision{Remaining: math.Max(micro(limit-est), 0), Limit: l.Capacity}
	if cur > 0 {
		u.ResetAfter = micros((idx+2)*w - now)
	} else if prev > 0 {
		u.ResetAfter = micros((idx+1)*w - now)
	}
	if micro(est+cost) <= limit {
		u.Allowed = true
		return u
	}
	var at int64
	if micro(cur+cost) <= limit {
		at = idx*w + int64(math.Ceil((1-(limit-cost-cur)/prev)*float64(w)))
	} else {
		at = (idx+1)*w + int64(math.Ceil((1-(limit-cost)/cur)*float64(w)))
	}
	u.RetryAfter = micros(max(at-now, 1))
	return u
}

func (l *Limit) usageFixedWindow(st *State, now int64, cost float64) Decision {
	w := l.windowMicros()
	now = st.windowNow(now, w)
	idx := now / w
	var count float64
	if st.a == idx {
		count = micro(st.b)
	}
	limit, cost := micro(l.Capacity), windowCost(cost)
	end := (idx+1)*w - now
	u := Decision{Remaining: math.Max(micro(limit-count), 0), Limit: l.Capacity}
	if count > 0 {
		u.ResetAfter = micros(end)
	}
	if micro(count+cost) <= limit {
		u.Allowed = true
		return u
	}
	u.RetryAfter = micros(end)
	return u
}

func (l *Limit) usageSlidingLog(st *State, now int64, cost float64) Decision {
	w := l.windowMicros()
	cut := now - w
	// The entries after cut, without trimming the log.
	first := sort.Search(len(st.log), func(i int) bool { return st.log[i] > cut })
	live := st.log[first:]
	n, k := len(live), int(cost)
	u := Decision{Remaining: math.Max(l.Capacity-float64(n), 0), Limit: l.Capacity}
	if n > 0 {
		u.ResetAfter = micros(live[n-1] + w - now)
	}
	if float64(n+k) <= l.Capacity {
		u.Allowed = true
		return u
	}
	oldest := live[n+k-int(l.Capacity)-1]
	u.RetryAfter = micros(max(oldest+w-now, 1))
	return u
}

// Usage is what an Acquire under l would see at now, without taking a
// lease or dropping an expired one: UsageKeeping keeping nothing.
func (s *Leases) Usage(now int64, l LeaseLimit) LeaseDecision {
	return s.UsageKeeping(now, l, 0)
}

// UsageKeeping is what an Acquire of a new member keeping keep (a
// fraction in [0, 1): see LeaseRequest.Keep) under l would see at now, as
// AcquireKeeping decides it, without taking a lease or dropping an expired
// one: Allowed while fewer than LeaseRoom(limit, keep) are held; InFlight the
// leases held (not expired); when refused, Reserved below the limit and
// RetryAfter the refused Acquire's (the soonest expiry, or for a reserved
// refusal until as many expire as the class needs to fit); Expires the
// latest expiry (the zero Time when none is held). Limit is the key's:
// l.Limit, or its adaptive limit. The lease usage script computes the
// same.
func (s *Leases) UsageKeeping(now int64, l LeaseLimit, keep float64) LeaseDecision {
	limit := s.limit(now, l)
	held := 0
	var latest int64
	for _, e := range s.held {
		if e <= now {
			continue
		}
		held++
		latest = max(latest, e)
	}
	u := LeaseDecision{Allowed: held < LeaseRoom(limit, keep), InFlight: held, Limit: limit}
	if !u.Allowed {
		u = s.refusal(now, held, limit, keep)
	}
	if latest > 0 {
		u.Expires = time.UnixMicro(latest)
	}
	return u
}

// Usage answers what a Take of each request would see now, keeping its
// Keep (Limit.UsageKeeping), changing nothing. It never returns an error.
func (m *Memory) Usage(_ context.Context, reqs []Request) ([]Decision, error) {
	now := m.nowMicros()
	out := make([]Decision, len(reqs))
	for i, r := range reqs {
		sh := m.shard(r.Key)
		sh.mu.Lock()
		var fresh State
		st := &fresh
		if e := sh.buckets[bucketID{r.Rule, r.Key}]; e != nil && e.expires > now {
			st = &e.st
		}
		out[i] = r.Limit.UsageKeeping(st, now, r.Cost, r.Keep)
		sh.mu.Unlock()
	}
	return out, nil
}

// LeaseUsage answers the leases each request's key holds now, and what an
// Acquire keeping its Keep would see (Leases.UsageKeeping), changing
// nothing. It never returns an error.
func (m *Memory) LeaseUsage(_ context.Context, reqs []LeaseRequest) ([]LeaseDecision, error) {
	now := m.nowMicros()
	out := make([]LeaseDecision, len(reqs))
	for i, r := range reqs {
		sh := m.shard(r.Key)
		sh.mu.Lock()
		s := sh.leases[bucketID{r.Rule, r.Key}]
		if s == nil {
			s = &Leases{}
		}
		out[i] = s.UsageKeeping(now, r.Limit, r.Keep)
		sh.mu.Unlock()
	}
	return out, nil
}
