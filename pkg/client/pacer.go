package client

import (
	"context"
	"errors"
	"time"
)

// DefaultPacerMaxWait is the longest wait a Pacer's check accepts when
// PacerOptions.MaxWait is 0.
const DefaultPacerMaxWait = time.Second

// MaxPacerWait is the longest wait one paced check may accept (limiterd's
// bound, bucket.MaxWait); a Pacer waits longer by checking again.
const MaxPacerWait = 10 * time.Second

// ErrInvalidPacer is the error of Wait on a Pacer made with options out of
// bounds.
var ErrInvalidPacer = errors.New("invalid pacer options")

// PacerOptions configure a Pacer.
type PacerOptions struct {
	// Cost is what each call spends (0: 1).
	Cost float64
	// MaxWait is the longest wait one check reserves (0:
	// DefaultPacerMaxWait; at most MaxPacerWait). A longer queue is waited
	// out in several checks, each retrying when the last one's refusal
	// says. A shorter MaxWait reserves less far ahead: less to give back
	// when a Wait is cancelled.
	MaxWait time.Duration
}

// Pacer makes its callers, in every process of a fleet, send at exactly a
// rule's rate: Wait reserves the next slot of the rule's token bucket or
// GCRA in limiterd and sleeps until it. Use it when the limit is someone
// else's (a partner's API, an SMS provider): being refused is the wrong
// answer there; being told when to send is the right one.
//
// A Pacer is safe for concurrent use. The zero Pacer is not usable: make
// one with NewPacer.
type Pacer struct {
	c         *Client
	rule, key string
	opts      PacerOptions
	// timer is a sleep that ctx cuts short (a test's hook).
	timer func(ctx context.Context, d time.Duration) error
}

// NewPacer returns a Pacer of the token bucket or GCRA rule rule for key,
// checking through c.
func NewPacer(c *Client, rule, key string, opts PacerOptions) *Pacer {
	if opts.MaxWait == 0 {
		opts.MaxWait = DefaultPacerMaxWait
	}
	return &Pacer{c: c, rule: rule, key: key, opts: opts, timer: sleep}
}

// Wait blocks until the caller may send one call. It checks with the
// pacer's MaxWait (or what is left of ctx's deadline, when that is
// shorter); when allowed it sleeps the answered wait_ms and returns nil.
// When refused beyond the wait it sleeps retry_after_ms and checks again,
// for as long as ctx allows.
//
// When ctx ends during the sleep, Wait gives its reservation back
// (CancelReservation) and returns ctx's error. The slot comes back only if
// no later reservation is stacked behind it (the latest caller's, or a
// lone caller's); otherwise it stays unused: the rule's rate is then
// under the limit for one slot, never above it. A reservation decided in
// another region (a pinned rule) or in limiterd's fallback is never given
// back. Errors: ctx's, ErrInvalidPacer, and those of Client.Check
// (ErrUnreachable, a gRPC status).
func (p *Pacer) Wait(ctx context.Context) error {
	if p.opts.MaxWait < 0 || p.opts.MaxWait > MaxPacerWait {
		return ErrInvalidPacer
	}
	for {
		maxWait := p.opts.MaxWait
		if dl, ok := ctx.Deadline(); ok {
			maxWait = min(maxWait, time.Until(dl))
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if maxWait < time.Millisecond {
			// Less than a slot's resolution left: wait out the deadline.
			<-ctx.Done()
			return ctx.Err()
		}
		resp, err := p.c.CheckPaced(ctx, p.rule, p.key, p.opts.Cost, maxWait.Truncate(time.Millisecond))
		if err != nil {
			return err
		}
		if !resp.GetAllowed() {
			if err := p.timer(ctx, time.Duration(max(resp.GetRetryAfterMs(), 1))*time.Millisecond); err != nil {
				return err
			}
			continue
		}
		if err := p.timer(ctx, time.Duration(resp.GetWaitMs())*time.Millisecond); err != nil {
			if r := resp.GetReservation(); r != "" {
				cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.c.cancelTimeout())
				_, _ = p.c.CancelReservation(cctx, r)
				cancel()
			}
			return err
		}
		return nil
	}
}

// cancelTimeout bounds a reservation's give-back, which runs after the
// caller's context ended.
func (c *Client) cancelTimeout() time.Duration {
	if c.timeout > 0 {
		return c.timeout
	}
	return DefaultTimeout
}

// sleep waits d, or until ctx ends (its error).
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
