package limiterd

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// shadowLogRate is the share of shadow rejections logged.
const shadowLogRate = 0.01

// item is one rule of an attribute-based check.
type item struct {
	e    *ruleEntry
	key  string
	cost float64
	d    bucket.Decision
}

func attributesOf(a *limiterv1.Attributes) *rules.Attributes {
	return &rules.Attributes{
		APIKey: a.GetApiKey(), User: a.GetUser(), IP: a.GetIp(), Path: a.GetPath(),
		Method: a.GetMethod(), Plan: a.GetPlan(), Domain: a.GetDomain(), Extra: a.GetExtra(),
	}
}

// checkAttributes checks every rule whose match the attributes satisfy,
// all or nothing: a request refused by one rule spends nothing from the
// others. Shadow rules are checked after, for a request that passed, and
// refuse nothing.
func (c *checker) checkAttributes(ctx context.Context, attrs *limiterv1.Attributes, reqCost float64) (*limiterv1.CheckResponse, error) {
	if reqCost == 0 {
		reqCost = 1
	}
	if !(reqCost > 0) || math.IsInf(reqCost, 0) {
		c.m.invalid.WithLabelValues("cost").Inc()
		return nil, status.Errorf(codes.InvalidArgument, "cost: %v is not finite and > 0", reqCost)
	}
	enforce, shadow, err := c.matchItems(c.rules.Load(), attributesOf(attrs), reqCost)
	if err != nil {
		return nil, err
	}
	allowed, err := c.enforce(ctx, enforce)
	if err != nil {
		return nil, err
	}
	if allowed {
		c.shadows(ctx, shadow)
	}
	return response(enforce, shadow, allowed), nil
}

// matchItems lists the rules of t that a matches, each with the key its
// key_by picks and its cost times reqCost (finite, > 0): the enforced
// rules, and the shadow ones. Errors are gRPC statuses.
func (c *checker) matchItems(t *table, a *rules.Attributes, reqCost float64) (enforce, shadow []*item, err error) {
	for _, r := range t.set.Matching(a) {
		key, ok, err := r.KeyOf(a)
		if err != nil {
			c.m.invalid.WithLabelValues("attributes").Inc()
			return nil, nil, status.Errorf(codes.InvalidArgument, "attributes.%v", err)
		}
		if !ok {
			continue
		}
		if err := bucket.ValidateKey(key); err != nil {
			c.m.invalid.WithLabelValues("attributes").Inc()
			return nil, nil, status.Errorf(codes.InvalidArgument, "attributes: rule %q: %v", r.ID, err)
		}
		e := t.byID[r.ID]
		cost, err := e.limit.NormalizeCost(r.Cost * reqCost)
		if err != nil {
			c.m.invalid.WithLabelValues("cost").Inc()
			return nil, nil, status.Errorf(codes.InvalidArgument, "cost: rule %q: %v", r.ID, err)
		}
		it := &item{e: e, key: key, cost: cost}
		if r.Shadow {
			shadow = append(shadow, it)
		} else {
			enforce = append(enforce, it)
		}
	}
	return enforce, shadow, nil
}

// enforce decides the enforced rules of one check together. Afterwards
// every item has a decision: a rule left undecided (another refused first)
// or that would have allowed a refused check reports what it has, since
// nothing was spent from it.
func (c *checker) enforce(ctx context.Context, items []*item) (bool, error) {
	for _, it := range items {
		it.d = bucket.Decision{Allowed: true, Remaining: it.e.limit.Capacity, Limit: it.e.limit.Capacity}
	}
	allowed, err := c.enforceAll(ctx, items)
	if err == nil && !allowed {
		for _, it := range items {
			if it.d.Allowed && it.d.Remaining < it.d.Limit {
				it.d.Remaining = min(it.d.Limit, it.d.Remaining+it.cost)
			}
		}
	}
	return allowed, err
}

func (c *checker) enforceAll(ctx context.Context, items []*item) (bool, error) {
	switch len(items) {
	case 0:
		return true, nil
	case 1:
		// One rule: the single-rule path, with its leases and forwarding.
		it := items[0]
		d, _, err := c.check(ctx, it.e.rule.ID, it.key, it.cost)
		it.d = d
		return d.Allowed, err
	}
	// A denial already known refuses the whole check, spending nothing.
	if c.deny != nil {
		refused := false
		for _, it := range items {
			if retry, reset, hit, _ := c.deny.get(it.e.rule.ID, it.key, it.cost); hit {
				it.e.denyHits.Inc()
				it.e.limited.Inc()
				it.d = bucket.Decision{Limit: it.e.limit.Capacity, RetryAfter: retry, ResetAfter: reset}
				refused = true
			} else {
				it.d = bucket.Decision{Allowed: true, Limit: it.e.limit.Capacity, Remaining: it.e.limit.Capacity}
			}
		}
		if refused {
			return false, nil
		}
	}
	// Rules pinned to another region are asked there first, one by one:
	// a refusal there spends nothing here.
	local := items[:0:0]
	for _, it := range items {
		if it.e.rule.Pinned() && c.topo != nil && !forwarded(ctx) {
			if home := c.topo.Home(it.key, it.e.rule.HomeKeys); home != c.region {
				d, err := c.forward(ctx, it.e, home, it.key, it.cost)
				if err != nil {
					return false, err
				}
				if it.d = d; !d.Allowed {
					return false, nil
				}
				continue
			}
		}
		local = append(local, it)
	}
	if len(local) == 0 {
		return true, nil
	}
	reqs := make([]bucket.Request, len(local))
	for i, it := range local {
		reqs[i] = bucket.Request{Rule: it.e.rule.ID, Key: it.key, Limit: it.e.limit, Cost: it.cost}
	}
	var sent int64
	if c.deny != nil {
		sent = c.deny.now()
	}
	var ds []bucket.Decision
	ms, ok := c.store.(bucket.MultiStore)
	var err error
	if ok {
		ds, err = ms.TakeAll(ctx, reqs)
	} else {
		err = fmt.Errorf("store %T cannot check several rules at once", c.store)
	}
	fallback := false
	if err != nil {
		if ctx.Err() != nil {
			return false, status.FromContextError(ctx.Err()).Err()
		}
		for _, it := range local {
			if it.e.rule.OnFailure == rules.FailClosed {
				it.e.failed.Inc()
				c.log.Warn("store failed, fail-closed rule refused", "rule", it.e.rule.ID, "err", err)
				return false, status.Error(codes.Unavailable, errUnavailable.Error())
			}
		}
		fallback = true
		for i, it := range local {
			reqs[i].Limit = it.e.local
			if reqs[i].Cost, err = it.e.local.NormalizeCost(it.cost); err != nil {
				// More than this instance's share: refuse locally.
				it.d = bucket.Decision{Limit: it.e.limit.Capacity, RetryAfter: time.Second}
				it.e.fallbackLimited.Inc()
				return false, nil
			}
		}
		ds, _ = c.fallback.TakeAll(ctx, reqs)
	}
	all := true
	for i, it := range local {
		it.d = ds[i]
		it.d.Limit = it.e.limit.Capacity
		all = all && ds[i].Allowed
	}
	for _, it := range local {
		switch {
		case all && fallback:
			it.e.fallbackAllowed.Inc()
			c.record(it.e, it.key, it.cost)
		case all:
			it.e.allowed.Inc()
			c.record(it.e, it.key, it.cost)
		case !it.d.Allowed && fallback:
			it.e.fallbackLimited.Inc()
		case !it.d.Allowed:
			it.e.limited.Inc()
			if c.deny != nil {
				c.deny.put(it.e.rule.ID, it.key, it.cost, sent, it.d.RetryAfter, it.d.ResetAfter)
			}
		}
	}
	return all, nil
}

// shadows checks shadow rules for a request that passed: a refusal is
// counted and sampled to the log, and refuses nothing.
func (c *checker) shadows(ctx context.Context, items []*item) {
	for _, it := range items {
		d, err := c.store.Take(ctx, bucket.Request{Rule: it.e.rule.ID, Key: it.key, Limit: it.e.limit, Cost: it.cost})
		if err != nil {
			it.d = bucket.Decision{Allowed: true, Limit: it.e.limit.Capacity}
			continue
		}
		it.d = d
		if d.Allowed {
			it.e.shadowAllowed.Inc()
			continue
		}
		it.e.shadowLimited.Inc()
		if rand.Float64() < shadowLogRate {
			c.log.Info("shadow rule would have refused (1% of them logged)", "rule", it.e.rule.ID, "retry_after", d.RetryAfter)
		}
	}
}

// response reports every rule's status, and the deciding rule: the refusal
// with the longest retry, or the rule with the least left for its limit.
func response(enforce, shadow []*item, allowed bool) *limiterv1.CheckResponse {
	resp := &limiterv1.CheckResponse{Allowed: allowed}
	var decider *item
	for _, it := range enforce {
		switch {
		case decider == nil:
			decider = it
		case !allowed:
			if !it.d.Allowed && (decider.d.Allowed || it.d.RetryAfter > decider.d.RetryAfter) {
				decider = it
			}
		case it.d.Remaining/it.d.Limit < decider.d.Remaining/decider.d.Limit:
			decider = it
		}
	}
	if decider != nil {
		d := decider.d
		resp.Remaining, resp.Limit = d.Remaining, d.Limit
		resp.RetryAfterMs, resp.ResetAfterMs = ceilMillis(d.RetryAfter), ceilMillis(d.ResetAfter)
		resp.RuleId, resp.WindowMs = decider.e.rule.ID, windowMillis(decider.e.limit)
	}
	for _, list := range [][]*item{enforce, shadow} {
		for _, it := range list {
			resp.Statuses = append(resp.Statuses, &limiterv1.RuleStatus{
				RuleId: it.e.rule.ID, Allowed: it.d.Allowed, Remaining: it.d.Remaining, Limit: it.d.Limit,
				RetryAfterMs: ceilMillis(it.d.RetryAfter), ResetAfterMs: ceilMillis(it.d.ResetAfter),
				WindowMs: windowMillis(it.e.limit), Shadow: it.e.rule.Shadow,
			})
		}
	}
	return resp
}

// windowMillis is a limit's window for quota headers: a window rule's
// window, the time to fill an empty bucket otherwise.
func windowMillis(l bucket.Limit) int64 {
	if l.Window > 0 {
		return l.Window.Milliseconds()
	}
	return int64(math.Ceil(l.Capacity / l.RefillPerSecond * 1000))
}
