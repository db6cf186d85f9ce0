package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/leaseid"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// ErrLeaseHome: the region that holds a lease did not answer a Release or
// Renew forwarded to it; the lease expires there on its own unless a
// Release again reaches it.
var ErrLeaseHome = errors.New("the region holding the lease did not answer")

// LeaseHome is a Home that holds the leases of pinned concurrency rules
// whose keys it homes. Each call names the whole lease id; the home acts on
// the parts that name it. Errors as for Home: an *request.InvalidError or
// request.ErrUnknownRule is the home's answer, homes.ErrStaleTopology a refusal of an
// Acquire routed with an older topology, anything else no answer.
type LeaseHome interface {
	AcquireLease(ctx context.Context, leaseID string) (HomeLease, error)
	ReleaseLease(ctx context.Context, leaseID string) (released bool, _ error)
	RenewLease(ctx context.Context, leaseID string) (renewed bool, expires time.Time, ttl time.Duration, _ error)
}

// HomeLease is a home region's answer to an Acquire of the leases it
// holds: one decision per part naming it, in order; when allowed, the
// soonest expiry and the shortest lease length. Fallback: the home's store
// failed and it holds them in its fallback store.
type HomeLease struct {
	Allowed   bool
	Decisions []bucket.Decision
	Expires   time.Time
	TTL       time.Duration
	Fallback  bool
}

func (e *Engine) countForward(rules []string, call, result string) {
	for _, r := range rules {
		e.m.ForwardedLeases.WithLabelValues(r, call, result).Inc()
	}
}

func partRules(id *leaseid.ID, region string) []string {
	var out []string
	for _, p := range id.Parts {
		if p.Region == region {
			out = append(out, p.Rule)
		}
	}
	return out
}

func heldRules(parts []heldPart) []string {
	out := make([]string, len(parts))
	for i, p := range parts {
		out[i] = p.Rule
	}
	return out
}

// acquireAt asks home to hold the leases of id's parts idx (of c.held).
func (e *Engine) acquireAt(ctx context.Context, c *Acquire, ts *homes.State, home string, idx []int, id *leaseid.ID) (bool, error) {
	rules := partRules(id, home)
	h, _ := ts.Homes[home].(LeaseHome)
	if h == nil {
		e.countForward(rules, metrics.CallAcquire, metrics.ResultError)
		return false, errors.New("no lease client for home region " + home)
	}
	fctx, cancel := context.WithTimeout(ctx, e.fwdTO)
	defer cancel()
	hl, err := h.AcquireLease(fctx, id.String())
	if err != nil && fctx.Err() != nil && ctx.Err() == nil && !errors.Is(err, bucket.ErrOutcomeUnknown) {
		// The forward ran out of its own time: the home may hold them.
		err = fmt.Errorf("%w: %w", bucket.ErrOutcomeUnknown, err)
	}
	if err == nil && len(hl.Decisions) != len(idx) {
		err = errors.New("home region answered for another number of leases")
	}
	if err != nil {
		e.countForward(rules, metrics.CallAcquire, metrics.ResultError)
		return false, err
	}
	for j, i := range idx {
		it := c.held[i]
		it.Route, it.expires = request.RouteHome, hl.Expires
		it.Decision = hl.Decisions[j]
		it.Decision.Limit = float64(it.Entry.Leases.Limit)
		if hl.Fallback {
			id.Parts[i].Flags |= leaseid.Fallback
		}
	}
	if hl.Allowed {
		e.countForward(rules, metrics.CallAcquire, metrics.ResultAllowed)
	} else {
		e.countForward(rules, metrics.CallAcquire, metrics.ResultLimited)
	}
	return hl.Allowed, nil
}

// releaseAt gives back the leases home holds for a refused Acquire, on a
// deadline of its own (the caller may be gone).
func (e *Engine) releaseAt(ctx context.Context, ts *homes.State, home string, id *leaseid.ID) {
	h, _ := ts.Homes[home].(LeaseHome)
	if h == nil {
		return
	}
	rctx, cancel := e.detached(ctx)
	defer cancel()
	rules := partRules(id, home)
	ok, err := h.ReleaseLease(rctx, id.String())
	switch {
	case err != nil:
		e.countForward(rules, metrics.CallRelease, metrics.ResultError)
		e.log.Warn("the leases of a refused acquire not given back at their home: they expire there on their own", "home", home, "err", err)
	case ok:
		e.countForward(rules, metrics.CallRelease, metrics.ResultReleased)
	default:
		e.countForward(rules, metrics.CallRelease, metrics.ResultGone)
	}
}

// releaseRemote forwards the Release of parts held in region.
func (e *Engine) releaseRemote(ctx context.Context, ts *homes.State, region, leaseID string, parts []heldPart) (bool, error) {
	rules := heldRules(parts)
	h, _ := ts.Homes[region].(LeaseHome)
	if h == nil {
		e.countForward(rules, metrics.CallRelease, metrics.ResultError)
		return false, fmt.Errorf("%w: no client for region %s", ErrLeaseHome, region)
	}
	fctx, cancel := context.WithTimeout(ctx, e.fwdTO)
	defer cancel()
	ok, err := h.ReleaseLease(fctx, leaseID)
	if err != nil {
		return false, e.remoteLeaseError(ctx, rules, metrics.CallRelease, region, err)
	}
	if ok {
		e.countForward(rules, metrics.CallRelease, metrics.ResultReleased)
	} else {
		e.countForward(rules, metrics.CallRelease, metrics.ResultGone)
	}
	return ok, nil
}

// renewRemote forwards the Renew of parts held in region.
func (e *Engine) renewRemote(ctx context.Context, ts *homes.State, region, leaseID string, parts []heldPart) (bool, time.Time, time.Duration, error) {
	rules := heldRules(parts)
	h, _ := ts.Homes[region].(LeaseHome)
	if h == nil {
		e.countForward(rules, metrics.CallRenew, metrics.ResultError)
		return false, time.Time{}, 0, fmt.Errorf("%w: no client for region %s", ErrLeaseHome, region)
	}
	fctx, cancel := context.WithTimeout(ctx, e.fwdTO)
	defer cancel()
	ok, expires, ttl, err := h.RenewLease(fctx, leaseID)
	if err != nil {
		return false, time.Time{}, 0, e.remoteLeaseError(ctx, rules, metrics.CallRenew, region, err)
	}
	if ok {
		e.countForward(rules, metrics.CallRenew, metrics.ResultRenewed)
	} else {
		e.countForward(rules, metrics.CallRenew, metrics.ResultGone)
	}
	return ok, expires, ttl, nil
}

// remoteLeaseError is the error of a Release or Renew the region holding
// the lease did not answer (or refused as invalid: its answer stands).
func (e *Engine) remoteLeaseError(ctx context.Context, rules []string, call, region string, err error) error {
	e.countForward(rules, call, metrics.ResultError)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	var inv *request.InvalidError
	if errors.As(err, &inv) || errors.Is(err, request.ErrUnknownRule) {
		return err
	}
	return fmt.Errorf("%w: region %s: %w", ErrLeaseHome, region, err)
}

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
func (e *Engine) PeerAcquire(ctx context.Context, origin string, gen uint64, leaseID string) (*PeerLease, error) {
	id, err := parseLeaseID(leaseID)
	if err != nil {
		e.m.Invalid.WithLabelValues("lease_id").Inc()
		return nil, err
	}
	ts := e.topo.Use()
	defer ts.Release()
	c := &Acquire{Request: request.Request{Table: e.table.Load(), Metrics: e.m, Peer: origin}}
	for i, p := range id.Parts {
		if p.Region != e.region {
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
		case slices.ContainsFunc(c.held, func(l *heldLease) bool { return l.Entry == en && l.Key == p.Key }):
			return nil, request.Invalid("lease_id", "lease_id: rule %s and key given twice", request.Quote(p.Rule))
		}
		if ts.Topo != nil {
			if home := ts.Topo.Home(p.Key, en.Rule.HomeKeys); home != e.region {
				if gen < ts.Gen {
					return nil, fmt.Errorf("topology generation %d here (%d forwarded): rule %s: the key's home is %s: %w", ts.Gen, gen, request.Quote(p.Rule), home, homes.ErrStaleTopology)
				}
				return nil, request.Invalid("lease_id", "lease_id: rule %s: the key's home is %s, not %s", request.Quote(p.Rule), home, e.region)
			}
		}
		c.held = append(c.held, &heldLease{Item: &request.Item{Rule: en.Rule, Key: p.Key, Cost: 1, Entry: en, Against: en.Limit}, part: i})
	}
	if len(c.held) == 0 {
		return nil, request.Invalid("lease_id", "lease_id: no lease of it is held in region %s", request.Quote(e.region))
	}
	// The lease stage of an Acquire, with every part held here.
	p := plan{a: c, ts: ts, id: id, here: make([]int, len(c.held))}
	for i := range p.here {
		p.here[i] = i
	}
	allowed, err := e.leasesHere(ctx, &p)
	if err != nil {
		return nil, err
	}
	pl := &PeerLease{Allowed: allowed, Items: itemsOf(c.held)}
	if !allowed {
		return pl, nil
	}
	l := e.granted(&p)
	pl.Expires, pl.TTL = l.Expires, l.TTL
	pl.Fallback = slices.ContainsFunc(c.held, func(it *heldLease) bool { return it.Route == request.RouteFallback })
	return pl, nil
}
