package concurrency

import (
	"context"
	"errors"
	"fmt"
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

// LeaseHome is a homes.Home that holds the leases of pinned concurrency rules
// whose keys it homes. Each call names the whole lease id; the home acts on
// the parts that name it. Errors as for homes.Home: an *request.InvalidError or
// request.ErrUnknownRule is the home's answer, homes.ErrStaleTopology a refusal of an
// Acquire routed with an older topology, anything else no answer.
type LeaseHome interface {
	AcquireLease(ctx context.Context, leaseID string) (HomeLease, error)
	// ReleaseLease gives the leases back, with the caller's sample of
	// the request (nil: none).
	ReleaseLease(ctx context.Context, leaseID string, sample *bucket.LeaseSample) (released bool, _ error)
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

func (l *Leases) countForward(rules []string, call, result string) {
	for _, r := range rules {
		l.m.ForwardedLeases.WithLabelValues(r, call, result).Inc()
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
func (l *Leases) acquireAt(ctx context.Context, c *Acquire, ts *homes.State, home string, idx []int, id *leaseid.ID) (bool, error) {
	rules := partRules(id, home)
	h, _ := ts.Homes[home].(LeaseHome)
	if h == nil {
		l.countForward(rules, metrics.CallAcquire, metrics.ResultError)
		return false, errors.New("no lease client for home region " + home)
	}
	fctx, cancel := context.WithTimeout(ctx, l.fwdTO)
	defer cancel()
	hl, err := h.AcquireLease(fctx, id.String())
	// Out of its own time, the home may hold them.
	err = homes.OwnTimeout(ctx, fctx, err)
	if err == nil && len(hl.Decisions) != len(idx) {
		err = errors.New("home region answered for another number of leases")
	}
	if err != nil {
		l.countForward(rules, metrics.CallAcquire, metrics.ResultError)
		return false, err
	}
	for j, i := range idx {
		it := c.held[i]
		it.Route, it.expires = request.RouteHome, hl.Expires
		it.Decision = hl.Decisions[j]
		it.Decision.Limit = float64(it.Limits.Leases.Limit)
		if !hl.Allowed && !it.Decision.Allowed {
			l.top.Add(it.Rule.ID, it.Key, 1, time.Now().UnixNano())
		}
		if hl.Fallback {
			id.Parts[i].Flags |= leaseid.Fallback
		}
	}
	if hl.Allowed {
		l.countForward(rules, metrics.CallAcquire, metrics.ResultAllowed)
	} else {
		l.countForward(rules, metrics.CallAcquire, metrics.ResultLimited)
	}
	return hl.Allowed, nil
}

// releaseAt gives back the leases home holds for a refused Acquire, on a
// deadline of its own (the caller may be gone).
func (l *Leases) releaseAt(ctx context.Context, ts *homes.State, home string, id *leaseid.ID) {
	h, _ := ts.Homes[home].(LeaseHome)
	if h == nil {
		return
	}
	rctx, cancel := l.detached(ctx)
	defer cancel()
	rules := partRules(id, home)
	ok, err := h.ReleaseLease(rctx, id.String(), nil)
	switch {
	case err != nil:
		l.countForward(rules, metrics.CallRelease, metrics.ResultError)
		l.log.Warn("the leases of a refused acquire not given back at their home: they expire there on their own", "home", home, "err", err)
	case ok:
		l.countForward(rules, metrics.CallRelease, metrics.ResultReleased)
	default:
		l.countForward(rules, metrics.CallRelease, metrics.ResultGone)
	}
}

// releaseRemote forwards the Release of parts held in region.
func (l *Leases) releaseRemote(ctx context.Context, ts *homes.State, region, leaseID string, sample *bucket.LeaseSample, parts []heldPart) (bool, error) {
	rules := heldRules(parts)
	h, _ := ts.Homes[region].(LeaseHome)
	if h == nil {
		l.countForward(rules, metrics.CallRelease, metrics.ResultError)
		return false, fmt.Errorf("%w: no client for region %s", ErrLeaseHome, region)
	}
	fctx, cancel := context.WithTimeout(ctx, l.fwdTO)
	defer cancel()
	ok, err := h.ReleaseLease(fctx, leaseID, sample)
	if err != nil {
		return false, l.remoteLeaseError(ctx, rules, metrics.CallRelease, region, err)
	}
	if ok {
		l.countForward(rules, metrics.CallRelease, metrics.ResultReleased)
	} else {
		l.countForward(rules, metrics.CallRelease, metrics.ResultGone)
	}
	return ok, nil
}

// renewRemote forwards the Renew of parts held in region.
func (l *Leases) renewRemote(ctx context.Context, ts *homes.State, region, leaseID string, parts []heldPart) (bool, time.Time, time.Duration, error) {
	rules := heldRules(parts)
	h, _ := ts.Homes[region].(LeaseHome)
	if h == nil {
		l.countForward(rules, metrics.CallRenew, metrics.ResultError)
		return false, time.Time{}, 0, fmt.Errorf("%w: no client for region %s", ErrLeaseHome, region)
	}
	fctx, cancel := context.WithTimeout(ctx, l.fwdTO)
	defer cancel()
	ok, expires, ttl, err := h.RenewLease(fctx, leaseID)
	if err != nil {
		return false, time.Time{}, 0, l.remoteLeaseError(ctx, rules, metrics.CallRenew, region, err)
	}
	if ok {
		l.countForward(rules, metrics.CallRenew, metrics.ResultRenewed)
	} else {
		l.countForward(rules, metrics.CallRenew, metrics.ResultGone)
	}
	return ok, expires, ttl, nil
}

// remoteLeaseError is the error of a Release or Renew the region holding
// the lease did not answer (or refused as invalid: its answer stands).
func (l *Leases) remoteLeaseError(ctx context.Context, rules []string, call, region string, err error) error {
	l.countForward(rules, call, metrics.ResultError)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	var inv *request.InvalidError
	if errors.As(err, &inv) || errors.Is(err, request.ErrUnknownRule) {
		return err
	}
	return fmt.Errorf("%w: region %s: %w", ErrLeaseHome, region, err)
}
