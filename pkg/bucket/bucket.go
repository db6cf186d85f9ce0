// Package bucket defines rate limits, the decisions they make and the stores
// that hold their state, with a pure-Go implementation of every algorithm.
//
// Time is always a parameter: the algorithms take the current instant in
// microseconds and never read a clock, so tests step through fixed instants.
// The Lua scripts in the lua directory implement the same arithmetic in the
// same order, and a conformance test holds the two to identical decisions.
package bucket

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"
)

// Algorithm names a rate limiting algorithm.
type Algorithm string

// The algorithms a Limit can use.
const (
	// TokenBucket holds up to Capacity tokens refilled at RefillPerSecond.
	// Over T seconds it admits at most Capacity + RefillPerSecond*T.
	TokenBucket Algorithm = "token_bucket"
	// GCRA is the generic cell rate algorithm: the token bucket's admission
	// kept as one theoretical arrival time, reporting whole requests left.
	GCRA Algorithm = "gcra"
	// SlidingWindow estimates the count of the last Window from the current
	// and the previous fixed window, weighting the previous one by overlap.
	SlidingWindow Algorithm = "sliding_window"
	// SlidingLog keeps the time of every admitted request of the last Window.
	// It is exact; its memory grows with Capacity, which is capped at MaxLogCapacity.
	SlidingLog Algorithm = "sliding_log"
	// FixedWindow counts per window aligned to the Unix epoch. Up to twice
	// the limit passes around a boundary: use it for daily or monthly quotas.
	FixedWindow Algorithm = "fixed_window"
)

// Algorithms lists every algorithm, in a stable order.
var Algorithms = []Algorithm{TokenBucket, GCRA, SlidingWindow, SlidingLog, FixedWindow}

// MaxLogCapacity caps the limit of a SlidingLog: every admitted request is a
// member of a sorted set, and a long trim blocks the store.
const MaxLogCapacity = 1000

// MaxRefillPerSecond is the highest refill rate of a TokenBucket or GCRA.
const MaxRefillPerSecond = 1_000_000

// MaxKeyLen is the longest client key, in bytes.
const MaxKeyLen = 512

// MinCostQuanta is the least cost, in quanta of the arithmetic of its
// limit: 1 ns of refill for a token bucket or GCRA, a millionth of a token
// in a window. A spend is rounded to whole quanta, so a cost of at least
// 100 of them is charged within 1% of itself (see Limit.MinCost).
const MinCostQuanta = 100

// Errors returned for invalid input. Callers test them with errors.Is.
var (
	// ErrInvalidCost: a cost that is not finite, not above 0, above the
	// limit's capacity, or not whole for a SlidingLog.
	ErrInvalidCost = errors.New("invalid cost")
	// ErrInvalidKey: an empty key or one longer than MaxKeyLen bytes.
	ErrInvalidKey = errors.New("invalid key")
	// ErrInvalidLimit: a Limit whose parameters cannot make decisions.
	ErrInvalidLimit = errors.New("invalid limit")
	// ErrInvalidWait: a MaxWait that is negative, above MaxWait, or set on
	// a limit whose algorithm cannot reserve (see ValidateWait).
	ErrInvalidWait = errors.New("invalid max wait")
)

// MaxWait is the longest wait a paced request may accept (Request.MaxWait).
// It is DebtHorizon: a reservation never moves a token bucket's or GCRA's
// state further ahead of now than capacity's duration plus MaxWait, which
// stays within the debt bound that reads and debits clamp to (see
// DebtHorizon), so no clamp ever drops a reservation.
const MaxWait = DebtHorizon

// ValidateWait reports, wrapping ErrInvalidWait, a wait a paced request
// under l may not accept: negative, above MaxWait, or above 0 for an
// algorithm other than TokenBucket and GCRA (a window has no exact
// reservation: its count forgets when a request was admitted, and a sliding
// log would have to log future instants).
func (l Limit) ValidateWait(wait time.Duration) error {
	switch {
	case wait < 0:
		return fmt.Errorf("%w: must be >= 0, got %v", ErrInvalidWait, wait)
	case wait > MaxWait:
		return fmt.Errorf("%w: must be at most %v, got %v", ErrInvalidWait, MaxWait, wait)
	case wait > 0 && l.Algorithm != TokenBucket && l.Algorithm != GCRA:
		return fmt.Errorf("%w: a %s limit cannot reserve: only token_bucket and gcra pace", ErrInvalidWait, l.Algorithm)
	}
	return nil
}

// Limit is the budget of one rule. The zero value is not valid: call Validate.
type Limit struct {
	// Algorithm decides how the budget is counted.
	Algorithm Algorithm
	// Capacity is the burst of a TokenBucket or GCRA and the number of
	// tokens per Window of the window algorithms (counted in whole
	// millionths of a token).
	Capacity float64
	// RefillPerSecond is the refill rate of a TokenBucket or GCRA (> 0).
	RefillPerSecond float64
	// Window is the length of a window (at least a millisecond).
	Window time.Duration
}

// Validate reports whether l can make decisions; its errors wrap ErrInvalidLimit.
func (l Limit) Validate() error {
	if !finitePositive(l.Capacity) {
		return limitErr("capacity", "capacity must be finite and > 0, got %v", l.Capacity)
	}
	switch l.Algorithm {
	case TokenBucket, GCRA:
		if !finitePositive(l.RefillPerSecond) {
			return limitErr("refill_per_second", "refill_per_second must be finite and > 0, got %v", l.RefillPerSecond)
		}
		// A spend is charged its duration rounded down to the ns, so a
		// rate is exact to within rate/(cost*1e9): 0.1% for a unit cost
		// at the highest rate. And a bucket must fill within about three
		// years, its longest expiry.
		if l.RefillPerSecond > MaxRefillPerSecond {
			return limitErr("refill_per_second", "refill_per_second must be at most %g, got %v", float64(MaxRefillPerSecond), l.RefillPerSecond)
		}
		if l.Capacity/l.RefillPerSecond > 1e8 {
			return limitErr("refill_per_second", "refill_per_second %v fills capacity %v in over 1e8 seconds", l.RefillPerSecond, l.Capacity)
		}
		if l.Window != 0 {
			return limitErr("window", "window is not a parameter of %s", l.Algorithm)
		}
	case SlidingWindow, SlidingLog, FixedWindow:
		if l.Window < time.Millisecond || l.Window%time.Microsecond != 0 {
			return limitErr("window", "window must be a whole number of microseconds, at least 1ms, got %v", l.Window)
		}
		if l.Window > 366*24*time.Hour {
			return limitErr("window", "window must be at most 366 days, got %v", l.Window)
		}
		if l.RefillPerSecond != 0 {
			return limitErr("refill_per_second", "refill_per_second is not a parameter of %s", l.Algorithm)
		}
		if l.Algorithm == SlidingLog && (l.Capacity > MaxLogCapacity || l.Capacity != math.Trunc(l.Capacity)) {
			return limitErr("capacity", "a sliding_log limit must be a whole number up to %d, got %v", MaxLogCapacity, l.Capacity)
		}
	case "":
		return limitErr("algorithm", "algorithm is empty")
	default:
		return limitErr("algorithm", "unknown algorithm %q", string(l.Algorithm))
	}
	return nil
}

// MinCost is the least cost a request may spend under l: MinCostQuanta
// quanta of its arithmetic (100 ns of refill, 1e-4 of a token in a
// window, 1 for a sliding log), so that no cost is charged more than 1%
// under what it asks (at 1e6 tokens/s, a cost of 0.0019 would be charged
// 0.001). It is at most 1 for every valid limit.
func (l Limit) MinCost() float64 {
	switch l.Algorithm {
	case TokenBucket, GCRA:
		return MinCostQuanta * l.RefillPerSecond / 1e9
	case SlidingLog:
		return 1
	}
	return MinCostQuanta * 1e-6
}

// NormalizeCost returns the cost a request spends under l: 0 means 1. It
// rejects, wrapping ErrInvalidCost, a cost that is NaN, infinite, negative,
// below MinCost (it would be charged less than it asks), above the
// capacity (it could never pass) or, for a SlidingLog, not whole.
func (l Limit) NormalizeCost(cost float64) (float64, error) {
	if cost == 0 {
		cost = 1
	}
	// Written so that NaN fails: every comparison with NaN is false.
	if !(cost > 0) || math.IsInf(cost, 0) {
		return 0, fmt.Errorf("%w: cost must be finite and > 0, got %v", ErrInvalidCost, cost)
	}
	if least := l.MinCost(); cost < least && l.Algorithm != SlidingLog {
		return 0, fmt.Errorf("%w: cost %v is below %v, the least this limit charges within 1%% (a spend counts in whole quanta: 1 ns of refill, or a millionth of a token in a window)", ErrInvalidCost, cost, least)
	}
	if cost > l.Capacity {
		return 0, fmt.Errorf("%w: cost %v is above the capacity %v and could never pass", ErrInvalidCost, cost, l.Capacity)
	}
	if l.Algorithm == SlidingLog && cost != math.Trunc(cost) {
		return 0, fmt.Errorf("%w: a sliding_log cost must be whole, got %v", ErrInvalidCost, cost)
	}
	return cost, nil
}

// ValidateKey reports, wrapping ErrInvalidKey, a key that is empty or longer
// than MaxKeyLen bytes.
func ValidateKey(key string) error {
	if key == "" {
		return fmt.Errorf("%w: key is empty", ErrInvalidKey)
	}
	if len(key) > MaxKeyLen {
		return fmt.Errorf("%w: key is %d bytes, the maximum is %d", ErrInvalidKey, len(key), MaxKeyLen)
	}
	return nil
}

// LimitError is the error of Validate: which field of a Limit is wrong and
// why. It wraps ErrInvalidLimit.
type LimitError struct {
	// Field is the rule file's name of the field: capacity,
	// refill_per_second, window or algorithm.
	Field string
	Msg   string
}

func (e *LimitError) Error() string { return fmt.Sprintf("%v: %s", ErrInvalidLimit, e.Msg) }

// Unwrap returns ErrInvalidLimit.
func (e *LimitError) Unwrap() error { return ErrInvalidLimit }

func limitErr(field, format string, args ...any) error {
	return &LimitError{Field: field, Msg: fmt.Sprintf(format, args...)}
}

func finitePositive(f float64) bool { return f > 0 && !math.IsInf(f, 0) }

// Decision is the answer to one check. A rejection is a Decision with
// Allowed false, not an error.
type Decision struct {
	// Allowed reports whether the cost was spent.
	Allowed bool
	// Remaining is what is left after the decision, never negative.
	Remaining float64
	// Limit is the limit's Capacity.
	Limit float64
	// RetryAfter is, when rejected, how long until the same cost can pass
	// (> 0); 0 when allowed.
	RetryAfter time.Duration
	// ResetAfter is how long until the bucket is full or the window clear.
	ResetAfter time.Duration
	// Wait is, for an allowed paced request (Request.MaxWait > 0), how long
	// the caller must wait before it sends: its reserved slot (rounded up
	// to the µs, never early). 0 when it may send now.
	Wait time.Duration
	// Reservation is, for an allowed paced request, the bucket's state its
	// spend left (the instant, ns since the Unix epoch, at which the bucket
	// is full again), which names the reservation to give it back (see
	// Unreserver); 0 otherwise.
	Reservation int64
	// At is the instant the store decided at, by its own clock (µs since
	// the Unix epoch): the instant an Undo of this spend names, so that a
	// window rule gives back to the window the spend counted in. 0 when
	// the decision came from no store (a lease, a fallback, a denial).
	At int64
	// Reserved reports a refusal caused only by the request's Keep: with
	// nothing to keep (as the most important priority class) it would
	// have been allowed. Its RetryAfter is how long until the request fits
	// above what it keeps.
	Reserved bool
}

// Request is one check: spend Cost of Limit from the bucket of Key under Rule.
type Request struct {
	// Rule is the rule's id; with Key it names the bucket.
	Rule string
	// Key is the client the rule counts against.
	Key string
	// Limit is the rule's budget.
	Limit Limit
	// Cost is the number of tokens to spend, already normalized.
	Cost float64
	// MaxWait, when above 0, makes the request paced: instead of being
	// refused, it reserves the next slot within MaxWait and is allowed with
	// Decision.Wait. Only a TokenBucket or GCRA paces (ValidateWait). The
	// requests of one TakeAll share one MaxWait (the smallest counts).
	MaxWait time.Duration
	// Keep, a fraction of the capacity in [0, 1), is what the request must
	// leave in a TokenBucket or GCRA: the headroom reserved for priority
	// classes above the request's. It passes only while, after its spend,
	// at least Keep × Capacity is left (see Limit.TakeKeeping). 0 keeps
	// nothing. The window algorithms and paced requests do not read it.
	Keep float64
}

// Errors a Store returns when it could not decide. Callers test them with
// errors.Is; any other error of a Store means the request was not applied
// (nothing was spent), so a fallback may decide it.
var (
	// ErrOverloaded: the request waited in the store client's own queue
	// longer than allowed and was never sent. Nothing was spent; the
	// caller is overloaded, not the store.
	ErrOverloaded = errors.New("store client overloaded: request not sent")
	// ErrOutcomeUnknown: the request was sent but no reply came in time.
	// It may have been applied, so deciding it again elsewhere could count
	// it twice.
	ErrOutcomeUnknown = errors.New("store reply not received in time: outcome unknown")
)

// MultiError is the error of a TakeAll that decided some requests and not
// others. Errs[i] is nil for a request that was decided, whose decision is
// then in the decisions returned beside it; otherwise it is that request's
// error. A decided request that was refused refuses the whole check.
type MultiError struct {
	Errs []error
}

func (e *MultiError) Error() string {
	failed, first := 0, error(nil)
	for _, err := range e.Errs {
		if err != nil {
			if first == nil {
				first = err
			}
			failed++
		}
	}
	return fmt.Sprintf("%d of %d requests not decided: %v", failed, len(e.Errs), first)
}

// Unwrap returns the errors of the requests not decided, so errors.Is
// finds ErrOutcomeUnknown or ErrOverloaded among them.
func (e *MultiError) Unwrap() []error {
	var errs []error
	for _, err := range e.Errs {
		if err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}

// Store decides requests against state it holds. Implementations are safe
// for concurrent use. Take returns an error only when it could not decide.
type Store interface {
	Take(ctx context.Context, req Request) (Decision, error)
}

// MultiStore decides several requests of one check together, all or
// nothing: when any is refused, none spends. Requests must name distinct
// (Rule, Key) buckets. The decisions are in the order of the requests, each
// the verdict of its own bucket. When some requests could not be decided
// the error is a *MultiError and the decisions hold those of the others.
type MultiStore interface {
	Store
	TakeAll(ctx context.Context, reqs []Request) ([]Decision, error)
}

// Backend is a shared store as a limiter uses it: it decides checks, one
// or several at once (MultiStore), gives back spends (Undoer) and paced
// reservations (Unreserver), hands buckets off to a key's new home region
// (HandoffStore), holds concurrency leases (LeaseStore), tells what a
// check would see without spending (Usager), settles estimates with their
// actual costs (Settler) and puts buckets back to full (Resetter). Memory
// is one; so is the Redis store.
type Backend interface {
	MultiStore
	Undoer
	Unreserver
	Settler
	HandoffStore
	LeaseStore
	Usager
	Resetter
}

// Resetter puts buckets back to full: the bucket of each request's (Rule,
// Key) forgets every spend, debt and paced reservation, as if it had never
// been used; the requests' Limit and Cost are not read. Resetting a bucket
// that holds nothing does nothing. Implementations are safe for concurrent
// use.
type Resetter interface {
	Reset(ctx context.Context, reqs []Request) error
}

// Unreserver is a Store that can give back the spend of a paced request
// (Request.MaxWait) that will not be sent, named by its
// Decision.Reservation. It gives it back only while the bucket's state is
// still the one that reservation left: no later spend (another
// reservation stacked behind it, a check, a debit) has moved it. Then the
// state moves back by the spend, never before now, and the next request
// gets the slot. Otherwise it gives back nothing and reports false: the
// slot stays unused (the rate stays under the limit, never above), since
// giving it back would free the last slot reserved, which someone else
// holds.
type Unreserver interface {
	Unreserve(ctx context.Context, req Request, reservation int64) (bool, error)
}
