package engine

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// shadowLogRate is the share of shadow refusals logged.
const shadowLogRate = 0.01

// Decide decides the check's enforced rules together, all or nothing, and
// then, when it is allowed, its shadow rules (which refuse nothing).
// Afterwards every item has a Decision. A refusal is a decision: allowed
// false and a nil error. Errors: ErrUnavailable when a fail-closed rule
// could not be decided, ErrOverloaded, the context's error, or the home
// region's *InvalidError or ErrUnknownRule for a pinned rule.
//
// The order: the deny cache (a denial already known refuses at once,
// spending nothing); the rules pinned to another home region, forwarded
// there; the rules with leases, from this instance's lease; the rest in
// one store call (one script per client slot). A later part that refuses
// gives back what the earlier parts spent: the leases here, the home
// region's spend by a refund.
//
// A check is routed with the topology in force when it starts. When a home
// refuses it as routed with a stale topology and reading the topology again
// puts a newer one in force, it is routed again with that one, once.
func (e *Engine) Decide(ctx context.Context, c *Check) (bool, error) {
	return e.decideRequest(ctx, &c.request)
}

// decideRequest is Decide of a check's or an Acquire's rate rules.
func (e *Engine) decideRequest(ctx context.Context, c *request) (bool, error) {
	ts := e.useTopology()
	allowed, err := e.decideUnder(ctx, c, ts, false)
	ts.release()
	if errors.Is(err, errReroute) {
		ts = e.useTopology()
		allowed, err = e.decideUnder(ctx, c, ts, true)
		ts.release()
	}
	return allowed, err
}

// decideUnder is Decide with the check routed under the topology of ts
// (rerouted: a second time). Its errReroute says a home refused it as
// stale and a newer topology is in force: the caller routes it again.
func (e *Engine) decideUnder(ctx context.Context, c *request, ts *topoState, rerouted bool) (bool, error) {
	for _, it := range c.enforce {
		it.probe, it.remembered = false, false
	}
	c.ts, c.rerouted = ts, rerouted
	allowed, err := e.decide(ctx, c)
	if e.deny != nil {
		for _, it := range c.enforce {
			if it.probe && !it.remembered {
				// The probe's answer leaves the key free to ask the store.
				e.deny.Forget(it.Rule.ID, it.Key)
			}
		}
	}
	if err != nil {
		return false, err
	}
	e.count(c, allowed)
	if !allowed {
		for _, it := range c.enforce {
			if !it.Decision.Allowed || it.route == routeNone {
				continue
			}
			if it.Decision.Remaining < it.Decision.Limit {
				// Its spend was given back.
				it.Decision.Remaining = min(it.Decision.Limit, it.Decision.Remaining+it.Cost)
			}
			if e.deny != nil && it.route != routeFallback {
				// Given back: a denial another check left meanwhile may
				// not hold any more.
				e.deny.Forget(it.Rule.ID, it.Key)
			}
		}
		return false, nil
	}
	e.shadows(ctx, c.shadow)
	return true, nil
}

// spent is what the earlier parts of a check spent, to give back when a
// later part refuses.
type spent struct {
	leases []*Item
	homes  []homeSpend
}

type homeSpend struct {
	home  string
	h     Home
	ts    *topoState
	items []*Item
}

func (e *Engine) decide(ctx context.Context, c *request) (admitted bool, _ error) {
	items := c.enforce
	for _, it := range items {
		it.Decision = bucket.Decision{Allowed: true, Remaining: it.e.limit.Capacity, Limit: it.e.limit.Capacity}
		it.route, it.limit, it.batch = routeNone, it.e.limit, 0
	}
	if len(items) == 0 {
		return true, nil
	}
	// A denial already known refuses the whole check (a check routed again
	// asked the deny cache the first time).
	sent := c.sent
	if e.deny != nil && !c.rerouted {
		refused := false
		for _, it := range items {
			var retry, reset time.Duration
			var hit, probe bool
			if c.maxWait > 0 {
				// Refused here only when its slot cannot come within
				// its wait (see denycache.GetBeyond).
				retry, reset, hit = e.deny.GetBeyond(it.Rule.ID, it.Key, it.Cost, c.maxWait)
			} else {
				retry, reset, hit, probe = e.deny.Get(it.Rule.ID, it.Key, it.Cost)
			}
			it.probe = probe
			if hit {
				it.route = routeDeny
				it.Decision = bucket.Decision{Limit: it.e.limit.Capacity, RetryAfter: retry, ResetAfter: reset}
				refused = true
			}
		}
		if refused {
			return false, nil
		}
		sent = e.deny.Now()
		c.sent = sent
	}
	var homes []string
	var remote map[string][]*Item
	var leased, local []*Item
	for _, it := range items {
		if home := e.homeOf(c.ts, c, it); home != "" {
			if remote == nil {
				remote = make(map[string][]*Item)
			}
			if remote[home] == nil {
				homes = append(homes, home)
			}
			remote[home] = append(remote[home], it)
			continue
		}
		if it.Rule.Lease > 0 && c.maxWait == 0 {
			// A paced check never reserves from a lease: it goes to
			// the store, whose state holds every reservation.
			leased = append(leased, it)
			continue
		}
		local = append(local, it)
	}
	slices.Sort(homes)
	if c.maxWait > 0 && len(homes) > 0 && (len(homes) > 1 || len(local) > 0) {
		// One instant for every rule needs one place that decides them.
		return false, invalid("max_wait_ms", "max_wait_ms: %w: the check's rules are decided in different regions (rule %s is pinned to %s), which cannot reserve one instant",
			bucket.ErrInvalidWait, quote(remote[homes[0]][0].Rule.ID), homes[0])
	}
	// What the earlier parts spent; given back by every return below that
	// refuses or fails.
	var sp spent

	// The home regions of pinned rules.
	for _, home := range homes {
		its := remote[home]
		allowed, err := e.forward(ctx, c, home, its)
		if err == nil {
			if !allowed {
				e.remember(c, its, sent, false)
				return e.giveBack(ctx, &sp, nil)
			}
			sp.homes = append(sp.homes, homeSpend{home: home, h: c.ts.homes[home], ts: c.ts, items: its})
			continue
		}
		if ctx.Err() == nil {
			if err := e.homeFailed(c.ts, c.rerouted, home, err); err != nil {
				return e.giveBack(ctx, &sp, err)
			}
		}
		// (A paced check's unknown outcome is not uncertain: the home may
		// have reserved a slot up to its wait out, and sending now could go
		// above the rate. It is paced here with this region's share, as
		// below; it may count twice, which only slows it.)
		v, err := e.onFailure(ctx, failure{items: its, where: "home region " + home, paced: c.maxWait > 0}, err)
		switch v {
		case refused:
			return e.giveBack(ctx, &sp, err)
		case uncertain:
			for _, it := range its {
				it.route = routeUnknown
				it.Decision = bucket.Decision{Allowed: true, Limit: it.e.limit.Capacity}
			}
			continue
		}
		// Fail open: decide here with this region's share of the limit.
		for _, it := range its {
			it.limit = it.e.regional
			local = append(local, it)
		}
	}

	// Leases: what this instance holds, or a batch taken with the rest.
	// A batch this check takes is ended on every return from here on, a
	// later lease's wait ending early too: the key's other checks wait for
	// it.
	for _, it := range leased {
		ok, err := e.fromLease(ctx, c, it)
		switch {
		case err != nil:
			e.endBatches(local, false)
			return e.giveBack(ctx, &sp, err)
		case !ok:
			e.endBatches(local, false)
			return e.giveBack(ctx, &sp, nil)
		case it.route == routeLease:
			sp.leases = append(sp.leases, it)
		default:
			// This check takes the next batch, with the rest.
			local = append(local, it)
		}
	}
	defer func() { e.endBatches(local, admitted) }()
	if len(local) == 0 {
		return true, nil
	}
	// Keys a topology switch moved here take their old homes' buckets
	// first.
	var allowed bool
	var err error
	if err = e.handoff(ctx, c, local); err == nil {
		allowed, err = e.fromStore(ctx, c, local, sent)
	} else if sf, ok := errors.AsType[storeFailure](err); ok {
		// The store failed seeding a moved key: as if it failed the check.
		allowed, err = e.storeFailed(ctx, c, local, storeRequests(c, local), sf.err)
	}
	if err != nil {
		return e.giveBack(ctx, &sp, err)
	}
	if !allowed {
		return e.giveBack(ctx, &sp, nil)
	}
	return true, nil
}

// endBatches ends the lease batches that the items of local took: each
// adds what it left over when the check was admitted from the store, and
// wakes the key's checks waiting for it. (decide calls it on each return
// once a batch may be taken, deferred only after the last append to
// local, which would otherwise move local to the heap.)
func (e *Engine) endBatches(local []*Item, admitted bool) {
	for _, it := range local {
		if it.batch > 0 {
			left := 0.0
			if admitted && it.route == routeStore {
				left = it.batch - it.Cost
			}
			e.leases.Fetched(it.Rule.ID, it.Key, left)
		}
	}
}

// homeOf is the home region that decides it (a check) or holds it (a
// concurrency lease) under the topology of ts, or "" for this region: a
// pinned rule's key homed elsewhere, unless c was forwarded by a peer (a
// forwarded call is never forwarded again).
func (e *Engine) homeOf(ts *topoState, c *request, it *Item) string {
	if !it.e.pinned || ts.topo == nil || c.peer != "" {
		return ""
	}
	if home := ts.topo.Home(it.Key, it.Rule.HomeKeys); home != e.region {
		return home
	}
	return ""
}

// homeFailed says whether err, a home region's failure to answer a call
// made under the topology of ts, decides the call by itself; nil means
// the rules' on_failure decides. It is errReroute when the home's topology
// is newer and reading this region's file gave it the newer one too (at
// most once: not when rerouted), and err itself when the home's rules
// differ from this region's (an invalid request or an unknown rule there):
// the home's answer stands.
func (e *Engine) homeFailed(ts *topoState, rerouted bool, home string, err error) error {
	if errors.Is(err, ErrStaleTopology) {
		e.m.Stale.WithLabelValues(home).Inc()
		if !rerouted && e.reload != nil {
			if e.reload(); e.topo.Load().gen > ts.gen {
				return errReroute
			}
		}
		e.log.Warn("home region's topology is newer and this file has no newer one: the rules' on_failure decides",
			"home", home, "generation", ts.gen, "err", err)
	}
	var inv *InvalidError
	if errors.As(err, &inv) || errors.Is(err, ErrUnknownRule) {
		return err
	}
	return nil
}

// forward asks home to decide its items.
func (e *Engine) forward(ctx context.Context, c *request, home string, its []*Item) (bool, error) {
	h := c.ts.homes[home]
	if h == nil {
		return false, errors.New("no client for home region " + home)
	}
	req := make([]HomeItem, len(its))
	for i, it := range its {
		req[i] = HomeItem{Rule: it.Rule.ID, Key: it.Key, Cost: it.Cost, MaxWait: c.maxWait}
	}
	fctx, cancel := context.WithTimeout(ctx, e.fwdTO)
	defer cancel()
	allowed, ds, err := h.Decide(fctx, req)
	if err != nil && fctx.Err() != nil && ctx.Err() == nil && !errors.Is(err, bucket.ErrOutcomeUnknown) {
		// The forward ran out of its own time: the home may have decided.
		err = fmt.Errorf("%w: %w", bucket.ErrOutcomeUnknown, err)
	}
	if err == nil && len(ds) != len(its) {
		err = errors.New("home region answered for another number of rules")
	}
	if err != nil {
		for _, it := range its {
			it.e.forwardedFailed.Inc()
		}
		return false, err
	}
	for i, it := range its {
		it.route = routeHome
		it.Decision = ds[i]
		it.Decision.Limit = it.e.limit.Capacity
	}
	return allowed, nil
}

// fromLease hands out it.Cost from this instance's lease. When the lease
// runs short and no other check is taking the next batch, it makes this
// check the one to take it, with the store call of the check (route stays
// routeNone, batch set); checks that arrive meanwhile wait for that batch.
func (e *Engine) fromLease(ctx context.Context, c *request, it *Item) (bool, error) {
	for {
		left, ok, wait, fetch := e.leases.Take(it.Rule.ID, it.Key, it.Cost)
		switch {
		case ok:
			it.route = routeLease
			it.Decision = bucket.Decision{Allowed: true, Remaining: left, Limit: it.e.limit.Capacity}
			return true, nil
		case fetch:
			it.batch = max(it.Rule.Lease, it.Cost)
			return true, nil
		case wait == nil:
			// No room for another lease: this check alone, through the store.
			return true, nil
		default:
			select {
			case <-wait:
			case <-ctx.Done():
				return false, ctx.Err()
			}
			if e.deny != nil {
				if retry, reset, hit, _ := e.deny.Get(it.Rule.ID, it.Key, it.Cost); hit {
					it.route = routeDeny
					it.Decision = bucket.Decision{Limit: it.e.limit.Capacity, RetryAfter: retry, ResetAfter: reset}
					return false, nil
				}
			}
		}
	}
}

// fromStore decides items in one store call; when the store fails, the
// rules' on_failure decides.
func (e *Engine) fromStore(ctx context.Context, c *request, items []*Item, sent int64) (bool, error) {
	reqs := storeRequests(c, items)
	ds, err := e.takeAll(ctx, reqs)
	if err == nil && !allAllowed(ds) {
		// A lease batch larger than what is left: ask again with the
		// check's own costs.
		retry := false
		for i, it := range items {
			if it.batch > it.Cost && !ds[i].Allowed {
				reqs[i].Cost, it.batch, retry = it.Cost, it.Cost, true
			}
		}
		if retry {
			ds, err = e.takeAll(ctx, reqs)
		}
	}
	if err != nil {
		// me is declared here, not on the path of every check: errors.As
		// makes it escape to the heap.
		var me *bucket.MultiError
		if errors.As(err, &me) && len(me.Errs) == len(items) && len(ds) == len(items) {
			return e.partlyDecided(ctx, c, items, reqs, ds, me, sent)
		}
	}
	if err == nil {
		all := true
		for i, it := range items {
			it.route, it.Decision = routeStore, ds[i]
			it.Decision.Limit = it.e.limit.Capacity
			all = all && ds[i].Allowed
		}
		e.remember(c, items, sent, all)
		if all {
			for _, it := range items {
				if it.batch > it.Cost {
					// What the batch leaves over is this instance's.
					it.Decision.Remaining += it.batch - it.Cost
				}
			}
		}
		return all, nil
	}
	return e.storeFailed(ctx, c, items, reqs, err)
}

// partlyDecided finishes a store call that decided some items and not
// others. A refusal among the decided ones refuses the check (the store gave
// back what the others spent). Otherwise the decided ones stay spent, the
// rest are decided by storeFailed, and when that refuses (or errs) the
// decided ones are given back.
func (e *Engine) partlyDecided(ctx context.Context, c *request, items []*Item, reqs []bucket.Request, ds []bucket.Decision, me *bucket.MultiError, sent int64) (bool, error) {
	var decided, failed []*Item
	var failedReqs, spentReqs []bucket.Request
	refused := false
	for i, it := range items {
		if me.Errs[i] != nil {
			failed = append(failed, it)
			failedReqs = append(failedReqs, reqs[i])
			continue
		}
		it.route, it.Decision = routeStore, ds[i]
		it.Decision.Limit = it.e.limit.Capacity
		decided = append(decided, it)
		spentReqs = append(spentReqs, reqs[i])
		refused = refused || !ds[i].Allowed
	}
	e.remember(c, decided, sent, false)
	if refused {
		return false, nil
	}
	allowed, err := e.storeFailed(ctx, c, failed, failedReqs, errors.Join(me.Unwrap()...))
	if err == nil && allowed {
		return true, nil
	}
	if len(spentReqs) > 0 {
		// Each at the store's instant of its spend: a window rule gives
		// back to the window it counted in.
		ats := make([]int64, len(decided))
		for i, it := range decided {
			ats[i] = it.Decision.At
		}
		uctx, cancel := e.detached(ctx)
		if uerr := undoAt(uctx, e.store, spentReqs, ats); uerr != nil {
			e.log.Warn("a refused check's store spends not given back", "err", uerr)
		}
		cancel()
	}
	return allowed, err
}

func (e *Engine) takeAll(ctx context.Context, reqs []bucket.Request) ([]bucket.Decision, error) {
	if len(reqs) == 1 {
		d, err := e.store.Take(ctx, reqs[0])
		if err != nil {
			return nil, err
		}
		return []bucket.Decision{d}, nil
	}
	return e.store.TakeAll(ctx, reqs)
}

func allAllowed(ds []bucket.Decision) bool {
	for _, d := range ds {
		if !d.Allowed {
			return false
		}
	}
	return true
}

// storeFailed decides items the store could not: fail-closed rules refuse
// the check (ErrUnavailable); an overloaded client answers ErrOverloaded;
// a check the store may have counted is allowed without spending more
// (never decided a second time); otherwise this instance's memory decides,
// each rule with its share of the limit: limit / fleet, or for a pinned
// rule whose home did not answer, limit / (regions × fleet).
//
// A paced check whose outcome is unknown is decided by this instance's
// memory too, not allowed at once: the store may have reserved a later
// slot, and sending now could go above the rate. It may count twice, which
// only slows it. The fallback paces with its share, within the same wait.
// storeRequests are the store's requests of c's items: each its cost, or
// the lease batch it takes.
func storeRequests(c *request, items []*Item) []bucket.Request {
	reqs := make([]bucket.Request, len(items))
	for i, it := range items {
		cost := it.Cost
		if it.batch > 0 {
			cost = it.batch
		}
		reqs[i] = bucket.Request{Rule: it.Rule.ID, Key: it.Key, Limit: it.limit, Cost: cost, MaxWait: c.maxWait}
	}
	return reqs
}

func (e *Engine) storeFailed(ctx context.Context, c *request, items []*Item, reqs []bucket.Request, err error) (bool, error) {
	switch v, err := e.onFailure(ctx, failure{items: items, where: "store", paced: c.maxWait > 0}, err); v {
	case refused:
		return false, err
	case uncertain:
		for _, it := range items {
			it.route = routeUnknown
			it.Decision = bucket.Decision{Allowed: true, Limit: it.e.limit.Capacity}
		}
		return true, nil
	}
	fleet := max(e.fleet(), 1)
	for i, it := range items {
		it.route = routeFallback
		lim := share(it.limit, fleet, it.Cost)
		cost, cerr := lim.NormalizeCost(it.Cost)
		if cerr != nil {
			// More than this instance's share: refuse here.
			it.Decision = bucket.Decision{Limit: it.e.limit.Capacity, RetryAfter: time.Second}
			return false, nil
		}
		reqs[i] = bucket.Request{Rule: it.Rule.ID, Key: it.Key, Limit: lim, Cost: cost, MaxWait: c.maxWait}
	}
	ds, _ := e.fallback.TakeAll(ctx, reqs)
	all := true
	for i, it := range items {
		it.Decision = ds[i]
		it.Decision.Limit = it.e.limit.Capacity
		// The store's reservations and spends only are given back.
		it.Decision.Reservation, it.Decision.At = 0, 0
		all = all && ds[i].Allowed
	}
	return all, nil
}

// remember puts the refusals of items the store or a home region decided
// in the deny cache; and, when their spends stand (admitted), for allowed
// ones whose answer shows the next check of the same cost must fail, that
// denial too. (In a refused check the allowed ones were given back.)
func (e *Engine) remember(c *request, items []*Item, sent int64, admitted bool) {
	if e.deny == nil {
		return
	}
	for _, it := range items {
		if it.route != routeStore && it.route != routeHome {
			continue
		}
		d := it.Decision
		retry := d.RetryAfter
		if d.Allowed && (it.batch > 0 || !admitted || c.maxWait > 0) {
			// The lease holds what the batch left over, or given back;
			// or a reservation, which says nothing of an unpaced check.
			continue
		}
		if !d.Allowed && c.maxWait > 0 {
			// A paced refusal's retry counts from its wait: an unpaced
			// check of the same cost is refused for the wait longer.
			retry += c.maxWait
		}
		if d.Allowed {
			var ok bool
			if retry, ok = nextDenial(it.limit, d, it.Cost); !ok {
				continue
			}
		}
		if e.deny.Put(c.t.gen, it.Rule.ID, it.Key, it.Cost, sent, retry, d.ResetAfter) {
			it.remembered = true
		}
	}
}

// nextDenial tells, from an allowed decision, how long another check of the
// same cost is sure to be refused: when fewer tokens remain than it costs, a
// token bucket needs (cost - remaining) / rate, a fixed window its end.
// Other algorithms report too little to be sure.
func nextDenial(l bucket.Limit, d bucket.Decision, cost float64) (time.Duration, bool) {
	if d.Remaining >= cost {
		return 0, false
	}
	switch l.Algorithm {
	case bucket.TokenBucket:
		// The store's arithmetic: whole microseconds, rounded up.
		return time.Duration(math.Ceil((cost-d.Remaining)*1e6/l.RefillPerSecond)) * time.Microsecond, true
	case bucket.FixedWindow:
		return d.ResetAfter, true
	}
	return 0, false
}

// giveBack returns what the earlier parts of a refused check spent: the
// leased tokens at once, the home regions' spends by a refund that runs on
// after the answer (its own deadline, not the caller's).
//
// It returns false and err, so a refusing or failing part ends with it.
func (e *Engine) giveBack(ctx context.Context, sp *spent, err error) (bool, error) {
	for _, it := range sp.leases {
		e.leases.GiveBack(it.Rule.ID, it.Key, it.Cost)
	}
	for _, hs := range sp.homes {
		// Only what the home spent in its store: what it decided from its
		// fallback, or without learning the outcome, has no instant.
		var items []HomeItem
		for _, it := range hs.items {
			if it.Decision.At > 0 {
				items = append(items, HomeItem{Rule: it.Rule.ID, Key: it.Key, Cost: it.Cost, At: it.Decision.At})
			}
		}
		if len(items) == 0 {
			continue
		}
		h := hs.h
		rctx, cancel := e.detached(ctx)
		hs.ts.users.Add(1) // held by the check: the connection stays open for the refund
		e.refunds.Go(func() {
			defer hs.ts.release()
			defer cancel()
			if err := h.Refund(rctx, items); err != nil {
				e.m.Refunds.WithLabelValues("error").Inc()
				e.log.Warn("home region refund failed: its tokens stay spent", "home", hs.home, "err", err)
				return
			}
			e.m.Refunds.WithLabelValues("ok").Inc()
		})
	}
	return false, err
}

// count updates the metrics of a decided check and records what it
// admitted for the other regions.
func (e *Engine) count(c *request, allowed bool) {
	var now int64 // read once, when a spend is recorded
	for _, it := range c.enforce {
		en := it.e
		if c.maxWait > 0 {
			// The series of a rule appear with its first paced check:
			// most rules never pace.
			switch {
			case allowed:
				e.m.Paced.WithLabelValues(it.Rule.ID, metrics.ResultAllowed).Inc()
				e.m.PacedWait.WithLabelValues(it.Rule.ID).Observe(it.Decision.Wait.Seconds())
			case !it.Decision.Allowed && it.route != routeNone:
				e.m.Paced.WithLabelValues(it.Rule.ID, metrics.ResultLimited).Inc()
			}
		}
		if !allowed {
			switch {
			case it.Decision.Allowed || it.route == routeNone:
			case it.route == routeDeny:
				en.denyHits.Inc()
				en.limited.Inc()
			case it.route == routeHome:
				en.forwardedLimited.Inc()
			case it.route == routeFallback:
				en.fallbackLimited.Inc()
			default:
				en.limited.Inc()
			}
			continue
		}
		en.admittedCost.Add(it.Cost)
		spend := it.Cost
		switch it.route {
		case routeHome:
			en.forwardedAllowed.Inc()
			continue // the home region reports its own spends
		case routeLease:
			en.allowed.Inc()
			en.leased.Inc()
			continue // reported when the batch was taken
		case routeFallback:
			en.fallbackAllowed.Inc()
		case routeUnknown:
			en.uncertain.Inc()
		default:
			en.allowed.Inc()
			if it.batch > 0 {
				spend = it.batch
			}
		}
		if en.reconciled && e.spends != nil {
			if now == 0 {
				now = time.Now().UnixMicro()
			}
			e.spends.Add(it.Rule.ID, it.Key, spend, en.spendBudget, now)
		}
	}
}

// shadows checks shadow rules for a request that passed: a refusal is
// counted and sampled to the log, and refuses nothing.
func (e *Engine) shadows(ctx context.Context, items []*Item) {
	for _, it := range items {
		d, err := e.store.Take(ctx, bucket.Request{Rule: it.Rule.ID, Key: it.Key, Limit: it.e.limit, Cost: it.Cost})
		if err != nil {
			it.Decision = bucket.Decision{Allowed: true, Limit: it.e.limit.Capacity}
			continue
		}
		it.Decision = d
		it.Decision.Limit = it.e.limit.Capacity
		if d.Allowed {
			it.e.shadowAllowed.Inc()
			continue
		}
		it.e.shadowLimited.Inc()
		if rand.Float64() < shadowLogRate {
			e.log.Info("shadow rule would have refused (1% of them logged)", "rule", it.Rule.ID, "retry_after", d.RetryAfter)
		}
	}
}
