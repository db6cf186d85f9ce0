package bucket

import (
	"errors"
	"fmt"
	"time"
)

// Bounds of an adaptive concurrency limit and of the samples that move it.
const (
	// MinTargetLatency is the least target latency of an adaptive limit;
	// the most is the rule's lease length (a request longer than its
	// lease has lost its slot).
	MinTargetLatency = time.Millisecond
	// MaxSampleDuration is the longest duration a release may report.
	MaxSampleDuration = 24 * time.Hour
	// AdaptiveTTL is how long a key's adaptive limit is kept after the
	// last sample that moved it; past it the key starts again from the
	// rule's limit.
	AdaptiveTTL = time.Hour
)

// ErrInvalidSample: a release reported a duration out of bounds.
var ErrInvalidSample = errors.New("invalid latency sample")

// Adaptive makes a concurrency limit follow the latencies its callers
// report when they release, by additive increase and multiplicative
// decrease (AIMD), the loss-based limit of Netflix's concurrency-limits
// (AIMDLimit) paced as TCP's congestion avoidance:
//
//   - a sample over Target, or of a request that failed, multiplies the
//     limit by 9/10, rounded down (so by at least one below 10), as
//     AIMDLimit's backoff; but at most once per window of requests, as TCP
//     reacts to congestion (RFC 3168, 6.1.2): a request that started before
//     the last cut saw the overload that cut already answered;
//   - a sample at or under Target of a request that did not fail, released
//     while at least half the limit was in use (AIMDLimit's guard against
//     growing while callers use little of it), counts towards one more:
//     the limit grows by one when as many such samples as the limit came
//     since the last change, one per window as in RFC 5681, 3.1 (cwnd +=
//     1/cwnd per ACK), where AIMDLimit adds one per sample.
//
// The limit stays within [Min, Max]. The zero value is off: the limit is
// fixed.
type Adaptive struct {
	Min, Max int
	// Target is the latency above which a sample says the backend is
	// overloaded.
	Target time.Duration
}

// On reports whether the limit adapts.
func (a Adaptive) On() bool { return a.Max > 0 }

// validate checks a against a rule whose lease length is ttl; its errors
// are a *LimitError naming adaptive.min, adaptive.max or
// adaptive.target_latency.
func (a Adaptive) validate(ttl time.Duration) error {
	switch {
	case a.Min < 1 || a.Min > MaxConcurrency:
		return limitErr("adaptive.min", "adaptive.min must be a whole number from 1 to %d, got %d", MaxConcurrency, a.Min)
	case a.Max < a.Min || a.Max > MaxConcurrency:
		return limitErr("adaptive.max", "adaptive.max must be a whole number from adaptive.min (%d) to %d, got %d", a.Min, MaxConcurrency, a.Max)
	case a.Target < MinTargetLatency || a.Target > ttl || a.Target%time.Millisecond != 0:
		return limitErr("adaptive.target_latency", "adaptive.target_latency must be a whole number of milliseconds from %v to lease_ttl (%v), got %v", MinTargetLatency, ttl, a.Target)
	}
	return nil
}

// clamp is n within [a.Min, a.Max].
func (a Adaptive) clamp(n int) int { return min(a.Max, max(a.Min, n)) }

// AdaptiveState is a key's adaptive limit.
type AdaptiveState struct {
	// Limit is the key's limit.
	Limit int
	// Cut is the instant (µs) of its last cut, 0 for none.
	Cut int64
	// Good counts the samples towards one more since the last change.
	Good int
}

// Next is st after a sample s of a request released at now (µs) while
// inFlight leases (it included) were held.
func (a Adaptive) Next(st AdaptiveState, now int64, inFlight int, s LeaseSample) AdaptiveState {
	st.Limit = a.clamp(st.Limit)
	d := s.Duration.Microseconds()
	switch {
	case s.Failed || d > a.Target.Microseconds():
		if now-d >= st.Cut {
			st = AdaptiveState{Limit: a.clamp(st.Limit * 9 / 10), Cut: now}
		}
	case 2*inFlight >= st.Limit:
		st.Good++
		if st.Good >= st.Limit {
			st.Limit, st.Good = a.clamp(st.Limit+1), 0
		}
	}
	return st
}

// LeaseSample is what a caller reports of a request when it releases its
// lease: how long it took, and whether it failed.
type LeaseSample struct {
	Duration time.Duration
	Failed   bool
}

// Validate reports whether s can move a limit; its error wraps
// ErrInvalidSample.
func (s LeaseSample) Validate() error {
	if s.Duration < 0 || s.Duration > MaxSampleDuration {
		return fmt.Errorf("%w: a duration must be from 0 to %v, got %v", ErrInvalidSample, MaxSampleDuration, s.Duration)
	}
	return nil
}

// limit is the limit of an Acquire under l at now: l's own, or the key's
// adaptive limit while it is kept, else l.Limit within the adaptive range.
func (s *Leases) limit(now int64, l LeaseLimit) int {
	if !l.Adaptive.On() {
		return l.Limit
	}
	if s.adaptiveExp > now {
		return l.Adaptive.clamp(s.adaptive.Limit)
	}
	return l.Adaptive.clamp(l.Limit)
}

// sample moves the key's adaptive limit by s, a sample of a lease released
// at now while inFlight leases (it included) were held.
func (s *Leases) sample(now int64, l LeaseLimit, inFlight int, sm *LeaseSample) {
	if !l.Adaptive.On() || sm == nil {
		return
	}
	st := AdaptiveState{Limit: l.Limit}
	if s.adaptiveExp > now {
		st = s.adaptive
	}
	s.adaptive = l.Adaptive.Next(st, now, inFlight, *sm)
	s.adaptiveExp = now + AdaptiveTTL.Microseconds()
}
