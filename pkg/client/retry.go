package client

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Defaults of Backoff and Budget.
const (
	DefaultBackoffBase = 100 * time.Millisecond
	DefaultBackoffCap  = 20 * time.Second
	// DefaultBudgetRatio funds one retry per ten successes.
	DefaultBudgetRatio = 0.1
	// DefaultBudgetMinPerSecond is the floor: retries always allowed per
	// second, so that a client with few successes can still retry.
	DefaultBudgetMinPerSecond = 1.0
	// DefaultBudgetMax bounds the retries saved up, hence the burst of
	// retries when everything starts failing at once.
	DefaultBudgetMax = 20.0
	// DefaultMaxRetries bounds Retrier.Do.
	DefaultMaxRetries = 3
)

// Backoff computes full-jitter delays: before retry number attempt (0 for
// the first retry), uniform(0, min(Cap, Base*2^attempt)). When the server
// said Retry-After, that is the floor and the jitter is added to it, so that
// clients told the same Retry-After still spread out.
//
// The zero Backoff uses DefaultBackoffBase and DefaultBackoffCap. A Backoff
// is safe for concurrent use when Rand is (the default is).
type Backoff struct {
	// Base is the first retry's largest delay.
	Base time.Duration
	// Cap bounds the jitter's range.
	Cap time.Duration
	// Rand returns a uniform integer in [0, n); nil: math/rand/v2.Int64N.
	Rand func(n int64) int64
}

// Ceiling is the largest jittered delay of retry number attempt:
// min(Cap, Base*2^attempt).
func (b Backoff) Ceiling(attempt int) time.Duration {
	base, limit := b.Base, b.Cap
	if base <= 0 {
		base = DefaultBackoffBase
	}
	if limit <= 0 {
		limit = DefaultBackoffCap
	}
	if base >= limit {
		return limit
	}
	attempt = max(attempt, 0)
	// base*2^attempt <= limit without overflowing.
	if attempt >= 63 || base > limit>>attempt {
		return limit
	}
	return base << attempt
}

// Delay is the wait before retry number attempt: uniform in [0, Ceiling],
// plus retryAfter when the server gave one (> 0).
func (b Backoff) Delay(attempt int, retryAfter time.Duration) time.Duration {
	ceil := b.Ceiling(attempt)
	rnd := b.Rand
	if rnd == nil {
		rnd = rand.Int64N
	}
	d := time.Duration(rnd(int64(ceil) + 1))
	return max(retryAfter, 0) + d
}

// Budget limits retries to a share of successes, like a token bucket: each
// success deposits Ratio of a retry, each retry withdraws one, and
// MinPerSecond retries a second are deposited whatever happens, up to Max
// saved. When the callee is down nothing succeeds, so retries fall to the
// floor instead of multiplying the load (a retry storm).
//
// The zero Budget uses the defaults and starts full. A Budget is safe for
// concurrent use; set its fields before first use and do not change them.
// Time is a parameter: pass time.Now() (tests pass fixed instants).
type Budget struct {
	// Ratio is the retries earned by one success (default 0.1).
	Ratio float64
	// MinPerSecond is the floor of retries a second (default 1).
	MinPerSecond float64
	// Max is the most retries saved up (default 20).
	Max float64

	mu     sync.Mutex
	tokens float64
	last   time.Time
	init   bool
}

func (b *Budget) params() (ratio, floor, most float64) {
	ratio, floor, most = b.Ratio, b.MinPerSecond, b.Max
	if ratio <= 0 {
		ratio = DefaultBudgetRatio
	}
	if floor <= 0 {
		floor = DefaultBudgetMinPerSecond
	}
	if most <= 0 {
		most = DefaultBudgetMax
	}
	return ratio, floor, most
}

// refill adds the floor's deposits since the last call. The caller holds mu.
func (b *Budget) refill(now time.Time, floor, most float64) {
	if !b.init {
		b.init, b.tokens, b.last = true, most, now
		return
	}
	if now.After(b.last) {
		b.tokens = min(most, b.tokens+now.Sub(b.last).Seconds()*floor)
		b.last = now
	}
}

// Success records a success at now, which funds Ratio of a retry.
func (b *Budget) Success(now time.Time) {
	ratio, floor, most := b.params()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(now, floor, most)
	b.tokens = min(most, b.tokens+ratio)
}

// Allow reports whether a retry at now fits the budget, and spends it if so.
func (b *Budget) Allow(now time.Time) bool {
	_, floor, most := b.params()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(now, floor, most)
	// Ten deposits of 0.1 add up to 0.9999999999999999.
	if b.tokens < 1-1e-9 {
		return false
	}
	b.tokens = max(0, b.tokens-1)
	return true
}

// Available is the number of retries the budget would allow at now.
func (b *Budget) Available(now time.Time) float64 {
	_, floor, most := b.params()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(now, floor, most)
	return b.tokens
}

// RetryableError marks an error worth retrying, such as an HTTP 429 or 503,
// after at least After (the server's Retry-After; 0 when it gave none).
type RetryableError struct {
	Err   error
	After time.Duration
}

func (e *RetryableError) Error() string { return e.Err.Error() }
func (e *RetryableError) Unwrap() error { return e.Err }

// ErrBudgetExhausted wraps the last error when Retrier.Do stopped because
// the retry budget had nothing left.
var ErrBudgetExhausted = errors.New("retry budget exhausted")

// Retrier retries a call with Backoff's delays within Budget.
//
// The zero Retrier retries up to DefaultMaxRetries times with the zero
// Backoff and no budget. A Retrier is safe for concurrent use (a shared
// Budget is the point: it sees every call's successes and retries).
type Retrier struct {
	Backoff Backoff
	// Budget, when set, must allow each retry; successes fund it.
	Budget *Budget
	// MaxRetries bounds the retries of one call (0: DefaultMaxRetries;
	// negative: none).
	MaxRetries int
}

// Do calls fn until it returns nil or an error that is not a
// *RetryableError, MaxRetries is reached, the budget refuses a retry (the
// error then wraps ErrBudgetExhausted) or ctx ends. It returns fn's last
// error.
func (r *Retrier) Do(ctx context.Context, fn func(context.Context) error) error {
	most := r.MaxRetries
	if most == 0 {
		most = DefaultMaxRetries
	}
	for attempt := 0; ; attempt++ {
		err := fn(ctx)
		if err == nil {
			if r.Budget != nil {
				r.Budget.Success(time.Now())
			}
			return nil
		}
		var re *RetryableError
		if !errors.As(err, &re) || attempt >= most {
			return err
		}
		if r.Budget != nil && !r.Budget.Allow(time.Now()) {
			return fmt.Errorf("%w: %w", ErrBudgetExhausted, err)
		}
		t := time.NewTimer(r.Backoff.Delay(attempt, re.After))
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w: %w", ctx.Err(), err)
		case <-t.C:
		}
	}
}

// ParseRetryAfter reads a Retry-After header: delay-seconds or an HTTP
// date, relative to now. ok is false when the header is absent or invalid.
func ParseRetryAfter(h http.Header, now time.Time) (d time.Duration, ok bool) {
	v := strings.TrimSpace(h.Get("Retry-After"))
	if v == "" {
		return 0, false
	}
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil {
		if secs < 0 || secs > int64(365*24*time.Hour/time.Second) {
			return 0, false
		}
		return time.Duration(secs) * time.Second, true
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	return max(t.Sub(now), 0), true
}
