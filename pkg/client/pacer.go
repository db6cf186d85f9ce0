package client

import (
	"context"
	"errors"
	"sync/atomic"
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
	// MaxLate, when above 0, bounds how late after its slot a call may
	// leave. A slot is known to within the check's round trip (its wait
	// counts from the store's decision, somewhere between the check's send
	// and its answer) plus the rounding of wait_ms (1 ms); when the time
	// Wait returns may be more than MaxLate after the slot (a slow answer,
	// a process descheduled past its timer), Wait gives the slot up and
	// reserves again: the slot stays unused and the call does not bunch
	// with the next ones. Set it below the rule's spacing (cost / rate) to
	// keep the partner's every window within the rule: a window then holds
	// at most the slots of a window MaxLate longer. It must exceed the
	// round trip plus 1 ms, or every slot is given up: leave it 0 (off)
	// for a rule pinned to another region.
	MaxLate time.Duration
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
	missed    atomic.Int64
}

// Missed is the number of slots Wait gave up because it could not keep
// them within MaxLate.
func (p *Pacer) Missed() int64 { return p.missed.Load() }

// NewPacer returns a Pacer of the token bucket or GCRA rule rule for key,
// checking through c.
func NewPacer(c *Client, rule, key string, opts PacerOptions) *Pacer {
	if opts.MaxWait == 0 {
		opts.MaxWait = DefaultPacerMaxWait
	}
	return &Pacer{c: c, rule: rule, key: key, opts: opts}
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
	if p.opts.MaxWait < 0 || p.opts.MaxWait > MaxPacerWait || p.opts.MaxLate < 0 {
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
		sent := time.Now()
		resp, err := p.c.CheckPaced(ctx, p.rule, p.key, p.opts.Cost, maxWait.Truncate(time.Millisecond))
		if err != nil {
			return err
		}
		if !resp.GetAllowed() {
			if err := sleep(ctx, time.Duration(max(resp.GetRetryAfterMs(), 1))*time.Millisecond); err != nil {
				return err
			}
			continue
		}
		// Never early: the answer came after the store decided.
		wait := time.Duration(resp.GetWaitMs()) * time.Millisecond
		if err := sleep(ctx, wait); err != nil {
			p.cancel(ctx, resp.GetReservation())
			return err
		}
		// The slot is at least sent + wait - 1 ms (wait_ms is rounded up).
		if p.opts.MaxLate > 0 && time.Since(sent)-wait+time.Millisecond > p.opts.MaxLate {
			p.missed.Add(1)
			p.cancel(ctx, resp.GetReservation())
			continue
		}
		return nil
	}
}

// cancel gives a reservation back, on a context of its own: ctx may have
// ended.
func (p *Pacer) cancel(ctx context.Context, reservation string) {
	if reservation == "" {
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.c.cancelTimeout())
	_, _ = p.c.CancelReservation(cctx, reservation)
	cancel()
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
