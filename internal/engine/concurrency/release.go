package concurrency

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/leaseid"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// heldPart is a part of a caller's lease id whose rule is in force: its
// entry and its store request.
type heldPart struct {
	leaseid.Part
	en  *request.Entry
	req bucket.LeaseRequest
}

// leaseParts reads a caller's lease id: the parts of its rules in force,
// those held here and those held in each other region. A rule no longer in
// force holds nothing (its part is left out). A rule that is not a
// concurrency rule, a region outside the topology, a local rule's part held
// in another region than the Acquire's, or a pinned rule's part held in a
// region that cannot hold it under the id's topology generation (when that
// is the one in force here) is an *request.InvalidError of lease_id: the id was
// edited, and no region is called for it.
func (l *Leases) leaseParts(ts *homes.State, s string) (*leaseid.ID, []heldPart, map[string][]heldPart, error) {
	id, err := parseLeaseID(s)
	if err == nil {
		err = l.checkParts(ts, id)
	}
	if err != nil {
		l.m.Invalid.WithLabelValues("lease_id").Inc()
		return nil, nil, nil, err
	}
	t := l.table.Load()
	fleet := max(l.fleet(), 1)
	var here []heldPart
	var remote map[string][]heldPart
	for _, p := range id.Parts {
		en := t.ByID[p.Rule]
		if en == nil {
			continue
		}
		hp := heldPart{Part: p, en: en, req: bucket.LeaseRequest{Rule: p.Rule, Key: p.Key, Limit: leaseLimit(en.For(p.Key), p.Flags, fleet)}}
		if p.Region == l.region {
			here = append(here, hp)
			continue
		}
		if remote == nil {
			remote = make(map[string][]heldPart)
		}
		remote[p.Region] = append(remote[p.Region], hp)
	}
	return id, here, remote, nil
}

// checkParts validates where id's parts say they are held.
func (l *Leases) checkParts(ts *homes.State, id *leaseid.ID) error {
	t := l.table.Load()
	for _, p := range id.Parts {
		en := t.ByID[p.Rule]
		if en == nil {
			continue
		}
		if !en.Rule.Concurrent() {
			return request.Invalid("lease_id", "lease_id: rule %s: %w", request.Quote(p.Rule), ErrNotConcurrency)
		}
		if p.Region != l.region && (ts.Topo == nil || !ts.Topo.Has(p.Region)) {
			return request.Invalid("lease_id", "lease_id: held in region %s, which is not a region of the topology of %s", request.Quote(p.Region), request.Quote(l.region))
		}
		if !en.Pinned && p.Region != id.Region {
			// A local rule's lease is held where it was acquired: an id
			// saying otherwise was edited, and is refused here rather than
			// sent, with this region's peer credentials, to the region
			// it names.
			return request.Invalid("lease_id", "lease_id: rule %s: a local rule's lease is held in the region of its acquire (%s), and the lease id says %s: an edited lease id",
				request.Quote(p.Rule), request.Quote(id.Region), request.Quote(p.Region))
		}
		if p.Flags&leaseid.Regional != 0 && (!en.Pinned || p.Region != id.Region) {
			return request.Invalid("lease_id", "lease_id: rule %s: a region's share of a pinned rule is held in the region of the acquire", request.Quote(p.Rule))
		}
		if !en.Pinned || ts.Topo == nil || id.Gen != ts.Gen {
			// Held where the acquire was, or homed under a topology not
			// known here: the region named decides (a forged id names a
			// member no set holds).
			continue
		}
		home := ts.Topo.Home(p.Key, en.Rule.HomeKeys)
		if regional := p.Flags&leaseid.Regional != 0; regional == (p.Region == home) {
			return request.Invalid("lease_id", "lease_id: rule %s: under topology generation %d the key's home is %s, and the lease id says it is held in %s: an edited lease id",
				request.Quote(p.Rule), ts.Gen, home, p.Region)
		}
	}
	return nil
}

// Release gives back the leases of a lease id, wherever they are held:
// those held in another region through its Peer service. sample (nil:
// none) is what the caller reports of the request: it moves the limits of
// the adaptive rules whose leases were held. A lease unknown, expired or
// already released is no error: released is then false (true when any of
// its leases was held). Errors: an *request.InvalidError of lease_id or
// duration_ms, ErrLeaseStore (the store here did not answer) or
// ErrLeaseHome (the region holding a lease did not answer); the leases not
// released expire on their own, and a Release again is safe.
func (l *Leases) Release(ctx context.Context, leaseID string, sample *bucket.LeaseSample) (released bool, _ error) {
	return l.release(ctx, leaseID, sample, false)
}

// PeerRelease is a Release forwarded by a peer region: it gives back the
// leases held here and leaves the others (never forwarded again).
func (l *Leases) PeerRelease(ctx context.Context, leaseID string, sample *bucket.LeaseSample) (released bool, _ error) {
	return l.release(ctx, leaseID, sample, true)
}

func (l *Leases) release(ctx context.Context, leaseID string, sample *bucket.LeaseSample, peer bool) (bool, error) {
	if sample != nil {
		if err := sample.Validate(); err != nil {
			l.m.Invalid.WithLabelValues("duration_ms").Inc()
			return false, request.Invalid("duration_ms", "duration_ms: %w", err)
		}
	}
	ts := l.topo.Use()
	defer ts.Release()
	id, here, remote, err := l.leaseParts(ts, leaseID)
	if err != nil {
		return false, err
	}
	for i := range here {
		here[i].req.Sample = sample
	}
	tracked := l.inflight.Remove(id.Member())
	released, err := l.releaseHere(ctx, id, here, tracked)
	if peer {
		return released, err
	}
	for _, r := range slices.Sorted(maps.Keys(remote)) {
		ok, rerr := l.releaseRemote(ctx, ts, r, leaseID, sample, remote[r])
		released = released || ok
		if err == nil {
			err = rerr
		}
	}
	if err != nil {
		return false, err
	}
	return released, nil
}

// releaseHere releases parts held in this region.
func (l *Leases) releaseHere(ctx context.Context, id *leaseid.ID, parts []heldPart, tracked bool) (released bool, _ error) {
	for _, group := range byStore(parts) {
		reqs := make([]bucket.LeaseRequest, len(group))
		for i, p := range group {
			reqs[i] = p.req
		}
		held, err := l.leaseStoreOf(group[0].Flags).Release(ctx, reqs, id.Member())
		if err != nil {
			if ctx.Err() != nil {
				return false, ctx.Err()
			}
			for _, p := range group {
				p.en.Lease[metrics.EventError].Inc()
			}
			return false, fmt.Errorf("%w: %w", ErrLeaseStore, err)
		}
		for i, p := range group {
			if held[i] {
				released = true
				p.en.Lease[metrics.EventReleased].Inc()
			} else if tracked {
				// It expired before its release: counted as expired.
				p.en.Lease[metrics.EventExpired].Inc()
			}
		}
	}
	return released, nil
}

// byStore groups parts held here by the store holding them (the shared
// one, or this instance's fallback).
func byStore(parts []heldPart) [][]heldPart {
	var shared, fallback []heldPart
	for _, p := range parts {
		if p.Flags&leaseid.Fallback != 0 {
			fallback = append(fallback, p)
		} else {
			shared = append(shared, p)
		}
	}
	var out [][]heldPart
	for _, g := range [][]heldPart{shared, fallback} {
		if len(g) > 0 {
			out = append(out, g)
		}
	}
	return out
}

// Renew extends the leases of a lease id by their rules' lease length,
// wherever they are held (those of other regions through their Peer
// service). When any of them is gone (expired, released, or never held),
// the lease is gone: the others are released, and renewed is false: the
// caller must stop the request's work or acquire again. A pinned rule's
// lease held where its key is no longer homed (the topology moved it), or
// held here with this region's share while the home did not answer, is not
// renewed either: the caller acquires again, at the key's home. Errors as
// for Release.
func (l *Leases) Renew(ctx context.Context, leaseID string) (renewed bool, _ *Lease, _ error) {
	return l.renew(ctx, leaseID, false)
}

// PeerRenew is a Renew forwarded by a peer region: it renews the leases
// held here (and when one is gone, releases the others held here).
func (l *Leases) PeerRenew(ctx context.Context, leaseID string) (renewed bool, _ *Lease, _ error) {
	return l.renew(ctx, leaseID, true)
}

func (l *Leases) renew(ctx context.Context, leaseID string, peer bool) (bool, *Lease, error) {
	ts := l.topo.Use()
	defer ts.Release()
	id, here, remote, err := l.leaseParts(ts, leaseID)
	if err != nil {
		return false, nil, err
	}
	if peer {
		remote = nil
	}
	if len(here) == 0 && len(remote) == 0 {
		l.inflight.Remove(id.Member())
		return false, nil, nil
	}
	lease := &Lease{ID: leaseID}
	gone := false
	for _, p := range append(slices.Concat(slices.Collect(maps.Values(remote))...), here...) {
		if l.unrenewable(ts, p) {
			gone = true
		}
	}
	if gone {
		l.renewGone(ctx, ts, id, leaseID, here, remote)
		return false, nil, nil
	}
	extend := func(expires time.Time, ttl time.Duration) {
		if lease.Expires.IsZero() || expires.Before(lease.Expires) {
			lease.Expires = expires
		}
		if lease.TTL == 0 || ttl < lease.TTL {
			lease.TTL = ttl
		}
	}
	for _, group := range byStore(here) {
		reqs := make([]bucket.LeaseRequest, len(group))
		for i, p := range group {
			reqs[i] = p.req
		}
		ds, err := l.leaseStoreOf(group[0].Flags).Renew(ctx, reqs, id.Member())
		if err != nil {
			if ctx.Err() != nil {
				return false, nil, ctx.Err()
			}
			for _, p := range group {
				p.en.Lease[metrics.EventError].Inc()
			}
			return false, nil, fmt.Errorf("%w: %w", ErrLeaseStore, err)
		}
		for i, d := range ds {
			if !d.Allowed {
				gone = true
				continue
			}
			extend(d.Expires, reqs[i].Limit.TTL)
		}
	}
	for _, r := range slices.Sorted(maps.Keys(remote)) {
		ok, expires, ttl, err := l.renewRemote(ctx, ts, r, leaseID, remote[r])
		if err != nil {
			return false, nil, err
		}
		if !ok {
			gone = true
			continue
		}
		extend(expires, ttl)
	}
	if gone {
		l.renewGone(ctx, ts, id, leaseID, here, remote)
		return false, nil, nil
	}
	for _, p := range here {
		p.en.Lease[metrics.EventRenewed].Inc()
	}
	l.inflight.Renew(id.Member(), lease.Expires)
	return true, lease, nil
}

// renewGone ends a lease a Renew found gone (or may not renew): the rest
// of it is released, here and in the regions holding its other parts.
func (l *Leases) renewGone(ctx context.Context, ts *homes.State, id *leaseid.ID, leaseID string, here []heldPart, remote map[string][]heldPart) {
	for _, p := range here {
		p.en.Lease[metrics.EventGone].Inc()
	}
	if l.inflight.Remove(id.Member()) {
		for _, p := range here {
			p.en.Lease[metrics.EventExpired].Inc()
		}
	}
	rctx, cancel := l.detached(ctx)
	defer cancel()
	if _, err := l.releaseHere(rctx, id, here, false); err != nil {
		l.log.Warn("the rest of a lease gone not released: it expires on its own", "err", err)
	}
	for _, r := range slices.Sorted(maps.Keys(remote)) {
		if _, err := l.releaseRemote(rctx, ts, r, leaseID, nil, remote[r]); err != nil {
			l.log.Warn("the rest of a lease gone not released in the region holding it: it expires there on its own", "region", r, "err", err)
		}
	}
}

// unrenewable says a pinned rule's lease is not renewed, so that the
// global limit holds again within one lease length: a lease held where the
// topology in force no longer homes its key (the home moved: it stays
// until released or expired, and new leases are taken at the new home),
// and a region's share taken while the home did not answer (acquiring
// again goes to the home, or takes a share again).
func (l *Leases) unrenewable(ts *homes.State, p heldPart) bool {
	if !p.en.Pinned || ts.Topo == nil {
		return false
	}
	return p.Flags&leaseid.Regional != 0 || ts.Topo.Home(p.Key, p.en.Rule.HomeKeys) != p.Region
}

// Sample is the sample of a Release that reports a duration in ms (nil:
// none) and whether the request failed: nil when it reports neither. A
// duration below 0 or above bucket.MaxSampleDuration is an
// *request.InvalidError of duration_ms.
func Sample(durationMs *int64, failed bool) (*bucket.LeaseSample, error) {
	if durationMs == nil && !failed {
		return nil, nil
	}
	var ms int64
	if durationMs != nil {
		ms = *durationMs
	}
	if ms < 0 || ms > bucket.MaxSampleDuration.Milliseconds() {
		return nil, request.Invalid("duration_ms", "duration_ms: %w: a duration must be from 0 to %d ms, got %d", bucket.ErrInvalidSample, bucket.MaxSampleDuration.Milliseconds(), ms)
	}
	return &bucket.LeaseSample{Duration: time.Duration(ms) * time.Millisecond, Failed: failed}, nil
}
