package engine

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/inflight"
	"github.com/limiterd/limiterd/internal/engine/leaseid"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// Errors of the lease operations.
var (
	// ErrConcurrencyRule: a Check (by rule id or attributes) met a
	// concurrency rule, which only Acquire holds: a Check has no end to
	// release it at. Its *request.InvalidError names the rule.
	ErrConcurrencyRule = errors.New("a concurrency rule is held by Acquire and Release, not checked")
	// ErrNotConcurrency: an Acquire by rule id, or a lease id, names a
	// rule that is not a concurrency rule.
	ErrNotConcurrency = errors.New("not a concurrency rule")
	// ErrLeaseStore: the store did not answer a Release or Renew; the
	// lease expires on its own.
	ErrLeaseStore = errors.New("lease store unavailable")
)

// ReleaseTimeout is the least time given to what is given back on a
// context of its own (see Engine.detached): the leases of an Acquire
// refused by a rate rule, for one, whose caller may be gone.
const ReleaseTimeout = 100 * time.Millisecond

// Lease is what an allowed Acquire holds: one lease id for every
// concurrency rule it matched.
type Lease struct {
	// ID is given to Release and Renew.
	ID string
	// Expires is when the soonest of its leases expires unless renewed.
	Expires time.Time
	// TTL is the shortest lease length of its rules: what a Renew extends
	// it by.
	TTL time.Duration
}

// Acquire is one request's rules for Engine.Acquire: its concurrency
// rules, held as leases until Release, and its rate rules, decided as a
// Check's are. Build it with Engine.NewAcquire and its Add methods; it uses
// the rules in force when it was made, throughout. An Acquire has no Pace:
// it never paces. Not safe for concurrent use.
type Acquire struct {
	request.Request
	// held are the concurrency rules' leases.
	held []*heldLease
}

// heldLease is a concurrency rule's item of an Acquire, with what only a
// lease has: its part of the lease id, and when it expires once held.
type heldLease struct {
	*request.Item
	part    int
	expires time.Time
}

// itemsOf are the items of leases.
func itemsOf(leases []*heldLease) []*request.Item {
	out := make([]*request.Item, len(leases))
	for i, l := range leases {
		out[i] = l.Item
	}
	return out
}

// NewAcquire starts an Acquire under the rules in force now.
func (e *Engine) NewAcquire() *Acquire {
	return &Acquire{Request: request.Request{Table: e.table.Load(), Metrics: e.m}}
}

// Leases returns the concurrency rules of an Acquire, in the order added.
func (c *Acquire) Leases() []*request.Item { return itemsOf(c.held) }

// AddRule adds the rule ruleID for key at cost (0 means 1; a concurrency
// rule's cost must be 0 or 1: a lease is one request in flight). Errors
// are as for Check.AddRule.
func (c *Acquire) AddRule(ruleID, key string, cost float64) (*request.Item, error) {
	it, err := c.addRule(ruleID, key, cost)
	c.Counted(err)
	return it, err
}

func (c *Acquire) addRule(ruleID, key string, cost float64) (*request.Item, error) {
	en, err := c.Lookup(ruleID, key)
	if err != nil {
		return nil, err
	}
	if !en.Rule.Concurrent() {
		return nil, request.Invalid("rule_id", "rule_id: rule %s: %w: call Check", request.Quote(ruleID), ErrNotConcurrency)
	}
	if cost != 0 && cost != 1 {
		return nil, request.Invalid("cost", "cost: rule %s counts each request once: cost must be 0 or 1, got %v", request.Quote(ruleID), cost)
	}
	return c.addLease(en, key)
}

// AddAttributes adds every rule whose match a satisfies, as
// Check.AddAttributes does, and every concurrency rule it matches as a
// lease (whatever the cost). enforce and shadow are the rate rules.
func (c *Acquire) AddAttributes(a *rules.Attributes, reqCost float64) (enforce, shadow []*request.Item, err error) {
	enforce, shadow, err = c.Match(a, reqCost, func(_ *rules.Rule, en *request.Entry, key string) error {
		// A lease is one request in flight, whatever the cost.
		_, err := c.addLease(en, key)
		return err
	})
	c.Counted(err)
	return enforce, shadow, err
}

// addLease adds a concurrency rule of an Acquire.
func (c *Acquire) addLease(en *request.Entry, key string) (*request.Item, error) {
	for _, l := range c.held {
		if l.Entry == en && l.Key == key {
			return l.Item, nil
		}
	}
	if len(c.held) >= leaseid.MaxParts {
		return nil, request.Invalid("attributes", "attributes: more than %d concurrency rules match: the most one Acquire holds", leaseid.MaxParts)
	}
	l := &heldLease{Item: &request.Item{Rule: en.Rule, Key: key, Cost: 1, Entry: en, Against: en.Limit}}
	c.held = append(c.held, l)
	return l.Item, nil
}

// leaseLimit is what a lease of en with flags is held against: the rule's
// limit, or this region's share of it (leaseid.Regional), or this instance's
// share of either (leaseid.Fallback).
func leaseLimit(en *request.Entry, flags byte, fleet int) bucket.LeaseLimit {
	l := en.Leases
	if flags&leaseid.Regional != 0 {
		l = en.RegionalLeases
	}
	if flags&leaseid.Fallback != 0 {
		l = l.Share(fleet)
	}
	return l
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
// with ErrUnavailable. The lease id names where each lease is held.
//
// An Acquire is routed with the topology in force when it starts; a home
// that refuses it as stale makes it routed again once, as Decide does.
func (e *Engine) Acquire(ctx context.Context, c *Acquire) (bool, *Lease, error) {
	return e.run(ctx, &c.Request, c)
}

// routeLeases names in the plan's lease id where each concurrency rule
// is held: at its key's home region for a pinned rule homed elsewhere,
// here otherwise.
func (e *Engine) routeLeases(p *plan) (bool, error) {
	c := p.a
	p.id = leaseid.New(e.region, p.ts.Gen, make([]leaseid.Part, len(c.held)))
	for i, it := range c.held {
		it.Route, it.part = request.RouteNone, i
		p.id.Parts[i] = leaseid.Part{Rule: it.Rule.ID, Key: it.Key, Region: e.region}
		if home := e.homeOf(p.ts, &c.Request, it.Item); home != "" {
			p.id.Parts[i].Region = home
			if p.byHome == nil {
				p.byHome = map[string][]int{}
			}
			if p.byHome[home] == nil {
				p.leaseHomes = append(p.leaseHomes, home)
			}
			p.byHome[home] = append(p.byHome[home], i)
			continue
		}
		p.here = append(p.here, i)
	}
	slices.Sort(p.leaseHomes)
	return true, nil
}

// leasesAtHomes asks each home region to hold its keys' leases. A home's
// failure goes to the failure policy: refused, or held here with this
// region's share of each limit.
func (e *Engine) leasesAtHomes(ctx context.Context, p *plan) (bool, error) {
	c := p.a
	for _, home := range p.leaseHomes {
		allowed, err := e.acquireAt(ctx, c, p.ts, home, p.byHome[home], p.id)
		if err == nil {
			if !allowed {
				c.notAsked()
				return false, nil
			}
			p.push(undoStep{kind: undoLeaseHome, home: home})
			continue
		}
		if ctx.Err() == nil {
			if err := e.homeFailed(p.ts, p.rerouted, home, err); err != nil {
				return false, err
			}
		}
		its := make([]*request.Item, len(p.byHome[home]))
		for j, i := range p.byHome[home] {
			its[j] = c.held[i].Item
		}
		// The home may hold them (its outcome unknown, or the caller
		// gone): it is asked to give them back, else they expire there.
		mayHold := ctx.Err() != nil || errors.Is(err, bucket.ErrOutcomeUnknown)
		if v, ferr := e.onFailure(ctx, failure{items: its, where: "home region " + home, lease: true}, err); v == refused {
			if mayHold {
				p.push(undoStep{kind: undoLeaseHome, home: home})
			}
			return false, ferr
		}
		if mayHold {
			e.releaseAt(ctx, p.ts, home, p.id)
		}
		// Fail open: held here, with this region's share of each limit.
		for _, i := range p.byHome[home] {
			p.id.Parts[i].Region, p.id.Parts[i].Flags = e.region, leaseid.Regional
			p.here = append(p.here, i)
		}
	}
	return true, nil
}

// leasesHere takes the leases held here in one store call.
func (e *Engine) leasesHere(ctx context.Context, p *plan) (bool, error) {
	c := p.a
	p.heldHere = make([]*heldLease, len(p.here))
	for j, i := range p.here {
		p.heldHere[j] = c.held[i]
	}
	allowed, err := e.takeLeases(ctx, c, p.heldHere, p.id)
	if err != nil || !allowed {
		return false, err
	}
	if len(p.heldHere) > 0 {
		p.push(undoStep{kind: undoLeases, held: p.heldHere})
	}
	p.leasesHeld = true
	return true, nil
}

// granted is the Lease of an allowed Acquire's plan; its leases held here
// are counted and tracked.
func (e *Engine) granted(p *plan) *Lease {
	l := &Lease{ID: p.id.String()}
	var expires time.Time // of the leases held here
	for _, it := range p.a.held {
		if l.Expires.IsZero() || it.expires.Before(l.Expires) {
			l.Expires = it.expires
		}
		if ttl := it.Entry.Leases.TTL; l.TTL == 0 || ttl < l.TTL {
			l.TTL = ttl
		}
	}
	for _, it := range p.heldHere {
		if expires.IsZero() || it.expires.Before(expires) {
			expires = it.expires
		}
		// Counted where held: a home counts the leases it holds.
		it.Entry.Lease[metrics.EventAcquired].Inc()
		if it.Route == request.RouteFallback {
			it.Entry.Lease[metrics.EventFallback].Inc()
		}
	}
	if len(p.heldHere) > 0 {
		e.inflight.Add(p.id.Member(), trackedRules(p.heldHere), expires)
	}
	return l
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

// notAsked gives the items a refusal left undecided the answer of a
// bucket that nothing was spent from.
func (c *Acquire) notAsked() {
	for _, it := range c.held {
		if it.Route == request.RouteNone {
			l := float64(it.Entry.Leases.Limit)
			it.Decision = bucket.Decision{Allowed: true, Remaining: l, Limit: l}
		}
	}
	for _, it := range c.Enforce {
		it.Decision = bucket.Decision{Allowed: true, Remaining: it.Entry.Limit.Capacity, Limit: it.Entry.Limit.Capacity}
		it.Route = request.RouteNone
	}
}

// takeLeases takes the leases of items (c's concurrency rules held here)
// under id, from the store or, when it fails, as the rules' on_failure
// says.
func (e *Engine) takeLeases(ctx context.Context, c *Acquire, items []*heldLease, id *leaseid.ID) (bool, error) {
	if len(items) == 0 {
		return true, nil
	}
	fleet := max(e.fleet(), 1)
	reqs := make([]bucket.LeaseRequest, len(items))
	for i, it := range items {
		reqs[i] = e.partRequest(it, id, fleet)
	}
	var ds []bucket.LeaseDecision
	var err error
	if e.leaseStore == nil {
		err = errors.New("the store holds no leases")
	} else {
		ds, err = e.leaseStore.Acquire(ctx, reqs, id.Member())
	}
	var me *bucket.MultiError
	if err != nil && errors.As(err, &me) && len(me.Errs) == len(reqs) && len(ds) == len(reqs) {
		// Some clients' leases were decided: a refusal among them refuses
		// (the store gave back whatever the others took).
		for i, it := range items {
			if me.Errs[i] == nil && !ds[i].Allowed {
				it.Route = request.RouteStore
				it.Decision = bucket.Decision{Limit: float64(it.Entry.Leases.Limit), RetryAfter: ds[i].RetryAfter, ResetAfter: ds[i].RetryAfter}
				it.Entry.Lease[metrics.EventRefused].Inc()
				c.notAsked()
				return false, nil
			}
		}
	}
	if err != nil {
		if v, err := e.onFailure(ctx, failure{items: itemsOf(items), where: "lease store", lease: true}, err); v == refused {
			return false, err
		}
		// Fail open: this instance's share of each limit, held here. The
		// store gave back whatever it may have taken.
		for i, it := range items {
			id.Parts[it.part].Flags |= leaseid.Fallback
			it.Route = request.RouteFallback
			reqs[i] = e.partRequest(it, id, fleet)
		}
		ds, _ = e.fallback.Acquire(ctx, reqs, id.Member())
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
			Limit: float64(it.Entry.Leases.Limit), RetryAfter: d.RetryAfter, ResetAfter: d.RetryAfter}
		if !d.Allowed {
			all = false
			it.Entry.Lease[metrics.EventRefused].Inc()
		}
	}
	if !all {
		// Nothing is held: the rate rules are not asked.
		c.notAsked()
	}
	return all, nil
}

func (e *Engine) partRequest(it *heldLease, id *leaseid.ID, fleet int) bucket.LeaseRequest {
	return bucket.LeaseRequest{Rule: it.Rule.ID, Key: it.Key, Limit: leaseLimit(it.Entry, id.Parts[it.part].Flags, fleet)}
}

// giveLeasesBack releases the leases an Acquire took here when a later
// part refused or failed.
func (e *Engine) giveLeasesBack(ctx context.Context, items []*heldLease, id *leaseid.ID) {
	if len(items) == 0 {
		return
	}
	rctx, cancel := e.detached(ctx)
	defer cancel()
	fleet := max(e.fleet(), 1)
	reqs := make([]bucket.LeaseRequest, len(items))
	for i, it := range items {
		reqs[i] = e.partRequest(it, id, fleet)
	}
	// The leases held here were taken in one store call: one store.
	if _, err := e.leaseStoreOf(id.Parts[items[0].part].Flags).Release(rctx, reqs, id.Member()); err != nil {
		e.log.Warn("the leases of a refused acquire not given back: they expire on their own", "err", err)
	}
}

func (e *Engine) leaseStoreOf(flags byte) bucket.LeaseStore {
	if flags&leaseid.Fallback != 0 || e.leaseStore == nil {
		return e.fallback
	}
	return e.leaseStore
}

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
func (e *Engine) leaseParts(ts *homes.State, s string) (*leaseid.ID, []heldPart, map[string][]heldPart, error) {
	id, err := parseLeaseID(s)
	if err == nil {
		err = e.checkParts(ts, id)
	}
	if err != nil {
		e.m.Invalid.WithLabelValues("lease_id").Inc()
		return nil, nil, nil, err
	}
	t := e.table.Load()
	fleet := max(e.fleet(), 1)
	var here []heldPart
	var remote map[string][]heldPart
	for _, p := range id.Parts {
		en := t.ByID[p.Rule]
		if en == nil {
			continue
		}
		hp := heldPart{Part: p, en: en, req: bucket.LeaseRequest{Rule: p.Rule, Key: p.Key, Limit: leaseLimit(en, p.Flags, fleet)}}
		if p.Region == e.region {
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
func (e *Engine) checkParts(ts *homes.State, id *leaseid.ID) error {
	t := e.table.Load()
	for _, p := range id.Parts {
		en := t.ByID[p.Rule]
		if en == nil {
			continue
		}
		if !en.Rule.Concurrent() {
			return request.Invalid("lease_id", "lease_id: rule %s: %w", request.Quote(p.Rule), ErrNotConcurrency)
		}
		if p.Region != e.region && (ts.Topo == nil || !ts.Topo.Has(p.Region)) {
			return request.Invalid("lease_id", "lease_id: held in region %s, which is not a region of the topology of %s", request.Quote(p.Region), request.Quote(e.region))
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
// those held in another region through its Peer service. A lease unknown,
// expired or already released is no error: released is then false (true
// when any of its leases was held). Errors: an *request.InvalidError of lease_id,
// ErrLeaseStore (the store here did not answer) or ErrLeaseHome (the
// region holding a lease did not answer); the leases not released expire
// on their own, and a Release again is safe.
func (e *Engine) Release(ctx context.Context, leaseID string) (released bool, _ error) {
	return e.release(ctx, leaseID, false)
}

// PeerRelease is a Release forwarded by a peer region: it gives back the
// leases held here and leaves the others (never forwarded again).
func (e *Engine) PeerRelease(ctx context.Context, leaseID string) (released bool, _ error) {
	return e.release(ctx, leaseID, true)
}

func (e *Engine) release(ctx context.Context, leaseID string, peer bool) (bool, error) {
	ts := e.topo.Use()
	defer ts.Release()
	id, here, remote, err := e.leaseParts(ts, leaseID)
	if err != nil {
		return false, err
	}
	tracked := e.inflight.Remove(id.Member())
	released, err := e.releaseHere(ctx, id, here, tracked)
	if peer {
		return released, err
	}
	for _, r := range slices.Sorted(maps.Keys(remote)) {
		ok, rerr := e.releaseRemote(ctx, ts, r, leaseID, remote[r])
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
func (e *Engine) releaseHere(ctx context.Context, id *leaseid.ID, parts []heldPart, tracked bool) (released bool, _ error) {
	for _, group := range byStore(parts) {
		reqs := make([]bucket.LeaseRequest, len(group))
		for i, p := range group {
			reqs[i] = p.req
		}
		held, err := e.leaseStoreOf(group[0].Flags).Release(ctx, reqs, id.Member())
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
func (e *Engine) Renew(ctx context.Context, leaseID string) (renewed bool, _ *Lease, _ error) {
	return e.renew(ctx, leaseID, false)
}

// PeerRenew is a Renew forwarded by a peer region: it renews the leases
// held here (and when one is gone, releases the others held here).
func (e *Engine) PeerRenew(ctx context.Context, leaseID string) (renewed bool, _ *Lease, _ error) {
	return e.renew(ctx, leaseID, true)
}

func (e *Engine) renew(ctx context.Context, leaseID string, peer bool) (bool, *Lease, error) {
	ts := e.topo.Use()
	defer ts.Release()
	id, here, remote, err := e.leaseParts(ts, leaseID)
	if err != nil {
		return false, nil, err
	}
	if peer {
		remote = nil
	}
	if len(here) == 0 && len(remote) == 0 {
		e.inflight.Remove(id.Member())
		return false, nil, nil
	}
	l := &Lease{ID: leaseID}
	gone := false
	for _, p := range append(slices.Concat(slices.Collect(maps.Values(remote))...), here...) {
		if e.unrenewable(ts, p) {
			gone = true
		}
	}
	if gone {
		e.renewGone(ctx, ts, id, leaseID, here, remote)
		return false, nil, nil
	}
	extend := func(expires time.Time, ttl time.Duration) {
		if l.Expires.IsZero() || expires.Before(l.Expires) {
			l.Expires = expires
		}
		if l.TTL == 0 || ttl < l.TTL {
			l.TTL = ttl
		}
	}
	for _, group := range byStore(here) {
		reqs := make([]bucket.LeaseRequest, len(group))
		for i, p := range group {
			reqs[i] = p.req
		}
		ds, err := e.leaseStoreOf(group[0].Flags).Renew(ctx, reqs, id.Member())
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
		ok, expires, ttl, err := e.renewRemote(ctx, ts, r, leaseID, remote[r])
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
		e.renewGone(ctx, ts, id, leaseID, here, remote)
		return false, nil, nil
	}
	for _, p := range here {
		p.en.Lease[metrics.EventRenewed].Inc()
	}
	e.inflight.Renew(id.Member(), l.Expires)
	return true, l, nil
}

// renewGone ends a lease a Renew found gone (or may not renew): the rest
// of it is released, here and in the regions holding its other parts.
func (e *Engine) renewGone(ctx context.Context, ts *homes.State, id *leaseid.ID, leaseID string, here []heldPart, remote map[string][]heldPart) {
	for _, p := range here {
		p.en.Lease[metrics.EventGone].Inc()
	}
	if e.inflight.Remove(id.Member()) {
		for _, p := range here {
			p.en.Lease[metrics.EventExpired].Inc()
		}
	}
	rctx, cancel := e.detached(ctx)
	defer cancel()
	if _, err := e.releaseHere(rctx, id, here, false); err != nil {
		e.log.Warn("the rest of a lease gone not released: it expires on its own", "err", err)
	}
	for _, r := range slices.Sorted(maps.Keys(remote)) {
		if _, err := e.releaseRemote(rctx, ts, r, leaseID, remote[r]); err != nil {
			e.log.Warn("the rest of a lease gone not released in the region holding it: it expires there on its own", "region", r, "err", err)
		}
	}
}

// unrenewable says a pinned rule's lease is not renewed, so that the
// global limit holds again within one lease length: a lease held where the
// topology in force no longer homes its key (the home moved: it stays
// until released or expired, and new leases are taken at the new home),
// and a region's share taken while the home did not answer (acquiring
// again goes to the home, or takes a share again).
func (e *Engine) unrenewable(ts *homes.State, p heldPart) bool {
	if !p.en.Pinned || ts.Topo == nil {
		return false
	}
	return p.Flags&leaseid.Regional != 0 || ts.Topo.Home(p.Key, p.en.Rule.HomeKeys) != p.Region
}
