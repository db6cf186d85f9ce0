package bucket

import (
	"math"
	"time"
)

// Paced requests: GCRA with a bounded delay, the counter form of a leaky
// bucket as a queue. A request of spend s (its cost's duration, whole ns)
// on a bucket d ns from full, full the capacity's duration, fits now when
// d + s <= full; otherwise it waits w = d + s - full, the instant at which
// it fits. When w <= MaxWait it is allowed with that wait and reserves its
// slot: the state moves to d + s, as if it had been sent at now + w. The
// state therefore runs ahead of now by at most full + MaxWait, and every
// caller of every process sends at the rule's rate: the reservations are
// spaced by their spends, exactly, in whole ns.
//
// Several rules of one request (all or nothing) reserve at one instant:
// the wait W is the largest of their waits, and each rule counts its spend
// at now + W, where its debt is max(d - W, 0): its state moves to
// max(d, W) + s. A rule whose own wait is shorter than W therefore counts
// the spend when it is sent, not earlier (its bucket refilled meanwhile,
// up to full, and no further). When any rule's wait is beyond MaxWait, the
// request is refused and nothing is spent; its retry is how long until the
// same request fits within its MaxWait: w - MaxWait.
//
// The Lua script reserve_main.lua does the same arithmetic in the same
// order; the conformance test holds the two to identical decisions.

// reservePlan is what a rule of a paced request found at now.
type reservePlan struct {
	d, s, full float64
}

// wait is the plan's own wait (ns), <= 0 when it fits now.
func (p reservePlan) wait() float64 { return float64(p.d+p.s) - p.full }

// plan reads st at now for a paced request of cost (clampDebt included).
func (l *Limit) plan(st *State, now int64, cost float64) reservePlan {
	full := spendNs(l.Capacity, l.RefillPerSecond)
	return reservePlan{d: l.debt(st, now, full), s: spendNs(cost, l.RefillPerSecond), full: full}
}

// reserveAll decides paced requests together at now, each of cost[i]
// under ls[i] on sts[i], within maxWait (ns): all or nothing. It updates
// the states only when all are allowed.
func reserveAll(ls []*Limit, sts []*State, now int64, costs []float64, maxWait float64, out []Decision) bool {
	plans := make([]reservePlan, len(ls))
	W, all := 0.0, true
	for i, l := range ls {
		plans[i] = l.plan(sts[i], now, costs[i])
		w := plans[i].wait()
		if w > maxWait {
			all = false
		} else {
			W = math.Max(W, w)
		}
	}
	for i, l := range ls {
		p, whole := plans[i], l.Algorithm == GCRA
		w := p.wait()
		if w > maxWait {
			out[i] = Decision{
				Remaining:  l.remaining(p.d, p.full, whole),
				Limit:      l.Capacity,
				RetryAfter: micros(upMicros(w - maxWait)),
				ResetAfter: micros(upMicros(p.d)),
			}
			continue
		}
		if !all {
			// Fits alone; another rule refused: nothing is spent.
			d := p.d + p.s
			out[i] = Decision{
				Allowed:    true,
				Remaining:  l.remaining(d, p.full, whole),
				Limit:      l.Capacity,
				ResetAfter: micros(upMicros(d)),
			}
			continue
		}
		d := math.Max(p.d, W) + p.s
		sts[i].a = instantAt(now, d)
		out[i] = Decision{
			Allowed:     true,
			Remaining:   l.remaining(d, p.full, whole),
			Limit:       l.Capacity,
			ResetAfter:  micros(upMicros(d)),
			Wait:        micros(upMicros(W)),
			Reservation: sts[i].a,
		}
	}
	for i := range out[:len(ls)] {
		out[i].At = now
	}
	return all
}

// Reserve decides a paced request of cost under l at now (µs), waiting at
// most maxWait: allowed with Decision.Wait when its slot comes within
// maxWait, refused (spending nothing) otherwise. With maxWait 0 it is
// Take. l must be a valid TokenBucket or GCRA, cost normalized and maxWait
// valid (ValidateWait).
func (l *Limit) Reserve(st *State, now int64, cost float64, maxWait time.Duration) Decision {
	if maxWait <= 0 {
		return l.Take(st, now, cost)
	}
	var out [1]Decision
	reserveAll([]*Limit{l}, []*State{st}, now, []float64{cost}, float64(maxWait), out[:])
	return out[0]
}

// Unreserve gives back, at now (µs), the spend of cost that a Reserve left
// as reservation (its Decision.Reservation), when st is still that state;
// it reports whether it gave anything back. The state moves back by the
// spend, never before now (the Undo of a token bucket).
func (l *Limit) Unreserve(st *State, now int64, reservation int64, cost float64) bool {
	if st.a != reservation || st.a <= now*1000 {
		return false
	}
	d := l.debt(st, now, spendNs(l.Capacity, l.RefillPerSecond))
	st.a = instantAt(now, math.Max(d-spendNs(cost, l.RefillPerSecond), 0))
	return true
}
