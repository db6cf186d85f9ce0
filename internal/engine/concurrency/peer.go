package concurrency

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/request"
)

// PeerLease is the answer to an Acquire a peer region forwarded: whether
// the leases held here were taken, their items (one per part of the lease
// id naming this region, in order, with their decisions), the soonest
// expiry and shortest lease length when allowed, and whether they are held
// in this instance's fallback store.
type PeerLease struct {
	Allowed  bool
	Items    []*request.Item
	Expires  time.Time
	TTL      time.Duration
	Fallback bool
}

// PeerAcquire holds, here, the leases of leaseID's parts that name this
// region: an Acquire forwarded by region origin, routed with topology
// generation gen. Each part must be a pinned concurrency rule whose key
// this region homes; under an older generation one homed elsewhere refuses
// the Acquire with homes.ErrStaleTopology (nothing held). Errors: an
// *request.InvalidError of lease_id, request.ErrUnknownRule, homes.ErrStaleTopology,
// ErrUnavailable, ErrOverloaded.
func (l *Leases) PeerAcquire(ctx context.Context, origin string, gen uint64, leaseID string) (*PeerLease, error) {
	id, err := parseLeaseID(leaseID)
	if err != nil {
		l.m.Invalid.WithLabelValues("lease_id").Inc()
		return nil, err
	}
	ts := l.topo.Use()
	defer ts.Release()
	c := &Acquire{Request: request.Request{Table: l.table.Load(), Metrics: l.m, Peer: origin}}
	c.Class = c.Table.DefaultClass()
	for i, p := range id.Parts {
		if p.Region != l.region {
			continue
		}
		en := c.Table.ByID[p.Rule]
		switch {
		case en == nil:
			return nil, fmt.Errorf("lease_id: %w", request.UnknownRule(p.Rule))
		case !en.Rule.Concurrent():
			return nil, request.Invalid("lease_id", "lease_id: rule %s: %w", request.Quote(p.Rule), ErrNotConcurrency)
		case !en.Pinned:
			return nil, request.Invalid("lease_id", "lease_id: rule %s is not pinned: its leases are held in the region of the acquire", request.Quote(p.Rule))
		case p.Flags != 0:
			return nil, request.Invalid("lease_id", "lease_id: rule %s: a home holds leases with the rule's limit, not a share", request.Quote(p.Rule))
		case slices.ContainsFunc(c.held, func(hl *heldLease) bool { return hl.Entry == en && hl.Key == p.Key }):
			return nil, request.Invalid("lease_id", "lease_id: rule %s and key given twice", request.Quote(p.Rule))
		}
		if ts.Topo != nil {
			if home := ts.Topo.Home(p.Key, en.Rule.HomeKeys); home != l.region {
				if gen < ts.Gen {
					return nil, fmt.Errorf("topology generation %d here (%d forwarded): rule %s: the key's home is %s: %w", ts.Gen, gen, request.Quote(p.Rule), home, homes.ErrStaleTopology)
				}
				return nil, request.Invalid("lease_id", "lease_id: rule %s: the key's home is %s, not %s", request.Quote(p.Rule), home, l.region)
			}
		}
		lims := en.For(p.Key)
		c.held = append(c.held, &heldLease{Item: &request.Item{Rule: en.Rule, Key: p.Key, Cost: 1, Entry: en, Limits: lims, Against: lims.Limit}, part: i})
	}
	if len(c.held) == 0 {
		return nil, request.Invalid("lease_id", "lease_id: no lease of it is held in region %s", request.Quote(l.region))
	}
	// The lease stage of an Acquire, with every part held here.
	h := Hold{a: c, id: id, here: make([]int, len(c.held))}
	for i := range h.here {
		h.here[i] = i
	}
	allowed, err := l.Here(ctx, &h)
	if err != nil {
		return nil, err
	}
	pl := &PeerLease{Allowed: allowed, Items: itemsOf(c.held)}
	if !allowed {
		return pl, nil
	}
	lease := l.Granted(&h)
	pl.Expires, pl.TTL = lease.Expires, lease.TTL
	pl.Fallback = slices.ContainsFunc(c.held, func(it *heldLease) bool { return it.Route == request.RouteFallback })
	return pl, nil
}
