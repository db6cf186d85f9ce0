package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// Errors of the lease operations.
var (
	// ErrConcurrencyRule: a Check (by rule id or attributes) met a
	// concurrency rule, which only Acquire holds: a Check has no end to
	// release it at. Its *InvalidError names the rule.
	ErrConcurrencyRule = errors.New("a concurrency rule is held by Acquire and Release, not checked")
	// ErrNotConcurrency: an Acquire by rule id, or a lease id, names a
	// rule that is not a concurrency rule.
	ErrNotConcurrency = errors.New("not a concurrency rule")
	// ErrLeaseStore: the store did not answer a Release or Renew; the
	// lease expires on its own.
	ErrLeaseStore = errors.New("lease store unavailable")
)

// ReleaseTimeout bounds giving back the leases of an Acquire refused by a
// rate rule (on a context of its own: the caller may be gone).
const ReleaseTimeout = 100 * time.Millisecond

// MaxTrackedLeases bounds the leases this instance tracks for
// limiter_concurrency_leases_in_flight; past it, new leases are held but
// not tracked (limiter_concurrency_untracked_total).
const MaxTrackedLeases = 1 << 20

// Lease events, the values of the event label.
const (
	eventAcquired = "acquired"
	eventRefused  = "refused"
	eventReleased = "released"
	eventExpired  = "expired"
	eventRenewed  = "renewed"
	eventGone     = "renew_gone"
	eventFallback = "fallback_acquired"
	eventError    = "error"
)

var leaseEvents = []string{eventAcquired, eventRefused, eventReleased, eventExpired, eventRenewed, eventGone, eventFallback, eventError}

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

// NewAcquire starts an Acquire under the rules in force now: like a
// Check, but its concurrency rules take leases.
func (e *Engine) NewAcquire() *Check { return &Check{t: e.table.Load(), m: e.m, acquire: true} }

// Leases returns the concurrency rules of an Acquire, in the order added.
func (c *Check) Leases() []*Item { return c.held }

// addLease adds a concurrency rule of an Acquire.
func (c *Check) addLease(en *entry, key string) (*Item, error) {
	for _, it := range c.held {
		if it.e == en && it.Key == key {
			return it, nil
		}
	}
	if len(c.held) >= MaxLeasesPerCheck {
		return nil, invalid("attributes", "attributes: more than %d concurrency rules match: the most one Acquire holds", MaxLeasesPerCheck)
	}
	it := &Item{Rule: en.rule, Key: key, Cost: 1, e: en, limit: en.limit}
	c.held = append(c.held, it)
	return it, nil
}

func concurrencyCheckError(field, prefix, rule string) *InvalidError {
	return invalid(field, "%srule %s: %w: call Acquire before the request and Release after it", prefix, quote(rule), ErrConcurrencyRule)
}

func (it *Item) leaseRequest(fleet int) bucket.LeaseRequest {
	l := it.e.leases
	if it.route == routeFallback {
		l = l.Share(fleet)
	}
	return bucket.LeaseRequest{Rule: it.Rule.ID, Key: it.Key, Limit: l}
}

// Acquire decides an Acquire: a lease of every concurrency rule and a
// spend of every rate rule, all or nothing. The leases are taken first, in
// one store call; when one refuses nothing else is asked. Then the rate
// rules are decided as Decide does, and when they refuse, the leases are
// given back. A refusal is allowed false and a nil error, and the items say
// which rule refused: a concurrency rule's RetryAfter is the time until the
// soonest lease held expires. When the store fails, fail-open rules take
// their leases from this instance's fallback store, each with its share of
// the limit (limit / fleet); fail-closed ones refuse with ErrUnavailable.
func (e *Engine) Acquire(ctx context.Context, c *Check) (bool, *Lease, error) {
	if !c.acquire {
		return false, nil, errors.New("engine: Acquire of a check not made by NewAcquire")
	}
	if len(c.held) == 0 {
		allowed, err := e.Decide(ctx, c)
		return allowed, nil, err
	}
	parts := make([]leasePart, len(c.held))
	for i, it := range c.held {
		it.route = routeNone
		parts[i] = leasePart{rule: it.Rule.ID, key: it.Key}
	}
	id := newLeaseID(e.region, parts)
	allowed, err := e.takeLeases(ctx, c, id)
	if err != nil || !allowed {
		return false, nil, err
	}
	allowed, err = e.Decide(ctx, c)
	if err != nil || !allowed {
		e.giveLeasesBack(ctx, c, id)
		for _, it := range c.held {
			it.Decision.Remaining = min(it.Decision.Limit, it.Decision.Remaining+1)
		}
		return false, nil, err
	}
	l := &Lease{ID: id.String()}
	for _, it := range c.held {
		if l.Expires.IsZero() || it.expires.Before(l.Expires) {
			l.Expires = it.expires
		}
		if ttl := it.e.leases.TTL; l.TTL == 0 || ttl < l.TTL {
			l.TTL = ttl
		}
		it.e.lease[eventAcquired].Inc()
		if it.route == routeFallback {
			it.e.lease[eventFallback].Inc()
		}
	}
	e.inflight.add(id.member(), c.held, l.Expires)
	return true, l, nil
}

// takeLeases takes the leases of c's concurrency rules under id, from the
// store or, when it fails, as the rules' on_failure says.
func (e *Engine) takeLeases(ctx context.Context, c *Check, id *leaseID) (bool, error) {
	reqs := make([]bucket.LeaseRequest, len(c.held))
	for i, it := range c.held {
		reqs[i] = it.leaseRequest(1)
	}
	var ds []bucket.LeaseDecision
	var err error
	if e.leaseStore == nil {
		err = errors.New("the store holds no leases")
	} else {
		ds, err = e.leaseStore.Acquire(ctx, reqs, id.member())
	}
	var me *bucket.MultiError
	if err != nil && errors.As(err, &me) && len(me.Errs) == len(reqs) && len(ds) == len(reqs) {
		// Some clients' leases were decided: a refusal among them refuses
		// (the store gave back whatever the others took).
		for i, it := range c.held {
			if me.Errs[i] == nil && !ds[i].Allowed {
				it.route = routeStore
				it.Decision = bucket.Decision{Limit: float64(it.e.leases.Limit), RetryAfter: ds[i].RetryAfter, ResetAfter: ds[i].RetryAfter}
				it.e.lease[eventRefused].Inc()
				return false, nil
			}
		}
	}
	if err != nil {
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		if errors.Is(err, bucket.ErrOverloaded) {
			e.m.overloaded.Inc()
			return false, ErrOverloaded
		}
		for _, it := range c.held {
			if it.e.closed {
				it.e.lease[eventError].Inc()
				e.log.Warn("lease store failed, fail-closed concurrency rule refused", "rule", it.Rule.ID, "err", err)
				return false, ErrUnavailable
			}
		}
		// Fail open: this instance's share of each limit, held here. The
		// store gave back whatever it may have taken.
		id.flags |= leaseFallback
		fleet := max(e.fleet(), 1)
		for i, it := range c.held {
			it.route = routeFallback
			reqs[i] = it.leaseRequest(fleet)
		}
		ds, _ = e.fallback.Acquire(ctx, reqs, id.member())
	} else {
		for _, it := range c.held {
			it.route = routeStore
		}
	}
	all := true
	for i, it := range c.held {
		d := ds[i]
		it.expires = d.Expires
		it.Decision = bucket.Decision{Allowed: d.Allowed, Remaining: float64(max(it.e.leases.Limit-d.InFlight, 0)),
			Limit: float64(it.e.leases.Limit), RetryAfter: d.RetryAfter, ResetAfter: d.RetryAfter}
		if !d.Allowed {
			all = false
			it.e.lease[eventRefused].Inc()
		}
	}
	if !all {
		// Nothing is held: the rate rules are not asked.
		for _, it := range c.enforce {
			it.Decision = bucket.Decision{Allowed: true, Remaining: it.e.limit.Capacity, Limit: it.e.limit.Capacity}
			it.route = routeNone
		}
	}
	return all, nil
}

// giveLeasesBack releases the leases an Acquire took when its rate rules
// refused or failed.
func (e *Engine) giveLeasesBack(ctx context.Context, c *Check, id *leaseID) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ReleaseTimeout)
	defer cancel()
	reqs := make([]bucket.LeaseRequest, len(c.held))
	for i, it := range c.held {
		reqs[i] = it.leaseRequest(1)
	}
	if _, err := e.leaseStoreOf(id).Release(rctx, reqs, id.member()); err != nil {
		e.log.Warn("the leases of a refused acquire not given back: they expire on their own", "err", err)
	}
}

func (e *Engine) leaseStoreOf(id *leaseID) bucket.LeaseStore {
	if id.flags&leaseFallback != 0 || e.leaseStore == nil {
		return e.fallback
	}
	return e.leaseStore
}

// leaseParts reads a caller's lease id: the requests of its rules in force,
// and their entries. A rule no longer in force holds nothing (its part is
// left out); a rule that is not a concurrency rule, or a lease id of
// another region, is an *InvalidError of lease_id.
func (e *Engine) leaseParts(s string) (*leaseID, []bucket.LeaseRequest, []*entry, error) {
	id, err := parseLeaseID(s)
	if err != nil {
		e.m.invalid.WithLabelValues("lease_id").Inc()
		return nil, nil, nil, err
	}
	if id.region != e.region {
		e.m.invalid.WithLabelValues("lease_id").Inc()
		return nil, nil, nil, invalid("lease_id", "lease_id: held in region %s, not in %s: release or renew it there", quote(id.region), quote(e.region))
	}
	t := e.table.Load()
	var reqs []bucket.LeaseRequest
	var ens []*entry
	for _, p := range id.parts {
		en := t.byID[p.rule]
		if en == nil {
			continue
		}
		if !en.rule.Concurrent() {
			e.m.invalid.WithLabelValues("lease_id").Inc()
			return nil, nil, nil, invalid("lease_id", "lease_id: rule %s: %w", quote(p.rule), ErrNotConcurrency)
		}
		l := en.leases
		if id.flags&leaseFallback != 0 {
			l = l.Share(max(e.fleet(), 1))
		}
		reqs = append(reqs, bucket.LeaseRequest{Rule: p.rule, Key: p.key, Limit: l})
		ens = append(ens, en)
	}
	return id, reqs, ens, nil
}

// Release gives back the leases of a lease id. A lease unknown, expired or
// already released is no error: released is then false. Errors: an
// *InvalidError of lease_id, or ErrLeaseStore (the lease expires on its
// own).
func (e *Engine) Release(ctx context.Context, leaseID string) (released bool, _ error) {
	id, reqs, ens, err := e.leaseParts(leaseID)
	if err != nil {
		return false, err
	}
	tracked := e.inflight.remove(id.member())
	if len(reqs) == 0 {
		return false, nil
	}
	held, err := e.leaseStoreOf(id).Release(ctx, reqs, id.member())
	if err != nil {
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		for _, en := range ens {
			en.lease[eventError].Inc()
		}
		return false, fmt.Errorf("%w: %w", ErrLeaseStore, err)
	}
	for i, en := range ens {
		if held[i] {
			released = true
			en.lease[eventReleased].Inc()
		} else if tracked {
			// It expired before its release: counted as expired.
			en.lease[eventExpired].Inc()
		}
	}
	return released, nil
}

// Renew extends the leases of a lease id by their rules' lease length. When
// any of them is gone (expired, released, or never held), the lease is
// gone: the others are released, and renewed is false: the caller must stop
// the request's work or acquire again. Errors as for Release.
func (e *Engine) Renew(ctx context.Context, leaseID string) (renewed bool, _ *Lease, _ error) {
	id, reqs, ens, err := e.leaseParts(leaseID)
	if err != nil {
		return false, nil, err
	}
	if len(reqs) == 0 {
		e.inflight.remove(id.member())
		return false, nil, nil
	}
	ds, err := e.leaseStoreOf(id).Renew(ctx, reqs, id.member())
	if err != nil {
		if ctx.Err() != nil {
			return false, nil, ctx.Err()
		}
		for _, en := range ens {
			en.lease[eventError].Inc()
		}
		return false, nil, fmt.Errorf("%w: %w", ErrLeaseStore, err)
	}
	l := &Lease{ID: leaseID}
	gone := false
	for i, d := range ds {
		if !d.Allowed {
			gone = true
			continue
		}
		if l.Expires.IsZero() || d.Expires.Before(l.Expires) {
			l.Expires = d.Expires
		}
		if l.TTL == 0 || reqs[i].Limit.TTL < l.TTL {
			l.TTL = reqs[i].Limit.TTL
		}
	}
	if gone {
		for _, en := range ens {
			en.lease[eventGone].Inc()
		}
		if e.inflight.remove(id.member()) {
			for _, en := range ens {
				en.lease[eventExpired].Inc()
			}
		}
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ReleaseTimeout)
		defer cancel()
		if _, err := e.leaseStoreOf(id).Release(rctx, reqs, id.member()); err != nil {
			e.log.Warn("the rest of a lease gone not released: it expires on its own", "err", err)
		}
		return false, nil, nil
	}
	for _, en := range ens {
		en.lease[eventRenewed].Inc()
	}
	e.inflight.renew(id.member(), l.Expires)
	return true, l, nil
}

// inflight tracks the leases this instance granted and has not seen
// released or expire, for limiter_concurrency_leases_in_flight: a
// per-process count, honest without asking the store (a lease released
// through another instance counts here until its expiry). Safe for
// concurrent use.
type inflight struct {
	mu        sync.Mutex
	leases    map[string]*tracked
	count     map[*entry]int
	nextSweep time.Time
	untracked prometheus.Counter
	desc      *prometheus.Desc
	rules     func() []*entry
}

type tracked struct {
	entries []*entry
	expires time.Time
}

func newInflight(rules func() []*entry, untracked prometheus.Counter) *inflight {
	return &inflight{
		leases: make(map[string]*tracked), count: make(map[*entry]int), untracked: untracked, rules: rules,
		desc: prometheus.NewDesc("limiter_concurrency_leases_in_flight",
			"Leases of a concurrency rule this instance granted and has not seen released or expire, by rule.", []string{"rule"}, nil),
	}
}

func (f *inflight) add(member string, items []*Item, expires time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sweep(time.Now())
	if len(f.leases) >= MaxTrackedLeases {
		f.untracked.Inc()
		return
	}
	t := &tracked{expires: expires}
	for _, it := range items {
		t.entries = append(t.entries, it.e)
		f.count[it.e]++
	}
	f.leases[member] = t
}

// remove stops tracking a lease; it reports whether it was tracked.
func (f *inflight) remove(member string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	t := f.leases[member]
	if t == nil {
		return false
	}
	f.drop(member, t)
	return true
}

func (f *inflight) renew(member string, expires time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if t := f.leases[member]; t != nil {
		t.expires = expires
	}
}

func (f *inflight) drop(member string, t *tracked) {
	delete(f.leases, member)
	for _, en := range t.entries {
		if f.count[en]--; f.count[en] <= 0 {
			delete(f.count, en)
		}
	}
}

// sweep drops the leases past their expiry, counting them as expired; at
// most once a second unless a scrape asks.
func (f *inflight) sweep(now time.Time) {
	if now.Before(f.nextSweep) {
		return
	}
	f.nextSweep = now.Add(time.Second)
	for m, t := range f.leases {
		if !t.expires.After(now) {
			for _, en := range t.entries {
				en.lease[eventExpired].Inc()
			}
			f.drop(m, t)
		}
	}
}

// Describe and Collect make inflight a prometheus.Collector: the gauge of
// every concurrency rule in force, 0 included.
func (f *inflight) Describe(ch chan<- *prometheus.Desc) { ch <- f.desc }

func (f *inflight) Collect(ch chan<- prometheus.Metric) {
	f.mu.Lock()
	f.nextSweep = time.Time{}
	f.sweep(time.Now())
	counts := make(map[string]int, len(f.count))
	for en, n := range f.count {
		counts[en.rule.ID] += n
	}
	f.mu.Unlock()
	for _, en := range f.rules() {
		ch <- prometheus.MustNewConstMetric(f.desc, prometheus.GaugeValue, float64(counts[en.rule.ID]), en.rule.ID)
	}
}
