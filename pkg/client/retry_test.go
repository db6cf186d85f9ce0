package client

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"testing/synctest"
	"time"
)

func TestBackoffCeiling(t *testing.T) {
	tests := []struct {
		name    string
		b       Backoff
		attempt int
		want    time.Duration
	}{
		{"zero backoff, first retry", Backoff{}, 0, DefaultBackoffBase},
		{"zero backoff, doubles", Backoff{}, 3, 8 * DefaultBackoffBase},
		{"zero backoff, capped", Backoff{}, 20, DefaultBackoffCap},
		{"negative attempt is the first", Backoff{Base: time.Second, Cap: time.Minute}, -4, time.Second},
		{"just below the cap", Backoff{Base: time.Second, Cap: 8 * time.Second}, 3, 8 * time.Second},
		{"above the cap", Backoff{Base: time.Second, Cap: 7 * time.Second}, 3, 7 * time.Second},
		{"no overflow at 62", Backoff{Base: time.Second, Cap: time.Hour}, 62, time.Hour},
		{"no overflow at 1000", Backoff{Base: time.Second, Cap: time.Hour}, 1000, time.Hour},
		{"base above cap", Backoff{Base: time.Hour, Cap: time.Second}, 0, time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.b.Ceiling(tt.attempt); got != tt.want {
				t.Fatalf("Ceiling(%d) = %v, want %v", tt.attempt, got, tt.want)
			}
		})
	}
}

// TestBackoffDelayBounds: a delay is always within [retryAfter, retryAfter
// + min(cap, base*2^attempt)], both ends reachable, never above the cap
// without a Retry-After.
func TestBackoffDelayBounds(t *testing.T) {
	lowest := func(int64) int64 { return 0 }
	highest := func(n int64) int64 { return n - 1 }
	base := Backoff{Base: 100 * time.Millisecond, Cap: time.Second}
	tests := []struct {
		name       string
		rand       func(int64) int64
		attempt    int
		retryAfter time.Duration
		want       time.Duration // with lowest or highest; -1: random, check bounds
	}{
		{"lowest draw is 0", lowest, 2, 0, 0},
		{"highest draw is the ceiling", highest, 2, 0, 400 * time.Millisecond},
		{"highest draw capped", highest, 9, 0, time.Second},
		{"retry-after is the floor", lowest, 9, 3 * time.Second, 3 * time.Second},
		{"jitter above the retry-after", highest, 0, 3 * time.Second, 3*time.Second + 100*time.Millisecond},
		{"negative retry-after ignored", lowest, 0, -time.Second, 0},
		{"random, attempt 0", nil, 0, 0, -1},
		{"random, attempt 5", nil, 5, 0, -1},
		{"random, attempt 50", nil, 50, 0, -1},
		{"random, with retry-after", nil, 3, 2 * time.Second, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := base
			b.Rand = tt.rand
			if tt.want >= 0 {
				if got := b.Delay(tt.attempt, tt.retryAfter); got != tt.want {
					t.Fatalf("Delay = %v, want %v", got, tt.want)
				}
				return
			}
			floor := max(tt.retryAfter, 0)
			ceil := floor + b.Ceiling(tt.attempt)
			if b.Ceiling(tt.attempt) > b.Cap {
				t.Fatalf("ceiling %v above the cap %v", b.Ceiling(tt.attempt), b.Cap)
			}
			var sum time.Duration
			const n = 2000
			for range n {
				d := b.Delay(tt.attempt, tt.retryAfter)
				if d < floor || d > ceil {
					t.Fatalf("Delay = %v, outside [%v, %v]", d, floor, ceil)
				}
				sum += d - floor
			}
			// Full jitter: the mean is about half the range, not its top.
			if mean := sum / n; mean < (ceil-floor)/3 || mean > 2*(ceil-floor)/3 {
				t.Fatalf("mean jitter %v for a range of %v: not uniform", mean, ceil-floor)
			}
		})
	}
}

// TestBudget steps through fixed instants: retries are funded by a tenth of
// the successes and a floor per second, up to a maximum.
func TestBudget(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	type step struct {
		at        time.Duration // since t0
		successes int
		retries   int // attempted
		allowed   int // of which allowed
	}
	tests := []struct {
		name  string
		b     *Budget
		steps []step
	}{
		{"starts full, then exhausted", &Budget{Ratio: 0.1, MinPerSecond: 1, Max: 5}, []step{
			{at: 0, retries: 8, allowed: 5},
			{at: 0, retries: 1, allowed: 0},
		}},
		{"ten successes fund one retry", &Budget{Ratio: 0.1, MinPerSecond: 0.001, Max: 5}, []step{
			{at: 0, retries: 5, allowed: 5},
			{at: 0, successes: 9, retries: 1, allowed: 0},
			{at: 0, successes: 1, retries: 2, allowed: 1},
			{at: 0, successes: 25, retries: 3, allowed: 2},
		}},
		{"the floor refills with time", &Budget{Ratio: 0.1, MinPerSecond: 2, Max: 4}, []step{
			{at: 0, retries: 4, allowed: 4},
			{at: 500 * time.Millisecond, retries: 2, allowed: 1},
			{at: 1500 * time.Millisecond, retries: 3, allowed: 2},
			// A long pause refills only up to the maximum.
			{at: time.Hour, retries: 10, allowed: 4},
		}},
		{"successes never save more than the maximum", &Budget{Ratio: 0.5, MinPerSecond: 0.001, Max: 3}, []step{
			{at: 0, successes: 100, retries: 5, allowed: 3},
		}},
		{"a clock going back refills nothing", &Budget{Ratio: 0.1, MinPerSecond: 1, Max: 2}, []step{
			{at: time.Minute, retries: 2, allowed: 2},
			{at: 0, retries: 1, allowed: 0},
		}},
		{"zero budget: defaults", &Budget{}, []step{
			{at: 0, retries: 30, allowed: int(DefaultBudgetMax)},
			{at: 2 * time.Second, retries: 5, allowed: 2},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for i, s := range tt.steps {
				now := t0.Add(s.at)
				for range s.successes {
					tt.b.Success(now)
				}
				allowed := 0
				for range s.retries {
					if tt.b.Allow(now) {
						allowed++
					}
				}
				if allowed != s.allowed {
					t.Fatalf("step %d: %d of %d retries allowed, want %d (left %.2f)", i, allowed, s.retries, s.allowed, tt.b.Available(now))
				}
			}
		})
	}
}

func TestBudgetConcurrent(t *testing.T) {
	b := &Budget{Ratio: 0.1, MinPerSecond: 0.001, Max: 10}
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for range 10 {
		b.Allow(now)
	}
	done := make(chan int)
	for range 8 {
		go func() {
			n := 0
			for range 100 {
				b.Success(now)
				if b.Allow(now) {
					n++
				}
			}
			done <- n
		}()
	}
	total := 0
	for range 8 {
		total += <-done
	}
	// 800 successes fund 80 retries; the last few tenths may be left over.
	if total < 79 || total > 80 {
		t.Fatalf("%d retries allowed, want 80 (800 successes * 0.1)", total)
	}
}

// TestRetrierDo runs in a synctest bubble: the backoff timers fire on the
// fake clock, the test never sleeps.
func TestRetrierDo(t *testing.T) {
	errBusy := errors.New("busy")
	tests := []struct {
		name     string
		retrier  func() *Retrier
		failures int // calls that fail before one succeeds
		after    time.Duration
		wantErr  error
		calls    int
		// minElapsed is the least fake time the retries must have waited.
		minElapsed time.Duration
	}{
		{"succeeds after two retries", func() *Retrier { return &Retrier{} }, 2, 0, nil, 3, 0},
		{"gives up after MaxRetries", func() *Retrier { return &Retrier{MaxRetries: 2} }, 10, 0, errBusy, 3, 0},
		{"no retries", func() *Retrier { return &Retrier{MaxRetries: -1} }, 10, 0, errBusy, 1, 0},
		{"waits the retry-after", func() *Retrier { return &Retrier{} }, 2, 3 * time.Second, nil, 3, 6 * time.Second},
		{"budget exhausted", func() *Retrier {
			return &Retrier{MaxRetries: 10, Budget: &Budget{Max: 2, MinPerSecond: 0.0001}}
		}, 10, 0, ErrBudgetExhausted, 3, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				r := tt.retrier()
				calls := 0
				start := time.Now()
				err := r.Do(t.Context(), func(context.Context) error {
					calls++
					if calls <= tt.failures {
						return &RetryableError{Err: errBusy, After: tt.after}
					}
					return nil
				})
				if !errors.Is(err, tt.wantErr) || (tt.wantErr == nil) != (err == nil) {
					t.Fatalf("Do = %v, want %v", err, tt.wantErr)
				}
				if calls != tt.calls {
					t.Fatalf("%d calls, want %d", calls, tt.calls)
				}
				if elapsed := time.Since(start); elapsed < tt.minElapsed {
					t.Fatalf("waited %v, want at least %v", elapsed, tt.minElapsed)
				}
			})
		})
	}
}

func TestRetrierDoStopsOnContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		r := &Retrier{MaxRetries: 100}
		err := r.Do(ctx, func(context.Context) error {
			return &RetryableError{Err: errors.New("busy"), After: time.Hour}
		})
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Do = %v, want the context's error", err)
		}
	})
}

func TestRetrierNotRetryable(t *testing.T) {
	errFatal := errors.New("bad request")
	calls := 0
	err := (&Retrier{}).Do(context.Background(), func(context.Context) error {
		calls++
		return errFatal
	})
	if !errors.Is(err, errFatal) || calls != 1 {
		t.Fatalf("Do = %v after %d calls, want the error after 1", err, calls)
	}
}

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		name   string
		value  string
		want   time.Duration
		wantOK bool
	}{
		{"absent", "", 0, false},
		{"seconds", "7", 7 * time.Second, true},
		{"zero", "0", 0, true},
		{"negative", "-1", 0, false},
		{"http date", now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{"date in the past", now.Add(-time.Minute).Format(http.TimeFormat), 0, true},
		{"garbage", "soon", 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := http.Header{}
			if tt.value != "" {
				h.Set("Retry-After", tt.value)
			}
			got, ok := ParseRetryAfter(h, now)
			if got != tt.want || ok != tt.wantOK {
				t.Fatalf("ParseRetryAfter(%q) = %v, %v; want %v, %v", tt.value, got, ok, tt.want, tt.wantOK)
			}
		})
	}
}
