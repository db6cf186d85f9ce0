package homes

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/handoff"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// Forwarder makes the engine's calls to home regions: a check's pinned
// rules decided at their keys' home (Decide), given back there when the
// check is refused (Refund, on after the answer), and a moved key's old
// home asked what its bucket counts (Used). Which home is asked, and what
// its failure means, is the engine's.
type Forwarder struct {
	// Timeout bounds a call (Decide), whatever the caller's deadline.
	Timeout time.Duration
	// Detached is a context for a call made whether or not the caller
	// still waits (engine.Engine's: ctx's values, a deadline of its own).
	Detached func(context.Context) (context.Context, context.CancelFunc)
	// Refunds counts the refunds by result (ok, error).
	Refunds *prometheus.CounterVec
	Log     *slog.Logger
	// refunds are the refunds still under way.
	refunds sync.WaitGroup
}

// Decide asks home, under ts, to decide its, paced by maxWait (0: not
// paced): each item's Route and Decision are set when it answers. A
// forward that runs out of its own time fails with
// bucket.ErrOutcomeUnknown: the home may have decided.
func (f *Forwarder) Decide(ctx context.Context, ts *State, home string, its []*request.Item, maxWait time.Duration) (bool, error) {
	h := ts.Homes[home]
	if h == nil {
		return false, errors.New("no client for home region " + home)
	}
	req := make([]Item, len(its))
	for i, it := range its {
		req[i] = Item{Rule: it.Rule.ID, Key: it.Key, Cost: it.Cost, MaxWait: maxWait}
	}
	fctx, cancel := context.WithTimeout(ctx, f.Timeout)
	defer cancel()
	allowed, ds, err := h.Decide(fctx, req)
	err = OwnTimeout(ctx, fctx, err)
	if err == nil && len(ds) != len(its) {
		err = errors.New("home region answered for another number of rules")
	}
	if err != nil {
		for _, it := range its {
			it.Entry.ForwardedFailed.Inc()
		}
		return false, err
	}
	for i, it := range its {
		it.Route = request.RouteHome
		it.Decision = ds[i]
		it.Decision.Limit = it.Limits.Limit.Capacity
	}
	return allowed, nil
}

// OwnTimeout is err, a call's on fctx (ctx with a timeout of the call's
// own), wrapped in bucket.ErrOutcomeUnknown when the call ran out of its
// own time while the caller still waits: the home may have acted on it.
func OwnTimeout(ctx, fctx context.Context, err error) error {
	if err != nil && fctx.Err() != nil && ctx.Err() == nil && !errors.Is(err, bucket.ErrOutcomeUnknown) {
		return fmt.Errorf("%w: %w", bucket.ErrOutcomeUnknown, err)
	}
	return err
}

// Refund gives back what home spent in its store for its, on a context of
// its own, after the answer; ts, and so its connection to the home, stays
// in use until it is done (see Wait).
func (f *Forwarder) Refund(ctx context.Context, ts *State, home string, its []*request.Item) {
	// Only what the home spent in its store: what it decided from its
	// fallback, or without learning the outcome, has no instant.
	var items []Item
	for _, it := range its {
		if it.Decision.At > 0 {
			items = append(items, Item{Rule: it.Rule.ID, Key: it.Key, Cost: it.Cost, At: it.Decision.At})
		}
	}
	h := ts.Homes[home]
	if len(items) == 0 || h == nil {
		return
	}
	rctx, cancel := f.Detached(ctx)
	ts.Use() // held by the refund: the connection stays open for it
	f.refunds.Go(func() {
		defer ts.Release()
		defer cancel()
		if err := h.Refund(rctx, items); err != nil {
			f.Refunds.WithLabelValues("error").Inc()
			f.Log.Warn("home region refund failed: its tokens stay spent", "home", home, "err", err)
			return
		}
		f.Refunds.WithLabelValues("ok").Inc()
	})
}

// Wait waits for the refunds still under way, or ctx.
func (f *Forwarder) Wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		f.refunds.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Used asks home, the moves' old home under ts (a region ts's switch
// removed included), what their buckets count, on a context of its own,
// and sets each move's Seed.Used (handoff.SetUsed checks the answer).
func (f *Forwarder) Used(ctx context.Context, ts *State, home string, moves []handoff.Move) error {
	h := ts.Homes[home]
	if h == nil {
		h = ts.PrevHomes[home] // a region the switch removed
	}
	if h == nil {
		return fmt.Errorf("no client for region %s (not in the topology in force, and this process did not switch from one that had it)", home)
	}
	req := make([]Item, len(moves))
	for i, mv := range moves {
		req[i] = Item{Rule: mv.Seed.Rule, Key: mv.Seed.Key}
	}
	// Not cut short by the caller giving up: a fail-open key would start
	// from a full bucket for the whole fleet.
	hctx, cancel := f.Detached(ctx)
	defer cancel()
	used, err := h.Handoff(hctx, req)
	if err != nil {
		return err
	}
	return handoff.SetUsed(moves, used)
}
