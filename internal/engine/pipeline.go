package engine

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// shadowLogRate is the share of shadow refusals logged.
const shadowLogRate = 0.01

// Decide decides the check's enforced rules together, all or nothing, and
// then, when it is allowed, its shadow rules (which refuse nothing).
// Afterwards every item has a Decision. A refusal is a decision: allowed
// false and a nil error. Errors: ErrUnavailable when a fail-closed rule
// could not be decided, ErrOverloaded, the context's error, or the home
// region's *request.InvalidError or request.ErrUnknownRule for a pinned rule.
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
// puts a newer one in force, it is routed again with that one, once (see
// plan and run).
func (e *Engine) Decide(ctx context.Context, c *request.Check) (bool, error) {
	allowed, _, err := e.run(ctx, &c.Request, nil)
	return allowed, err
}

// decideUnder runs the plan's stages and then what follows a decided
// check: the deny cache forgets what its probes left open, the decision is
// counted, a refusal's items report what was given back, and an admitted
// check's shadow rules are checked. Its errReroute says a home refused the
// call as stale and a newer topology is in force: the caller routes it
// again.
func (e *Engine) decideUnder(ctx context.Context, c *request.Request, p *plan, stages []stage) (bool, error) {
	for _, it := range c.Enforce {
		it.Probe, it.Remembered = false, false
	}
	allowed, err := e.runStages(ctx, c, p, stages)
	if e.deny != nil {
		for _, it := range c.Enforce {
			if it.Probe && !it.Remembered {
				// The probe's answer leaves the key free to ask the store.
				e.deny.Forget(it.Rule.ID, it.Key)
			}
		}
	}
	if err != nil {
		return false, err
	}
	if e.tally.Count(c, allowed) && p.traced {
		// The flush that carries its spends names it (only a sampled
		// call pays for the lookup).
		e.tally.Sampled(trace.SpanContextFromContext(ctx))
	}
	if !allowed {
		for _, it := range c.Enforce {
			if !it.Decision.Allowed || it.Route == request.RouteNone {
				continue
			}
			if it.Decision.Remaining < it.Decision.Limit {
				// Its spend was given back.
				it.Decision.Remaining = min(it.Decision.Limit, it.Decision.Remaining+it.Cost)
			}
			if e.deny != nil && it.Route != request.RouteFallback {
				// Given back: a denial another check left meanwhile may
				// not hold any more.
				e.deny.Forget(it.Rule.ID, it.Key)
			}
		}
		return false, nil
	}
	e.shadows(ctx, c.Shadow)
	return true, nil
}

// denied starts the check's rate rules afresh and refuses the check when
// a denial of one of them is already known (a check routed again asked the
// deny cache the first time).
func (e *Engine) denied(c *request.Request, p *plan) (bool, error) {
	for _, it := range c.Enforce {
		it.Decision = bucket.Decision{Allowed: true, Remaining: it.Limits.Limit.Capacity, Limit: it.Limits.Limit.Capacity}
		it.Route, it.Against, it.Batch = request.RouteNone, it.Limits.Limit, 0
	}
	if e.deny == nil || p.rerouted || len(c.Enforce) == 0 {
		return true, nil
	}
	refused := false
	for _, it := range c.Enforce {
		var retry, reset time.Duration
		var hit, probe bool
		if c.MaxWait > 0 {
			// Refused here only when its slot cannot come within its
			// wait (see denycache.GetBeyond).
			retry, reset, hit = e.deny.GetBeyond(it.Rule.ID, it.Key, it.Cost, c.MaxWait)
		} else {
			retry, reset, hit, probe = e.deny.Get(it.Rule.ID, it.Key, it.Cost)
		}
		it.Probe = probe
		if hit {
			it.Route = request.RouteDeny
			it.Decision = bucket.Decision{Limit: it.Limits.Limit.Capacity, RetryAfter: retry, ResetAfter: reset}
			refused = true
		}
	}
	if refused {
		return false, nil
	}
	c.Sent = e.deny.Now()
	return true, nil
}

// route puts each rate rule where it is decided: a pinned rule homed
// elsewhere at its home region, a rule with token leases at this
// instance's lease, the rest in this region's store.
func (e *Engine) route(c *request.Request, p *plan) (bool, error) {
	// While every rule so far is decided here, local is the prefix of
	// c.Enforce: most checks allocate nothing for it.
	prefix := 0
	for i, it := range c.Enforce {
		home := p.ts.HomeOf(e.region, c, it)
		leased := home == "" && it.Rule.Lease > 0 && c.MaxWait == 0 && !c.Settle
		if home == "" && !leased {
			if p.local == nil && prefix == i {
				prefix++
			} else {
				p.local = append(p.local, it)
			}
			continue
		}
		if p.local == nil {
			p.local = append(make([]*request.Item, 0, len(c.Enforce)), c.Enforce[:prefix]...)
		}
		if home != "" {
			if p.remote == nil {
				p.remote = make(map[string][]*request.Item)
			}
			if p.remote[home] == nil {
				p.homes = append(p.homes, home)
			}
			p.remote[home] = append(p.remote[home], it)
			continue
		}
		// (A paced check never reserves from a lease: it goes to the
		// store, whose state holds every reservation; nor does a check
		// that settles later: the store says when it spent.)
		p.leased = append(p.leased, it)
	}
	if p.local == nil {
		// Full: a later append copies.
		p.local = c.Enforce[:prefix:prefix]
	}
	slices.Sort(p.homes)
	if c.MaxWait > 0 && len(p.homes) > 0 && (len(p.homes) > 1 || len(p.local) > 0) {
		// One instant for every rule needs one place that decides them.
		home := p.homes[0]
		return false, request.Invalid("max_wait_ms", "max_wait_ms: %w: the check's rules are decided in different regions (rule %s is pinned to %s), which cannot reserve one instant",
			bucket.ErrInvalidWait, request.Quote(p.remote[home][0].Rule.ID), home)
	}
	return true, nil
}

// atHomes forwards the pinned rules to their home regions, one call
// each. A home's failure goes to the failure policy: refused, uncertain,
// or decided here (with the rest, from this region's share).
func (e *Engine) atHomes(ctx context.Context, c *request.Request, p *plan) (bool, error) {
	for _, home := range p.homes {
		its := p.remote[home]
		allowed, err := e.fwd.Decide(ctx, p.ts, home, its, c.MaxWait)
		if err == nil {
			if !allowed {
				e.deny.Remember(c, its, c.Sent, false)
				return false, nil
			}
			p.push(undoStep{kind: undoRefund, home: home, items: its})
			continue
		}
		if ctx.Err() == nil {
			if err := e.homeFailed(p.ts, p.rerouted, home, err); err != nil {
				return false, err
			}
		}
		// (A paced check's unknown outcome is not uncertain: the home may
		// have reserved a slot up to its wait out, and sending now could go
		// above the rate. It is paced here with this region's share, as
		// below; it may count twice, which only slows it.)
		v, err := e.onFailure(ctx, failure{items: its, where: "home region " + home, paced: c.MaxWait > 0}, err)
		switch v {
		case refused:
			return false, err
		case uncertain:
			for _, it := range its {
				it.Route = request.RouteUnknown
				it.Decision = bucket.Decision{Allowed: true, Limit: it.Limits.Limit.Capacity}
			}
			continue
		}
		// Fail open: decide here with this region's share of the limit.
		for _, it := range its {
			it.Against = it.Limits.Regional
			p.local = append(p.local, it)
		}
	}
	return true, nil
}

// fromLeases hands out the leased rules' tokens from what this
// instance holds, or makes this check take the next batch with the rest
// in the store call.
func (e *Engine) fromLeases(ctx context.Context, p *plan) (bool, error) {
	var tokens []*request.Item
	for _, it := range p.leased {
		ok, err := e.leases.Serve(ctx, it, e.deny)
		switch {
		case err != nil || !ok:
			if len(tokens) > 0 {
				p.push(undoStep{kind: undoTokens, items: tokens})
			}
			return false, err
		case it.Route == request.RouteLease:
			tokens = append(tokens, it)
		default:
			// This check takes the next batch, with the rest.
			p.local = append(p.local, it)
		}
	}
	if len(tokens) > 0 {
		p.push(undoStep{kind: undoTokens, items: tokens})
	}
	return true, nil
}

// inStore decides the rest in this region's store, in one call, after
// the keys a topology switch moved here took their old homes' buckets.
func (e *Engine) inStore(ctx context.Context, c *request.Request, p *plan) (bool, error) {
	if len(p.local) == 0 {
		return true, nil
	}
	err := e.handoff(ctx, p, p.local)
	if err == nil {
		return e.fromStore(ctx, c, p, p.local)
	}
	if sf, ok := errors.AsType[storeFailure](err); ok {
		// The store failed seeding a moved key: as if it failed the check.
		return e.storeFailed(ctx, c, p.local, storeRequests(c, p.local), sf.err)
	}
	return false, err
}

// homeFailed says whether err, a home region's failure to answer a call
// made under the topology of ts, decides the call by itself; nil means
// the rules' on_failure decides. It is errReroute when the home's topology
// is newer and reading this region's file gave it the newer one too (at
// most once: not when rerouted), and err itself when the home's rules
// differ from this region's (an invalid request or an unknown rule there):
// the home's answer stands.
func (e *Engine) homeFailed(ts *homes.State, rerouted bool, home string, err error) error {
	if errors.Is(err, homes.ErrStaleTopology) {
		e.m.Stale.WithLabelValues(home).Inc()
		if !rerouted && e.reload != nil {
			if e.reload(); e.topo.Load().Gen > ts.Gen {
				return errReroute
			}
		}
		e.log.Warn("home region's topology is newer and this file has no newer one: the rules' on_failure decides",
			"home", home, "generation", ts.Gen, "err", err)
	}
	var inv *request.InvalidError
	if errors.As(err, &inv) || errors.Is(err, request.ErrUnknownRule) {
		return err
	}
	return nil
}

// fromStore decides items in one store call; when the store fails, the
// rules' on_failure decides.
func (e *Engine) fromStore(ctx context.Context, c *request.Request, p *plan, items []*request.Item) (bool, error) {
	sent := c.Sent
	reqs := storeRequests(c, items)
	ds, err := e.takeAll(ctx, reqs)
	if err == nil && !allAllowed(ds) {
		// A lease batch larger than what is left: ask again with the
		// check's own costs.
		retry := false
		for i, it := range items {
			if it.Batch > it.Cost && !ds[i].Allowed {
				reqs[i].Cost, it.Batch, retry = it.Cost, it.Cost, true
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
			return e.partlyDecided(ctx, c, p, items, reqs, ds, me)
		}
	}
	if err == nil {
		all := true
		for i, it := range items {
			it.Route, it.Decision = request.RouteStore, ds[i]
			it.Decision.Limit = it.Limits.Limit.Capacity
			all = all && ds[i].Allowed
		}
		e.deny.Remember(c, items, sent, all)
		if all {
			for _, it := range items {
				if it.Batch > it.Cost {
					// What the batch leaves over is this instance's.
					it.Decision.Remaining += it.Batch - it.Cost
				}
			}
		}
		return all, nil
	}
	return e.storeFailed(ctx, c, items, reqs, err)
}

// partlyDecided finishes a store call that decided some items and not
// others. A refusal among the decided ones refuses the check (the store gave
// back what the others spent). Otherwise the decided ones stay spent, with
// their undo pushed, and storeFailed decides the rest.
func (e *Engine) partlyDecided(ctx context.Context, c *request.Request, p *plan, items []*request.Item, reqs []bucket.Request, ds []bucket.Decision, me *bucket.MultiError) (bool, error) {
	var decided, failed []*request.Item
	var failedReqs, spentReqs []bucket.Request
	refused := false
	for i, it := range items {
		if me.Errs[i] != nil {
			failed = append(failed, it)
			failedReqs = append(failedReqs, reqs[i])
			continue
		}
		it.Route, it.Decision = request.RouteStore, ds[i]
		it.Decision.Limit = it.Limits.Limit.Capacity
		decided = append(decided, it)
		spentReqs = append(spentReqs, reqs[i])
		refused = refused || !ds[i].Allowed
	}
	e.deny.Remember(c, decided, c.Sent, false)
	if refused {
		return false, nil
	}
	if len(spentReqs) > 0 {
		p.push(undoStep{kind: undoStore, items: decided, reqs: spentReqs})
	}
	return e.storeFailed(ctx, c, failed, failedReqs, errors.Join(me.Unwrap()...))
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
func storeRequests(c *request.Request, items []*request.Item) []bucket.Request {
	reqs := make([]bucket.Request, len(items))
	for i, it := range items {
		cost := it.Cost
		if it.Batch > 0 {
			cost = it.Batch
		}
		reqs[i] = bucket.Request{Rule: it.Rule.ID, Key: it.Key, Limit: it.Against, Cost: cost, MaxWait: c.MaxWait, Keep: it.Keep}
	}
	return reqs
}

func (e *Engine) storeFailed(ctx context.Context, c *request.Request, items []*request.Item, reqs []bucket.Request, err error) (bool, error) {
	switch v, err := e.onFailure(ctx, failure{items: items, where: "store", paced: c.MaxWait > 0}, err); v {
	case refused:
		return false, err
	case uncertain:
		for _, it := range items {
			it.Route = request.RouteUnknown
			it.Decision = bucket.Decision{Allowed: true, Limit: it.Limits.Limit.Capacity}
		}
		return true, nil
	}
	fleet := max(e.fleet(), 1)
	for i, it := range items {
		it.Route = request.RouteFallback
		lim := request.Share(it.Against, fleet, it.Cost)
		cost, cerr := lim.NormalizeCost(it.Cost)
		if cerr != nil {
			// More than this instance's share: refuse here.
			it.Decision = bucket.Decision{Limit: it.Limits.Limit.Capacity, RetryAfter: time.Second}
			return false, nil
		}
		reqs[i] = bucket.Request{Rule: it.Rule.ID, Key: it.Key, Limit: lim, Cost: cost, MaxWait: c.MaxWait, Keep: it.Keep}
	}
	ds, _ := e.fallback.TakeAll(ctx, reqs)
	all := true
	for i, it := range items {
		it.Decision = ds[i]
		it.Decision.Limit = it.Limits.Limit.Capacity
		// The store's reservations and spends only are given back.
		it.Decision.Reservation, it.Decision.At = 0, 0
		all = all && ds[i].Allowed
	}
	return all, nil
}

// shadows checks shadow rules for a request that passed: a refusal is
// counted and sampled to the log, and refuses nothing.
func (e *Engine) shadows(ctx context.Context, items []*request.Item) {
	for _, it := range items {
		d, err := e.store.Take(ctx, bucket.Request{Rule: it.Rule.ID, Key: it.Key, Limit: it.Limits.Limit, Cost: it.Cost, Keep: it.Keep})
		if err != nil {
			it.Decision = bucket.Decision{Allowed: true, Limit: it.Limits.Limit.Capacity}
			continue
		}
		it.Decision = d
		it.Decision.Limit = it.Limits.Limit.Capacity
		if d.Allowed {
			it.Entry.ShadowAllowed.Inc()
			continue
		}
		it.Entry.ShadowLimited.Inc()
		e.top.Add(it.Rule.ID, it.Key, 1, time.Now().UnixNano())
		if rand.Float64() < shadowLogRate {
			e.log.Info("shadow rule would have refused (1% of them logged)", "rule", it.Rule.ID, "retry_after", d.RetryAfter)
		}
	}
}
