package bucket

import (
	"math"
	"time"
)

// State is the stored state of one bucket or window. The zero value is a
// full bucket or an empty window. A State is not safe for concurrent use.
//
// The layout mirrors what the Lua scripts store in Redis:
//   - TokenBucket: a = the instant (µs) at which the bucket is full again;
//   - GCRA: a = the theoretical arrival time (µs);
//   - SlidingWindow: a = window index, b = current count, c = previous count;
//   - FixedWindow: a = window index, b = count;
//   - SlidingLog: log = admitted instants (µs), oldest first.
type State struct {
	a   int64
	b   float64
	c   float64
	log []int64
}

// Take decides a request of cost under l at the instant now (microseconds
// since the Unix epoch), updating st when the request is allowed (and, for
// a token bucket or GCRA, clamping a debt a lowered capacity left: see
// clampDebt). cost must
// already be normalized (NormalizeCost) and l valid (Validate). It does not
// allocate, except a SlidingLog growing its log.
func (l *Limit) Take(st *State, now int64, cost float64) Decision {
	switch l.Algorithm {
	case TokenBucket:
		return l.takeTokenBucket(st, now, cost)
	case GCRA:
		return l.takeGCRA(st, now, cost)
	case SlidingWindow:
		return l.takeSlidingWindow(st, now, cost)
	case FixedWindow:
		return l.takeFixedWindow(st, now, cost)
	case SlidingLog:
		return l.takeSlidingLog(st, now, cost)
	}
	return Decision{Limit: l.Capacity}
}

// TakeAt is Take with a time.Time.
func (l *Limit) TakeAt(st *State, now time.Time, cost float64) Decision {
	return l.Take(st, now.UnixMicro(), cost)
}

// ExpiresAt is the instant (µs) after which st holds nothing that a fresh
// State would not: the bucket is full again or the windows are clear.
func (l *Limit) ExpiresAt(st *State) int64 {
	switch l.Algorithm {
	case TokenBucket, GCRA:
		return st.a
	case SlidingWindow:
		return (st.a + 2) * l.windowMicros()
	case FixedWindow:
		return (st.a + 1) * l.windowMicros()
	case SlidingLog:
		if n := len(st.log); n > 0 {
			return st.log[n-1] + l.windowMicros()
		}
	}
	return 0
}

func (l *Limit) windowMicros() int64 { return l.Window.Microseconds() }

func micros(us int64) time.Duration { return time.Duration(us) * time.Microsecond }

// roundMicros rounds a duration in µs to the nearest whole µs, at least 1:
// every spend moves the state by at least one microsecond.
func roundMicros(us float64) int64 {
	n := int64(math.Floor(us + 0.5))
	if n < 1 {
		n = 1
	}
	return n
}

// ceilMicros rounds up, at least 1: a rejection never says "retry now".
func ceilMicros(us float64) int64 {
	n := int64(math.Ceil(us))
	if n < 1 {
		n = 1
	}
	return n
}

// The token bucket keeps one number: the instant full at which it is full
// again. Its tokens at now are capacity - (full-now)*rate, which is the lazy
// refill min(C, tokens + elapsed*rate) without a second field.
func (l *Limit) takeTokenBucket(st *State, now int64, cost float64) Decision {
	rate := l.RefillPerSecond
	l.clampDebt(st, now)
	full := max(st.a, now)
	tokens := l.Capacity - float64(full-now)*rate/1e6
	if tokens >= cost {
		full += roundMicros(cost * 1e6 / rate)
		st.a = full
		return Decision{
			Allowed:    true,
			Remaining:  math.Max(l.Capacity-float64(full-now)*rate/1e6, 0),
			Limit:      l.Capacity,
			ResetAfter: micros(full - now),
		}
	}
	return Decision{
		Remaining:  math.Max(tokens, 0),
		Limit:      l.Capacity,
		RetryAfter: micros(ceilMicros((cost - tokens) * 1e6 / rate)),
		ResetAfter: micros(full - now),
	}
}

// clampDebt bounds a token bucket's or a GCRA's state at now to one
// capacity of debt (tokens >= -capacity): the instant it is full again, or
// its theoretical arrival time, is never more than two capacities' refill
// time ahead. Takes alone never go below 0 tokens; debits, other regions'
// spends, may take a bucket down to -capacity, and that debt is kept: Debit
// stops at the same bound. A state beyond it was left by a larger capacity
// (or a lower rate): a rule's capacity lowered under an active key. Clamped,
// it reads as the largest debt the new rule allows, so the key waits at most
// (cost + capacity) / rate, not the old capacity's refill time. The clamp is
// kept in st even when the request is refused: it changes no decision, and
// from there the debt refills at the rule's rate. The Lua scripts do the same.
func (l *Limit) clampDebt(st *State, now int64) {
	switch l.Algorithm {
	case TokenBucket:
		st.a = min(st.a, now+roundMicros(2*l.Capacity*1e6/l.RefillPerSecond))
	case GCRA:
		st.a = min(st.a, now+2*roundMicros(l.Capacity*1e6/l.RefillPerSecond))
	}
}

// GCRA keeps the theoretical arrival time tat; a request of cost moves it by
// cost emission intervals and passes if the new tat is within the burst
// tolerance of now.
func (l *Limit) takeGCRA(st *State, now int64, cost float64) Decision {
	rate := l.RefillPerSecond
	tolerance := roundMicros(l.Capacity * 1e6 / rate)
	l.clampDebt(st, now)
	tat := max(st.a, now)
	next := tat + roundMicros(cost*1e6/rate)
	if allowAt := next - tolerance; allowAt > now {
		return Decision{
			Remaining:  math.Max(math.Floor(float64(tolerance-(tat-now))*rate/1e6), 0),
			Limit:      l.Capacity,
			RetryAfter: micros(allowAt - now),
			ResetAfter: micros(tat - now),
		}
	}
	st.a = next
	return Decision{
		Allowed:    true,
		Remaining:  math.Max(math.Floor(float64(tolerance-(next-now))*rate/1e6), 0),
		Limit:      l.Capacity,
		ResetAfter: micros(next - now),
	}
}

// The sliding window counter estimates the last window's count as
// previous*(1-f) + current, f the elapsed fraction of the current window.
func (l *Limit) takeSlidingWindow(st *State, now int64, cost float64) Decision {
	w := l.windowMicros()
	idx := now / w
	f := float64(now-idx*w) / float64(w)
	var cur, prev float64
	switch st.a {
	case idx:
		cur, prev = st.b, st.c
	case idx - 1:
		prev = st.b
	}
	// The explicit conversion keeps the compiler from fusing the multiply
	// and add, which would round differently from the Lua script.
	est := float64(prev*(1-f)) + cur
	if est+cost <= l.Capacity {
		st.a, st.b, st.c = idx, cur+cost, prev
		return Decision{
			Allowed:    true,
			Remaining:  math.Max(l.Capacity-(est+cost), 0),
			Limit:      l.Capacity,
			ResetAfter: micros((idx+2)*w - now),
		}
	}
	var at int64
	if cur+cost <= l.Capacity {
		// Passes within this window, once the previous one weighs less.
		at = idx*w + int64(math.Ceil((1-(l.Capacity-cost-cur)/prev)*float64(w)))
	} else {
		// Passes in the next window, once this one weighs less.
		at = (idx+1)*w + int64(math.Ceil((1-(l.Capacity-cost)/cur)*float64(w)))
	}
	reset := int64(0)
	if cur > 0 {
		reset = (idx+2)*w - now
	} else if prev > 0 {
		reset = (idx+1)*w - now
	}
	return Decision{
		Remaining:  math.Max(l.Capacity-est, 0),
		Limit:      l.Capacity,
		RetryAfter: micros(max(at-now, 1)),
		ResetAfter: micros(reset),
	}
}

// The fixed window counts per window aligned to the epoch.
func (l *Limit) takeFixedWindow(st *State, now int64, cost float64) Decision {
	w := l.windowMicros()
	idx := now / w
	var count float64
	if st.a == idx {
		count = st.b
	}
	end := (idx+1)*w - now
	if count+cost <= l.Capacity {
		st.a, st.b = idx, count+cost
		return Decision{
			Allowed:    true,
			Remaining:  math.Max(l.Capacity-(count+cost), 0),
			Limit:      l.Capacity,
			ResetAfter: micros(end),
		}
	}
	return Decision{
		Remaining:  math.Max(l.Capacity-count, 0),
		Limit:      l.Capacity,
		RetryAfter: micros(end),
		ResetAfter: micros(end),
	}
}

// The sliding log keeps every admitted instant of the last window; an entry
// exactly one window old no longer counts.
func (l *Limit) takeSlidingLog(st *State, now int64, cost float64) Decision {
	w := l.windowMicros()
	st.trimLog(now - w)
	n := len(st.log)
	k := int(cost)
	if float64(n+k) <= l.Capacity {
		for range k {
			st.log = insertSorted(st.log, now)
		}
		return Decision{
			Allowed:    true,
			Remaining:  l.Capacity - float64(n+k),
			Limit:      l.Capacity,
			ResetAfter: micros(st.log[len(st.log)-1] + w - now),
		}
	}
	// The oldest n+k-capacity entries must leave the window first.
	oldest := st.log[n+k-int(l.Capacity)-1]
	return Decision{
		Remaining:  math.Max(l.Capacity-float64(n), 0),
		Limit:      l.Capacity,
		RetryAfter: micros(max(oldest+w-now, 1)),
		ResetAfter: micros(st.log[n-1] + w - now),
	}
}

// insertSorted appends t keeping log sorted; t is nearly always the newest.
func insertSorted(log []int64, t int64) []int64 {
	i := len(log)
	for i > 0 && log[i-1] > t {
		i--
	}
	log = append(log, 0)
	copy(log[i+1:], log[i:])
	log[i] = t
	return log
}

// Debit spends amount that was admitted elsewhere (another region), with no
// decision. The debt is bounded so that remote traffic, or a corrupt report,
// cannot block a key for long:
//   - TokenBucket, GCRA: the state moves by amount / rate, at most to one
//     capacity of debt (tokens >= -capacity); Take reads the state with the
//     same bound, so the debt is kept (see clampDebt);
//   - SlidingWindow, FixedWindow: amount joins the current window's count,
//     which stays at most twice the capacity;
//   - SlidingLog: amount entries (rounded) join the log at now, up to capacity.
//
// It returns the overshoot it finds: by how much the admissions known here,
// this state's and the debited ones, exceed the limit right after the debit
// (0 when there was room). It mirrors the Lua debit script, as Take mirrors
// the check scripts.
func (l *Limit) Debit(st *State, now int64, amount float64) (overshoot float64) {
	rate := l.RefillPerSecond
	switch l.Algorithm {
	case TokenBucket:
		l.clampDebt(st, now)
		full := max(st.a, now)
		overshoot = overshootOf(amount, l.Capacity-float64(full-now)*rate/1e6)
		st.a = min(full+roundMicros(amount*1e6/rate), now+roundMicros(2*l.Capacity*1e6/rate))
	case GCRA:
		tolerance := roundMicros(l.Capacity * 1e6 / rate)
		l.clampDebt(st, now)
		tat := max(st.a, now)
		overshoot = overshootOf(amount, float64(tolerance-(tat-now))*rate/1e6)
		st.a = min(tat+roundMicros(amount*1e6/rate), now+2*tolerance)
	case SlidingWindow:
		w := l.windowMicros()
		idx := now / w
		var cur, prev float64
		switch st.a {
		case idx:
			cur, prev = st.b, st.c
		case idx - 1:
			prev = st.b
		}
		f := float64(now-idx*w) / float64(w)
		overshoot = overshootOf(amount, l.Capacity-(float64(prev*(1-f))+cur))
		st.a, st.b, st.c = idx, math.Min(cur+amount, 2*l.Capacity), prev
	case FixedWindow:
		idx := now / l.windowMicros()
		var count float64
		if st.a == idx {
			count = st.b
		}
		overshoot = overshootOf(amount, l.Capacity-count)
		st.a, st.b = idx, math.Min(count+amount, 2*l.Capacity)
	case SlidingLog:
		st.trimLog(now - l.windowMicros())
		overshoot = overshootOf(amount, l.Capacity-float64(len(st.log)))
		k := min(int(math.Floor(amount+0.5)), int(l.Capacity)-len(st.log))
		for range k {
			st.log = insertSorted(st.log, now)
		}
	}
	return overshoot
}

// overshootOf is by how much amount exceeds room: the debt it leaves.
func overshootOf(amount, room float64) float64 {
	return math.Max(amount-room, 0)
}

// trimLog drops the log entries at or before cut.
func (st *State) trimLog(cut int64) {
	n := 0
	for n < len(st.log) && st.log[n] <= cut {
		n++
	}
	if n > 0 {
		st.log = st.log[:copy(st.log, st.log[n:])]
	}
}
