package concurrency

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/inflight"
	"github.com/limiterd/limiterd/internal/engine/leaseid"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// Route names in h's lease id, under ts's topology, where each
// concurrency rule is held: at its key's home region for a pinned rule
// homed elsewhere, here otherwise. It is an Acquire's first lease stage.
func (l *Leases) Route(ts *homes.State, h *Hold) {
	c := h.a
	h.id = leaseid.New(l.region, ts.Gen, make([]leaseid.Part, len(c.held)))
	for i, it := range c.held {
		it.Route, it.part = request.RouteNone, i
		h.id.Parts[i] = leaseid.Part{Rule: it.Rule.ID, Key: it.Key, Region: l.region}
		if home := ts.HomeOf(l.region, &c.Request, it.Item); home != "" {
			h.id.Parts[i].Region = home
			if h.byHome == nil {
				h.byHome = map[string][]int{}
			}
			if h.byHome[home] == nil {
				h.leaseHomes = append(h.leaseHomes, home)
			}
			h.byHome[home] = append(h.byHome[home], i)
			continue
		}
		h.here = append(h.here, i)
	}
	slices.Sort(h.leaseHomes)
}

// AtHomes asks each home region to hold its keys' leases (rerouted: the
// call is routed a second time). A home's failure goes to the failure
// policy: refused, or held here with this region's share of each limit.
func (l *Leases) AtHomes(ctx context.Context, ts *homes.State, rerouted bool, h *Hold) (bool, error) {
	c := h.a
	for n, home := range h.leaseHomes {
		allowed, err := l.acquireAt(ctx, c, ts, home, h.byHome[home], h.id)
		if err == nil {
			if !allowed {
				c.notAsked()
				return false, nil
			}
			h.homesTaken |= 1 << n
			continue
		}
		if ctx.Err() == nil {
			if err := l.policy.HomeFailed(ts, rerouted, home, err); err != nil {
				return false, err
			}
		}
		its := make([]*request.Item, len(h.byHome[home]))
		for j, i := range h.byHome[home] {
			its[j] = c.held[i].Item
		}
		// The home may hold them (its outcome unknown, or the caller
		// gone): it is asked to give them back, else they expire there.
		mayHold := ctx.Err() != nil || errors.Is(err, bucket.ErrOutcomeUnknown)
		if refused, ferr := l.policy.Refused(ctx, its, "home region "+home, err); refused {
			if mayHold {
				h.homesTaken |= 1 << n
			}
			return false, ferr
		}
		if mayHold {
			l.releaseAt(ctx, ts, home, h.id)
		}
		// Fail open: held here, with this region's share of each limit.
		for _, i := range h.byHome[home] {
			h.id.Parts[i].Region, h.id.Parts[i].Flags = l.region, leaseid.Regional
			h.here = append(h.here, i)
		}
	}
	return true, nil
}

// Here takes the leases held here in one store call: an Acquire's last
// lease stage, and all of a peer's Acquire (PeerAcquire).
func (l *Leases) Here(ctx context.Context, h *Hold) (bool, error) {
	c := h.a
	h.heldHere = make([]*heldLease, len(h.here))
	for j, i := range h.here {
		h.heldHere[j] = c.held[i]
	}
	allowed, err := l.takeLeases(ctx, c, h.heldHere, h.id)
	if err != nil || !allowed {
		return false, err
	}
	h.hereTaken = len(h.heldHere) > 0
	h.held = true
	return true, nil
}

// Granted is the Lease of an allowed Acquire; its leases held here are
// counted and tracked.
func (l *Leases) Granted(h *Hold) *Lease {
	lease := &Lease{ID: h.id.String()}
	var expires time.Time // of the leases held here
	for _, it := range h.a.held {
		if lease.Expires.IsZero() || it.expires.Before(lease.Expires) {
			lease.Expires = it.expires
		}
		if ttl := it.Limits.Leases.TTL; lease.TTL == 0 || ttl < lease.TTL {
			lease.TTL = ttl
		}
	}
	for _, it := range h.heldHere {
		if expires.IsZero() || it.expires.Before(expires) {
			expires = it.expires
		}
		// Counted where held: a home counts the leases it holds.
		it.Entry.Lease[metrics.EventAcquired].Inc()
		if it.Route == request.RouteFallback {
			it.Entry.Lease[metrics.EventFallback].Inc()
		}
	}
	if len(h.heldHere) > 0 {
		l.inflight.Add(h.id.Member(), trackedRules(h.heldHere), expires)
	}
	return lease
}

// trackedRules are the in-flight gauge's rules of items, concurrency
// rules' items.
func trackedRules(items []*heldLease) []*inflight.Rule {
	out := make([]*inflight.Rule, len(items))
	for i, it := range items {
		out[i] = it.Entry.Tracked
	}
	return out
}

// takeLeases takes the leases of items (c's concurrency rules held here)
// under id, from the store or, when it fails, as the rules' on_failure
// says.
func (l *Leases) takeLeases(ctx context.Context, c *Acquire, items []*heldLease, id *leaseid.ID) (bool, error) {
	if len(items) == 0 {
		return true, nil
	}
	fleet := max(l.fleet(), 1)
	reqs := make([]bucket.LeaseRequest, len(items))
	for i, it := range items {
		reqs[i] = l.partRequest(it, id, fleet)
	}
	var ds []bucket.LeaseDecision
	var err error
	if l.store == nil {
		err = errors.New("the store holds no leases")
	} else {
		ds, err = l.store.Acquire(ctx, reqs, id.Member())
	}
	var me *bucket.MultiError
	if err != nil && errors.As(err, &me) && len(me.Errs) == len(reqs) && len(ds) == len(reqs) {
		// Some clients' leases were decided: a refusal among them refuses
		// (the store gave back whatever the others took).
		for i, it := range items {
			if me.Errs[i] == nil && !ds[i].Allowed {
				it.Route = request.RouteStore
				it.Decision = bucket.Decision{Limit: float64(it.Limits.Leases.Limit), RetryAfter: ds[i].RetryAfter, ResetAfter: ds[i].RetryAfter, Reserved: ds[i].Reserved}
				l.refused(it.Item)
				c.notAsked()
				return false, nil
			}
		}
	}
	if err != nil {
		if refused, err := l.policy.Refused(ctx, itemsOf(items), "lease store", err); refused {
			return false, err
		}
		// Fail open: this instance's share of each limit, held here. The
		// store gave back whatever it may have taken.
		for i, it := range items {
			id.Parts[it.part].Flags |= leaseid.Fallback
			it.Route = request.RouteFallback
			reqs[i] = l.partRequest(it, id, fleet)
		}
		ds, _ = l.fallback.Acquire(ctx, reqs, id.Member())
	} else {
		for _, it := range items {
			it.Route = request.RouteStore
		}
	}
	all := true
	for i, it := range items {
		d := ds[i]
		it.expires = d.Expires
		// Remaining is what is left of the limit the lease was held
		// against: this region's or this instance's share when it was
		// held as the rule's on_failure, as a check's is; Limit the rule's.
		it.Decision = bucket.Decision{Allowed: d.Allowed, Remaining: float64(max(reqs[i].Limit.Limit-d.InFlight, 0)),
			Limit: float64(it.Limits.Leases.Limit), RetryAfter: d.RetryAfter, ResetAfter: d.RetryAfter, Reserved: d.Reserved}
		if reqs[i].Limit.Adaptive.On() {
			// The key's limit now, as the store holds it.
			it.Decision.Remaining = float64(max(d.Limit-d.InFlight, 0))
			if it.Route == request.RouteStore {
				it.Decision.Limit = float64(d.Limit)
				it.Entry.AdaptiveLimit.Set(float64(d.Limit))
			}
		}
		if !d.Allowed {
			all = false
			l.refused(it.Item)
		}
	}
	if !all {
		// Nothing is held: the rate rules are not asked.
		c.notAsked()
	}
	return all, nil
}

// partRequest is the lease request of it, keeping what its class keeps.
func (l *Leases) partRequest(it *heldLease, id *leaseid.ID, fleet int) bucket.LeaseRequest {
	return bucket.LeaseRequest{Rule: it.Rule.ID, Key: it.Key, Limit: leaseLimit(it.Limits, id.Parts[it.part].Flags, fleet), Keep: it.Keep}
}

// giveLeasesBack releases the leases an Acquire took here when a later
// part refused or failed.
func (l *Leases) giveLeasesBack(ctx context.Context, items []*heldLease, id *leaseid.ID) {
	if len(items) == 0 {
		return
	}
	rctx, cancel := l.detached(ctx)
	defer cancel()
	fleet := max(l.fleet(), 1)
	reqs := make([]bucket.LeaseRequest, len(items))
	for i, it := range items {
		reqs[i] = l.partRequest(it, id, fleet)
	}
	// The leases held here were taken in one store call: one store.
	if _, err := l.leaseStoreOf(id.Parts[items[0].part].Flags).Release(rctx, reqs, id.Member()); err != nil {
		l.log.Warn("the leases of a refused acquire not given back: they expire on their own", "err", err)
	}
}

func (l *Leases) leaseStoreOf(flags byte) bucket.LeaseStore {
	if flags&leaseid.Fallback != 0 || l.store == nil {
		return l.fallback
	}
	return l.store
}
