// Package usage answers what a check would see now without spending: the
// remaining, limit, reset and retry of rate rules, and the leases held of
// concurrency rules, read from the store a check uses, on the same
// routing (a pinned rule's key is read at its home region), changing no
// state and remembering no denial.
package usage

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// MaxItems bounds the rules of one usage: a check's enforced and shadow
// rules, each up to request.MaxItems.
const MaxItems = 2 * request.MaxItems

// ErrUnavailable: the store or a home region did not answer a usage. A
// usage has no fallback to read from.
var ErrUnavailable = errors.New("usage not read: the store or the key's home region did not answer")

// Item is one rule of a usage request: the bucket (or lease set) of Key
// under its rule, read for a check of Cost. After Read, Usage holds what
// such a check would see (see bucket.Limit.UsageKeeping): Remaining before
// any spend. For a concurrency rule it is what an Acquire of the request's
// class would see (bucket.Leases.UsageKeeping): Limit is the key's limit
// (adaptive or the rule's), Remaining the leases free out of the room its
// class may take (bucket.LeaseRoom), Allowed whether the Acquire would
// hold one; when not, Reserved says it is refused only for what the class
// keeps, and RetryAfter is the time until the soonest lease expires, or
// for a reserved refusal until as many expire as the class needs to fit;
// ResetAfter is the time until the latest expires.
type Item struct {
	Entry *request.Entry
	Key   string
	Cost  float64
	Usage bucket.Decision
	// held is a concurrency rule's leases held.
	held int
}

// Rule is the item's rule.
func (it *Item) Rule() *rules.Rule { return it.Entry.Rule }

// Held is the leases a concurrency rule's key holds, whatever the class.
func (it *Item) Held() int { return it.held }

// Request is the rules of one usage request, by rule id or by attributes,
// validated as a check's are. Build it with NewRequest and its Add methods.
// Not safe for concurrent use.
type Request struct {
	r     request.Request
	items []*Item
	peer  string
}

// NewRequest starts a usage request under the rules of t, counting its
// invalid requests in m.
func NewRequest(t *request.Table, m *metrics.Metrics) *Request {
	return &Request{r: request.Request{Table: t, Metrics: m, Class: t.DefaultClass()}}
}

// SetPriority reads the usage as a check of the priority class name
// would see it: one of the table's classes, or its default class for an
// empty or unknown name (the default until set). A token bucket or GCRA
// rule with a reserve then allows only what the class may spend, and its
// retry is until the class fits (bucket.Limit.UsageKeeping); a
// concurrency rule with a reserve answers as an Acquire of the class, its
// remaining the leases free out of the class's room
// (bucket.Leases.UsageKeeping). A name longer than rules.MaxClassLen bytes
// is an *request.InvalidError naming priority, counted as a check's are.
func (u *Request) SetPriority(name string) error { return u.r.SetPriority(name) }

// FromPeer marks the request as forwarded by a peer region: its keys are
// homed here, so pinned rules are read here, never forwarded again.
func (u *Request) FromPeer(region string) { u.peer = region }

// Items are the request's rules, in the order added.
func (u *Request) Items() []*Item { return u.items }

// AddRule adds the rule ruleID for key, read for a check of cost (0 means
// 1). A concurrency rule's cost must be 0 or 1. Errors are an
// *request.InvalidError naming rule_id (wrapping request.ErrUnknownRule),
// key or cost, counted as a check's are.
func (u *Request) AddRule(ruleID, key string, cost float64) (*Item, error) {
	it, err := u.addRule(ruleID, key, cost)
	u.r.Counted(err)
	return it, err
}

func (u *Request) addRule(ruleID, key string, cost float64) (*Item, error) {
	en, err := u.r.Lookup(ruleID, key)
	if err != nil {
		return nil, err
	}
	if en.Rule.Concurrent() {
		if cost != 0 && cost != 1 {
			return nil, request.Invalid("cost", "cost: rule %s is a concurrency rule, which counts each request once: cost must be 0 or 1, got %v", request.Quote(ruleID), cost)
		}
		return u.add(en, key, 1), nil
	}
	cost, err = en.For(key).Limit.NormalizeCost(cost)
	if err != nil {
		return nil, request.Invalid("cost", "cost: %w", err)
	}
	return u.add(en, key, cost), nil
}

// AddAttributes adds every rule whose match a satisfies, each against the
// key its key_by picks, read for a check of its own cost times reqCost (0
// means 1), as a check by attributes; concurrency and shadow rules
// included. Errors are *request.InvalidError naming attributes or cost.
func (u *Request) AddAttributes(a *rules.Attributes, reqCost float64) error {
	var conc []*Item
	enforce, shadow, err := u.r.Match(a, reqCost, func(_ *rules.Rule, en *request.Entry, key string) error {
		conc = append(conc, &Item{Entry: en, Key: key, Cost: 1})
		return nil
	})
	u.r.Counted(err)
	if err != nil {
		return err
	}
	for _, list := range [][]*request.Item{enforce, shadow} {
		for _, it := range list {
			u.add(it.Entry, it.Key, it.Cost)
		}
	}
	u.items = append(u.items, conc...)
	if len(u.items) > MaxItems {
		err := request.Invalid("attributes", "attributes: %d rules match, the most one usage reads is %d", len(u.items), MaxItems)
		u.r.Counted(err)
		return err
	}
	return nil
}

// AddItems adds the items a peer region forwarded (Home.Usage), validated
// as AddRule does.
func (u *Request) AddItems(items []homes.Item) error {
	if len(items) == 0 || len(items) > MaxItems {
		return request.Invalid("items", "items: %d, want 1 to %d", len(items), MaxItems)
	}
	for _, it := range items {
		if _, err := u.AddRule(it.Rule, it.Key, it.Cost); err != nil {
			return err
		}
	}
	return nil
}

// Decisions are the items' usages, in order.
func (u *Request) Decisions() []bucket.Decision {
	out := make([]bucket.Decision, len(u.items))
	for i, it := range u.items {
		out[i] = it.Usage
	}
	return out
}

func (u *Request) add(en *request.Entry, key string, cost float64) *Item {
	it := &Item{Entry: en, Key: key, Cost: cost}
	u.items = append(u.items, it)
	return it
}

// Reader reads usage from this region's store and from the home regions
// of pinned rules' keys. The zero value is not usable; it is safe for
// concurrent use.
type Reader struct {
	// Store is this region's store, the one checks use.
	Store bucket.Usager
	// Region is this region.
	Region string
	// Timeout bounds a read at a home region.
	Timeout time.Duration
}

// Read fills every item's Usage under the topology ts: a pinned rule's key
// homed in another region is read there (unless u came from a peer), the
// others in this region's store, rate rules and concurrency rules each in
// one call. It changes no state. A home region or store that does not
// answer is an error: a usage has no fallback to decide from.
func (r *Reader) Read(ctx context.Context, ts *homes.State, u *Request) error {
	var rate, conc []*Item
	remote := map[string][]*Item{}
	var order []string
	for _, it := range u.items {
		if home := r.homeOf(ts, u, it); home != "" {
			if remote[home] == nil {
				order = append(order, home)
			}
			remote[home] = append(remote[home], it)
			continue
		}
		if it.Entry.Rule.Concurrent() {
			conc = append(conc, it)
		} else {
			rate = append(rate, it)
		}
	}
	for _, home := range order {
		if err := r.atHome(ctx, ts, home, remote[home]); err != nil {
			return err
		}
	}
	if len(rate) > 0 {
		reqs := make([]bucket.Request, len(rate))
		for i, it := range rate {
			reqs[i] = bucket.Request{Rule: it.Entry.Rule.ID, Key: it.Key, Limit: it.Entry.For(it.Key).Limit, Cost: it.Cost, Keep: it.Entry.Keep(u.r.Class)}
		}
		ds, err := r.Store.Usage(ctx, reqs)
		if err != nil {
			return fmt.Errorf("%w: store: %w", ErrUnavailable, err)
		}
		for i, it := range rate {
			it.Usage = ds[i]
		}
	}
	if len(conc) > 0 {
		reqs := make([]bucket.LeaseRequest, len(conc))
		for i, it := range conc {
			reqs[i] = bucket.LeaseRequest{Rule: it.Entry.Rule.ID, Key: it.Key, Limit: it.Entry.For(it.Key).Leases, Keep: it.Entry.Keep(u.r.Class)}
		}
		ds, err := r.Store.LeaseUsage(ctx, reqs)
		if err != nil {
			return fmt.Errorf("%w: store: %w", ErrUnavailable, err)
		}
		for i, it := range conc {
			it.Usage, it.held = leaseUsage(ds[i], reqs[i].Keep), ds[i].InFlight
		}
	}
	return nil
}

// leaseUsage is a lease set's usage, for an Acquire keeping keep, as a
// Decision (see Item).
func leaseUsage(d bucket.LeaseDecision, keep float64) bucket.Decision {
	u := bucket.Decision{Allowed: d.Allowed, Remaining: float64(max(bucket.LeaseRoom(d.Limit, keep)-d.InFlight, 0)), Limit: float64(d.Limit),
		RetryAfter: d.RetryAfter, Reserved: d.Reserved}
	if !d.Expires.IsZero() {
		u.ResetAfter = max(time.Until(d.Expires), 0)
	}
	return u
}

// homeOf is the region that holds it's bucket or leases: "" for this one.
func (r *Reader) homeOf(ts *homes.State, u *Request, it *Item) string {
	if !it.Entry.Pinned || ts.Topo == nil || u.peer != "" {
		return ""
	}
	if home := ts.Topo.Home(it.Key, it.Entry.Rule.HomeKeys); home != r.Region {
		return home
	}
	return ""
}

// atHome reads items at their home region.
func (r *Reader) atHome(ctx context.Context, ts *homes.State, home string, items []*Item) error {
	h := ts.Homes[home]
	if h == nil {
		return fmt.Errorf("%w: home region %s: no client for it", ErrUnavailable, home)
	}
	req := make([]homes.Item, len(items))
	for i, it := range items {
		req[i] = homes.Item{Rule: it.Entry.Rule.ID, Key: it.Key, Cost: it.Cost}
	}
	hctx, cancel := context.WithTimeout(ctx, r.Timeout)
	defer cancel()
	ds, err := h.Usage(hctx, req)
	var inv *request.InvalidError
	switch {
	case errors.As(err, &inv), errors.Is(err, request.ErrUnknownRule):
		return err // the home's verdict on the items stands
	case err != nil:
		return fmt.Errorf("%w: home region %s: %w", ErrUnavailable, home, err)
	}
	if len(ds) != len(items) {
		return fmt.Errorf("%w: home region %s answered %d usages for %d rules", ErrUnavailable, home, len(ds), len(items))
	}
	for i, it := range items {
		it.Usage = ds[i]
		if it.Entry.Rule.Concurrent() {
			// A pinned rule keeps no reserve: the home's leases free are
			// of the whole limit.
			it.held = int(ds[i].Limit - ds[i].Remaining)
		}
	}
	return nil
}
