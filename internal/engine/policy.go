package engine

import (
	"context"
	"errors"

	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// verdict is what the failure policy makes of a part of a call that could
// not be decided.
type verdict uint8

const (
	// fallBack: decide it here, from a share of the limit.
	fallBack verdict = iota
	// uncertain: allowed without spending more. It was sent and may have
	// been decided, and a check is never decided twice.
	uncertain
	// refused: the call's answer is the error returned with the verdict.
	refused
)

// failure is a part of a call that could not be decided: its items, where
// it went (for the log: "store", "home region eu-west"), and what it is:
// leases (an Acquire's concurrency rules) or a paced check, neither of
// which an unknown outcome settles.
type failure struct {
	items []*request.Item
	where string
	lease bool
	paced bool
}

// onFailure is the engine's whole failure policy: every part of a check
// or an Acquire that the store, a home region or a moved key's old home
// could not decide, failing with err, comes to one verdict, by the first
// rule that applies:
//
//  1. the caller gave up: refused with its context's error (a check's
//     items counted failed);
//  2. limiterd itself was too busy to send it (bucket.ErrOverloaded):
//     refused with ErrOverloaded, counted; the fallback never decides for
//     a busy limiterd;
//  3. a fail-closed rule among the items: refused with ErrUnavailable,
//     counted (failed, or the lease error event) and logged;
//  4. the outcome is unknown (bucket.ErrOutcomeUnknown: sent, and may
//     have been decided) and the part is an unpaced check: uncertain;
//  5. otherwise: fallBack, each rule deciding with its share of the limit.
//
// A home region's own answers (an invalid request, an unknown rule, a
// stale topology) are not failures: the caller reads them first
// (homeFailed).
func (e *Engine) onFailure(ctx context.Context, f failure, err error) (verdict, error) {
	if ctx.Err() != nil {
		if !f.lease {
			for _, it := range f.items {
				it.Entry.Failed.Inc()
			}
		}
		return refused, ctx.Err()
	}
	if errors.Is(err, bucket.ErrOverloaded) {
		e.m.Overloaded.Inc()
		return refused, ErrOverloaded
	}
	for _, it := range f.items {
		if !it.Entry.Closed {
			continue
		}
		if f.lease {
			it.Entry.Lease[metrics.EventError].Inc()
		} else {
			it.Entry.Failed.Inc()
		}
		e.log.Warn(f.where+" failed: fail-closed rule refused", "rule", it.Rule.ID, "err", err)
		return refused, ErrUnavailable
	}
	if errors.Is(err, bucket.ErrOutcomeUnknown) && !f.lease && !f.paced {
		return uncertain, nil
	}
	return fallBack, nil
}
