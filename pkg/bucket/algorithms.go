package bucket

import (
	"math"
	"time"
)

// State is the stored state of one bucket or window. The zero value is a
// full bucket or an empty window. A State is not safe for concurrent use.
//
// The layout mirrors what the Lua scripts store in Redis:
//   - TokenBucket, GCRA: a = the instant (ns since the Unix epoch) at which
//     the bucket is full again (GCRA's theoretical arrival time);
//   - SlidingWindow: a = window index, b = current count, c = previous count;
//   - FixedWindow: a = window index, b = count;
//   - SlidingLog: log = admitted instants (µs), oldest first.
//
// Window counts are whole millionths of a token (see micro).
type State struct {
	a   int64
	b   float64
	c   float64
	log []int64
}

// DebtHorizon is how much remote spending a key's debt can hold beyond one
// capacity: a debit (another region's admissions, Debit) takes a token
// bucket or GCRA down to at most capacity + rate*DebtHorizon tokens of debt,
// and a window's count to at most limit + max(limit, limit*DebtHorizon /
// window). It is ten default gossip intervals: a reconcile lag of up to
// about that keeps every remote spend, so the regions together admit at
// most capacity + rate*T plus about one interval of remote spending,
// whatever the ratio of capacity to rate. It is also the worst case of a
// huge or forged spend: the key is refused for at most (cost + capacity) /
// rate + DebtHorizon, a window until it stops counting (its end, or two
// windows for a sliding window). The Lua scripts hold the same constant
// (lib.lua).
const DebtHorizon = 10 * time.Second

// debtHorizonNs is DebtHorizon in ns, as the token bucket's state counts.
const debtHorizonNs = float64(DebtHorizon / time.Nanosecond)

// floorSlack forgives the binary rounding of decimal inputs when a spend is
// rounded down to the ns: cost*1e9/rate computed in floats is within a few
// units in the last place of the exact quotient, so a quotient within
// 2^-50 of itself below a whole number is that number: 4.1 tokens at
// 1e6/s are 4100 ns, not 4099.
const floorSlack = 0x1p-50

// Take decides a request of cost under l at the instant now (microseconds
// since the Unix epoch), updating st when the request is allowed (and, for
// a token bucket or GCRA, clamping a debt a lowered capacity left: see
// clampDebt). cost must already be normalized (NormalizeCost) and l valid
// (Validate). The decision's At is now. It does not allocate, except a
// SlidingLog growing its log.
func (l *Limit) Take(st *State, now int64, cost float64) Decision {
	return l.TakeKeeping(st, now, cost, 0)
}

// TakeKeeping is Take for a request that must leave keep (a fraction of
// the capacity, in [0, 1): see Request.Keep) in a token bucket or GCRA:
// it passes only while, after its spend, at least keep × capacity is
// left. A refusal that keeping nothing would have allowed is Reserved.
// The window algorithms do not read keep.
func (l *Limit) TakeKeeping(st *State, now int64, cost, keep float64) Decision {
	var d Decision
	switch l.Algorithm {
	case TokenBucket:
		d = l.takeInstant(st, now, cost, keep, false)
	case GCRA:
		d = l.takeInstant(st, now, cost, keep, true)
	case SlidingWindow:
		d = l.takeSlidingWindow(st, now, cost)
	case FixedWindow:
		d = l.takeFixedWindow(st, now, cost)
	case SlidingLog:
		d = l.takeSlidingLog(st, now, cost)
	default:
		d = Decision{Limit: l.Capacity}
	}
	d.At = now
	return d
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
		return (st.a + 999) / 1000
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

// upMicros is d ns (a whole number) in µs, rounded up, computed as the
// scripts do: Redis replies a number as an integer, truncated, so they
// reply (d + 999) / 1000. A refusal waits at least 1 ns, so 1 µs.
func upMicros(d float64) int64 {
	return int64(float64(d+999) / 1000)
}

// spendNs is how long cost takes to refill at rate, in whole ns: rounded
// down (but see floorSlack), at least 1. Rounded down, the spends of costs
// that add up to the capacity add up to at most the capacity's own
// duration, so they all pass at one instant; each spend gains the key
// less than 1 ns of refill, so a sustained rate is exact to within
// rate/(cost*1e9): 0.1% for a cost of 1 at 1e6/s.
//
// The float operations here and below are those of the Lua scripts, in the
// same order; the explicit conversions keep the compiler from fusing a
// multiply and an add, which would round differently from the scripts.
func spendNs(cost, rate float64) float64 {
	x := float64(cost*1e9) / rate
	n := math.Floor(x)
	if x > n && float64(n+1-x) <= float64(x*floorSlack) {
		n++
	}
	if n < 1 {
		n = 1
	}
	return n
}

// debtNs is the time (ns) until the token bucket or GCRA state a is full
// again at now (µs): 0 when it is full. The scripts read their stored value
// as µs and the ns within them, and compute (µs - now)*1000 + ns: below 2^53
// ns that is exact, so the same as the difference in ns.
func debtNs(a, now int64) float64 {
	if diff := a - now*1000; diff < 1<<53 {
		return math.Max(float64(diff), 0)
	}
	return float64(float64(a/1000-now)*1000) + float64(a%1000)
}

// instantAt is the state that is full again d ns (a whole number, as every
// debt here is) after now. The scripts split d into µs and ns exactly.
func instantAt(now int64, d float64) int64 {
	return now*1000 + int64(d)
}

// maxDebtNs is the most a token bucket's or GCRA's state may be ahead of
// now, full the capacity's duration: two capacities' duration and
// DebtHorizon, which is capacity + rate*DebtHorizon tokens of debt.
func maxDebtNs(full float64) float64 {
	return 2*full + debtHorizonNs
}

// debt is the time (ns) until the token bucket or GCRA st is full again at
// now, full the capacity's duration, after clampDebt.
func (l *Limit) debt(st *State, now int64, full float64) float64 {
	d := debtNs(st.a, now)
	if most := maxDebtNs(full); d > most {
		st.a = instantAt(now, most)
		return most
	}
	return d
}

// clampDebt bounds a token bucket's or a GCRA's state at now to the debt
// bound (see DebtHorizon): the instant it is full again is never more than
// maxDebtNs ahead. Takes alone never go below 0 tokens; debits may take a
// bucket down to the bound, and that debt is kept: Debit stops at the same
// bound. A state beyond it was left by a larger capacity (or a lower
// rate): a rule's capacity lowered under an active key. Clamped, it reads
// as the largest debt the new rule allows, so the key waits at most
// (cost + capacity) / rate + DebtHorizon, not the old capacity's refill
// time. The clamp is kept in st even when the request is refused: it
// changes no decision, and from there the debt refills at the rule's rate.
// The Lua scripts do the same (bucket_debt in instant.lua).
func (l *Limit) clampDebt(st *State, now int64) {
	if l.Algorithm == TokenBucket || l.Algorithm == GCRA {
		l.debt(st, now, spendNs(l.Capacity, l.RefillPerSecond))
	}
}

// takeInstant is the token bucket and GCRA: one instant, at which the
// bucket is full again; its tokens at now are capacity - (full-now)*rate,
// which is the lazy refill min(C, tokens + elapsed*rate) without a second
// field, and GCRA's theoretical arrival time. A request passes when its
// spend fits: full-now + spend(cost) <= spend(capacity), in whole ns, so
// the two algorithms admit the same requests. GCRA reports the whole
// requests of cost 1 left instead of the tokens. A request that keeps a
// reserve passes only when its spend fits in the capacity's duration less
// the reserve's, keepNs.
func (l *Limit) takeInstant(st *State, now int64, cost, keep float64, whole bool) Decision {
	rate := l.RefillPerSecond
	full := spendNs(l.Capacity, rate)
	d := l.debt(st, now, full)
	s := spendNs(cost, rate)
	if room := full - keepNs(keep, full); d+s > room {
		return Decision{
			Remaining:  l.remaining(d, full, whole),
			Limit:      l.Capacity,
			RetryAfter: micros(upMicros(float64(d+s) - room)),
			ResetAfter: micros(upMicros(d)),
			Reserved:   d+s <= full,
		}
	}
	if d+s <= full {
		d += s
		st.a = instantAt(now, d)
		return Decision{
			Allowed:    true,
			Remaining:  l.remaining(d, full, whole),
			Limit:      l.Capacity,
			ResetAfter: micros(upMicros(d)),
		}
	}
	return Decision{
		Remaining:  l.remaining(d, full, whole),
		Limit:      l.Capacity,
		RetryAfter: micros(upMicros(float64(d+s) - full)),
		ResetAfter: micros(upMicros(d)),
	}
}

// keepNs is the part (ns, a whole number) of a capacity's duration full
// that a request keeping keep of the capacity leaves: keep × full, rounded
// down, as the Lua scripts compute it (instant.lua).
func keepNs(keep, full float64) float64 {
	if !(keep > 0) {
		return 0
	}
	return math.Floor(float64(keep * full))
}

// Fits reports whether a spend of cost fits a token bucket or GCRA that is
// full again after untilFull, keeping nothing: what a request refused with
// a Keep would have been told as the most important class. The store
// makes Decision.Reserved with it from the scripts' reply.
func (l *Limit) Fits(untilFull time.Duration, cost float64) bool {
	return float64(untilFull)+spendNs(cost, l.RefillPerSecond) <= spendNs(l.Capacity, l.RefillPerSecond)
}

// Remaining is what a token bucket or GCRA that is full again after
// untilFull has left: the Remaining of its Decision, tokens, or for GCRA
// the requests of cost 1 that would pass. The Lua scripts reply untilFull
// (whole ns) instead of the remaining, which the store makes with this.
func (l *Limit) Remaining(untilFull time.Duration) float64 {
	return l.remaining(float64(untilFull), spendNs(l.Capacity, l.RefillPerSecond), l.Algorithm == GCRA)
}

// remaining is what a bucket d ns from full has left: tokens, or for GCRA
// the requests of cost 1 that would pass.
func (l *Limit) remaining(d, full float64, whole bool) float64 {
	if whole {
		return math.Max(math.Floor(float64(full-d)/spendNs(1, l.RefillPerSecond)), 0)
	}
	return math.Max(l.Capacity-float64(d*l.RefillPerSecond)/1e9, 0)
}

// micro rounds x to whole millionths: window counts and costs are counted
// in millionths of a token, so fractional costs add up without drift
// (30 costs of 0.1 are 3), exactly up to 2^53 millionths (9e9 tokens).
func micro(x float64) float64 {
	return math.Floor(float64(x*1e6)+0.5) / 1e6
}

// windowCost is what a cost counts in a window: whole millionths, at least one.
func windowCost(cost float64) float64 {
	return math.Max(micro(cost), 1e-6)
}

// windowMost is the highest count a debit leaves in a window of l (see
// DebtHorizon): limit + max(limit, limit*DebtHorizon/window).
func (l *Limit) windowMost() float64 {
	limit := micro(l.Capacity)
	return micro(limit + math.Max(limit, float64(limit*float64(DebtHorizon.Microseconds()))/float64(l.windowMicros())))
}

// logMost is the longest log a debit leaves: as windowMost, but at most
// MaxLogCapacity entries beyond the limit (each entry is a member of a
// sorted set, and a long trim blocks the store).
func (l *Limit) logMost() int {
	limit := int(l.Capacity)
	extra := math.Max(l.Capacity, math.Floor(float64(l.Capacity*float64(DebtHorizon.Microseconds()))/float64(l.windowMicros())))
	return limit + int(math.Min(extra, MaxLogCapacity))
}

// windowNow is the instant a window algorithm reads st at: now, or the
// start of st's window when that is later. The store's clock can step back
// (a failover to a node whose clock is behind, an NTP step); read at the
// earlier instant, a later window's state would count as empty and be
// rewritten under the earlier index, giving its spends back.
func (st *State) windowNow(now, w int64) int64 {
	if start := st.a * w; start > now {
		return start
	}
	return now
}

// windowCounts are the current and previous counts of window idx in st,
// in whole millionths as the scripts read them.
func (st *State) windowCounts(idx int64) (cur, prev float64) {
	switch st.a {
	case idx:
		return micro(st.b), micro(st.c)
	case idx - 1:
		return 0, micro(st.b)
	}
	return 0, 0
}

// The sliding window counter estimates the last window's count as
// previous*(1-f) + current, f the elapsed fraction of the current window.
func (l *Limit) takeSlidingWindow(st *State, now int64, cost float64) Decision {
	w := l.windowMicros()
	now = st.windowNow(now, w)
	idx := now / w
	f := float64(now-idx*w) / float64(w)
	cur, prev := st.windowCounts(idx)
	limit, cost := micro(l.Capacity), windowCost(cost)
	est := float64(prev*(1-f)) + cur
	if next := micro(est + cost); next <= limit {
		st.a, st.b, st.c = idx, micro(cur+cost), prev
		return Decision{
			Allowed:    true,
			Remaining:  math.Max(micro(limit-next), 0),
			Limit:      l.Capacity,
			ResetAfter: micros((idx+2)*w - now),
		}
	}
	var at int64
	if micro(cur+cost) <= limit {
		// Passes within this window, once the previous one weighs less.
		at = idx*w + int64(math.Ceil((1-(limit-cost-cur)/prev)*float64(w)))
	} else {
		// Passes in the next window, once this one weighs less.
		at = (idx+1)*w + int64(math.Ceil((1-(limit-cost)/cur)*float64(w)))
	}
	reset := int64(0)
	if cur > 0 {
		reset = (idx+2)*w - now
	} else if prev > 0 {
		reset = (idx+1)*w - now
	}
	return Decision{
		Remaining:  math.Max(micro(limit-est), 0),
		Limit:      l.Capacity,
		RetryAfter: micros(max(at-now, 1)),
		ResetAfter: micros(reset),
	}
}

// The fixed window counts per window aligned to the epoch.
func (l *Limit) takeFixedWindow(st *State, now int64, cost float64) Decision {
	w := l.windowMicros()
	now = st.windowNow(now, w)
	idx := now / w
	var count float64
	if st.a == idx {
		count = micro(st.b)
	}
	limit, cost := micro(l.Capacity), windowCost(cost)
	end := (idx+1)*w - now
	if next := micro(count + cost); next <= limit {
		st.a, st.b = idx, next
		return Decision{
			Allowed:    true,
			Remaining:  math.Max(micro(limit-next), 0),
			Limit:      l.Capacity,
			ResetAfter: micros(end),
		}
	}
	return Decision{
		Remaining:  math.Max(micro(limit-count), 0),
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

// Debit is DebitAt as of now: a spend admitted at this instant.
func (l *Limit) Debit(st *State, now int64, amount float64) (overshoot float64) {
	overshoot, _ = l.DebitAt(st, now, now, amount)
	return overshoot
}

// DebitAt spends amount that was admitted elsewhere (another region), the
// last of it at the instant at (µs; one after now, or not above 0, is
// now), with no
// decision, as of at. Every spend is kept, up to a debt bound (see
// DebtHorizon) that one reconcile lag of remote traffic does not reach, so
// that remote traffic, or a corrupt report, cannot block a key for long:
//   - TokenBucket, GCRA: the state moves to the spend of amount after the
//     later of the instant it is full again and at, at most to capacity +
//     rate*DebtHorizon tokens of debt; Take reads the state with the same
//     bound, so the debt is kept (see clampDebt). A state full for longer
//     than the store keeps a full key (see KeepFull) counts as full since
//     that long, as an absent key does;
//   - SlidingWindow, FixedWindow: amount joins the current window's count,
//     which stays at most limit + max(limit, limit*DebtHorizon/window),
//     unless at fell in a window that no longer counts at now (before the
//     previous one for a sliding window, before the current one for a
//     fixed window);
//   - SlidingLog: amount entries (rounded) join the log at now, up to the
//     same bound, with at most MaxLogCapacity entries beyond the limit,
//     unless at is out of the window.
//
// As of at, a spend that refilled before it arrived changes nothing, which
// is what a store that applied it at once would hold by now: changed is
// false then, and st is as it was. An amount that is not above 0 (or NaN)
// spends nothing. It returns the overshoot it finds: by how much the
// admissions known here, this state's and the debited ones, exceed the
// limit right after the debit (0 when there was room). It mirrors the Lua
// debit script, as Take mirrors the check scripts.
func (l *Limit) DebitAt(st *State, now, at int64, amount float64) (overshoot float64, changed bool) {
	if !(amount > 0) {
		return 0, false
	}
	if at <= 0 || at > now {
		at = now
	}
	rate := l.RefillPerSecond
	switch l.Algorithm {
	case TokenBucket, GCRA:
		full := spendNs(l.Capacity, rate)
		most := maxDebtNs(full)
		start := debitStart(st.a, now, at, full, most)
		overshoot = overshootOf(amount, l.Capacity-float64(start*rate)/1e9)
		d := start + spendNs(amount, rate)
		if d <= 0 {
			return overshoot, false
		}
		st.a = instantAt(now, math.Min(d, most))
	case SlidingWindow:
		w := l.windowMicros()
		if windowIndex(at, w) < windowIndex(now, w)-1 {
			return 0, false
		}
		now = st.windowNow(now, w)
		idx := now / w
		cur, prev := st.windowCounts(idx)
		f := float64(now-idx*w) / float64(w)
		overshoot = overshootOf(amount, micro(l.Capacity)-(float64(prev*(1-f))+cur))
		st.a, st.b, st.c = idx, math.Min(micro(cur+amount), l.windowMost()), prev
	case FixedWindow:
		w := l.windowMicros()
		if windowIndex(at, w) < windowIndex(now, w) {
			return 0, false
		}
		idx := st.windowNow(now, w) / w
		var count float64
		if st.a == idx {
			count = micro(st.b)
		}
		overshoot = overshootOf(amount, micro(l.Capacity)-count)
		st.a, st.b = idx, math.Min(micro(count+amount), l.windowMost())
	case SlidingLog:
		if at <= now-l.windowMicros() {
			return 0, false
		}
		st.trimLog(now - l.windowMicros())
		overshoot = overshootOf(amount, l.Capacity-float64(len(st.log)))
		k := min(int(math.Min(math.Floor(amount+0.5), float64(l.logMost()))), l.logMost()-len(st.log))
		for range k {
			st.log = insertSorted(st.log, now)
		}
	}
	return overshoot, true
}

// KeepFull is how long the Redis store keeps a token bucket's or GCRA's
// key after the instant it is full again, at most: the capacity's
// duration, up to KeepFull (lib.lua's KEEP_FULL_NS). An absent key has
// then been full for at least that long, so a remote spend that has
// refilled since it was admitted is known to change nothing (DebitAt).
const KeepFull = 10 * time.Second

// fullKeepNs is how long (ns) a full bucket whose capacity lasts full ns is
// kept (see KeepFull).
func fullKeepNs(full float64) float64 {
	return math.Min(full, float64(KeepFull/time.Nanosecond))
}

// debitStart is the instant (ns from now) a debit as of at starts from in
// the token bucket or GCRA state a: the later of the instant the bucket is
// full again, bounded (no state, or one full for longer than keepNs, full
// since keepNs ago; a debt at most most ahead), and at. It reads as the
// scripts' debit_start does.
func debitStart(a, now, at int64, full, most float64) float64 {
	keep := fullKeepNs(full)
	start := -keep
	if a != 0 {
		start = math.Max(aheadNs(a, now), -keep)
	}
	start = math.Min(start, most)
	return math.Max(start, float64((at-now)*1000))
}

// aheadNs is how far (ns) the instant the token bucket or GCRA state a is
// full again lies after now (µs): below 0 when it was full before. Read as
// the scripts read it (see debtNs).
func aheadNs(a, now int64) float64 {
	if diff := a - now*1000; diff < 1<<53 {
		return float64(diff)
	}
	return float64(float64(a/1000-now)*1000) + float64(a%1000)
}

// windowIndex is the window (of w µs) that holds the instant t.
func windowIndex(t, w int64) int64 {
	if t < 0 {
		return -((-t + w - 1) / w)
	}
	return t / w
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
