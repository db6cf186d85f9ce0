package engine

import (
	"context"
	"time"

	"github.com/limiterd/limiterd/internal/engine/concurrency"
	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/request"
)

// ReleaseTimeout is the least time given to what is given back on a
// context of its own (see Engine.detached): the leases of an Acquire
// refused by a rate rule, for one, whose caller may be gone.
const ReleaseTimeout = 100 * time.Millisecond

// NewAcquire starts an Acquire under the rules in force now.
func (e *Engine) NewAcquire() *concurrency.Acquire {
	return concurrency.NewAcquire(e.table.Load(), e.m)
}

// Acquire decides an Acquire: a lease of every concurrency rule and a
// spend of every rate rule, all or nothing. The leases of pinned rules
// whose keys are homed in other regions are held there first (one Peer
// Acquire per home region, in the order of their names); then the leases
// held here, in one store call; when one refuses nothing else is asked and
// the leases already held are given back. Then the rate rules are decided
// as Decide does, and when they refuse, every lease is given back. A
// refusal is allowed false and a nil error, and the items say which rule
// refused: a concurrency rule's RetryAfter is the time until the soonest
// lease held expires.
//
// When the store fails, fail-open rules take their leases from this
// instance's fallback store, each with its share of the limit (limit /
// fleet); fail-closed ones refuse with ErrUnavailable. When a key's home
// region does not answer, a fail-open pinned rule's lease is held here
// with this region's share (limit / regions), a fail-closed one refuses
// with ErrUnavailable. The lease id names where each lease is held; its
// Release and Renew are Concurrency's.
//
// An Acquire is routed with the topology in force when it starts; a home
// that refuses it as stale makes it routed again once, as Decide does.
func (e *Engine) Acquire(ctx context.Context, c *concurrency.Acquire) (bool, *concurrency.Lease, error) {
	return e.run(ctx, &c.Request, c)
}

// Concurrency holds the engine's concurrency leases: the Release and Renew
// of a lease id, and the Acquire, Release and Renew a peer region forwards.
func (e *Engine) Concurrency() *concurrency.Leases { return e.conc }

// leasePolicy is the failure policy as the lease stages use it
// (concurrency.Policy).
type leasePolicy struct{ e *Engine }

func (lp leasePolicy) Refused(ctx context.Context, items []*request.Item, where string, err error) (bool, error) {
	v, err := lp.e.onFailure(ctx, failure{items: items, where: where, lease: true}, err)
	return v == refused, err
}

func (lp leasePolicy) HomeFailed(ts *homes.State, rerouted bool, home string, err error) error {
	return lp.e.homeFailed(ts, rerouted, home, err)
}
