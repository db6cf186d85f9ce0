package concurrency

import (
	"time"

	"github.com/limiterd/limiterd/internal/engine/leaseid"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

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

// Acquire is one request's rules for engine.Engine.Acquire: its
// concurrency rules, held as leases until Release, and its rate rules,
// decided as a Check's are. Build it with engine.Engine.NewAcquire and its
// Add methods; it uses
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

// NewAcquire starts an Acquire under the rules of t, counting its invalid
// requests in m.
func NewAcquire(t *request.Table, m *metrics.Metrics) *Acquire {
	return &Acquire{Request: request.Request{Table: t, Metrics: m, Class: t.DefaultClass()}}
}

// SetPriority gives the Acquire the priority class name, as
// request.Request.SetPriority does a check's: its rate rules keep what the
// class keeps of their capacity, and its concurrency rules what it keeps
// of their limit. Errors are as Request.SetPriority's.
func (c *Acquire) SetPriority(name string) error {
	if err := c.Request.SetPriority(name); err != nil {
		return err
	}
	for _, l := range c.held {
		l.Keep = l.Entry.Keep(c.Class)
	}
	return nil
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
	lims := en.For(key)
	l := &heldLease{Item: &request.Item{Rule: en.Rule, Key: key, Cost: 1, Keep: en.Keep(c.Class), Entry: en, Limits: lims, Against: lims.Limit}}
	c.held = append(c.held, l)
	c.Leased = append(c.Leased, l.Item)
	return l.Item, nil
}

// leaseLimit is what a lease with flags of a key whose limits are lims is
// held against: the key's limit, or this region's share of it
// (leaseid.Regional), or this instance's share of either
// (leaseid.Fallback).
func leaseLimit(lims *request.Limits, flags byte, fleet int) bucket.LeaseLimit {
	l := lims.Leases
	if flags&leaseid.Regional != 0 {
		l = lims.RegionalLeases
	}
	if flags&leaseid.Fallback != 0 {
		l = l.Share(fleet)
	}
	return l
}

// notAsked gives the items a refusal left undecided the answer of a
// bucket that nothing was spent from.
func (c *Acquire) notAsked() {
	for _, it := range c.held {
		if it.Route == request.RouteNone {
			l := float64(it.Limits.Leases.Limit)
			it.Decision = bucket.Decision{Allowed: true, Remaining: l, Limit: l}
		}
	}
	for _, it := range c.Enforce {
		it.Decision = bucket.Decision{Allowed: true, Remaining: it.Limits.Limit.Capacity, Limit: it.Limits.Limit.Capacity}
		it.Route = request.RouteNone
	}
}

// GivenBack makes the leases' decisions report what the leases held left
// when they were given back (the rate rules refused the Acquire).
func (c *Acquire) GivenBack() {
	for _, it := range c.held {
		it.Decision.Remaining = min(it.Decision.Limit, it.Decision.Remaining+1)
	}
}
