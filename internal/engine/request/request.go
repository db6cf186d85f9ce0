// Package request is what a front door asks the engine (internal/engine)
// to decide: a Check, the rate rules of one request, each an Item (a rule
// in force, a key, a cost) that carries its Decision once decided; the
// rule table they are built from (Table: the rules in force with their
// limits, shares and counters); and the errors of building one
// (InvalidError, ErrUnknownRule, ErrConcurrencyRule). An Acquire, a
// request with concurrency rules, is built in internal/engine/concurrency
// on the same Request. The engine routes and decides them: this package
// decides nothing.
package request

import (
	"errors"
	"math"
	"slices"
	"time"

	"fmt"

	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// Route says where an item was decided.
type Route uint8

// Where an item was decided.
const (
	RouteNone     Route = iota // not decided (another rule refused first)
	RouteDeny                  // refused by the deny cache
	RouteStore                 // this region's store
	RouteHome                  // the key's home region
	RouteLease                 // this instance's lease
	RouteFallback              // this instance's memory: the store failed
	RouteUnknown               // sent to the store, no reply in time
)

// Item is one enforced or shadow rule of a check: the bucket of Key under
// Rule, spending Cost. After Decide, Decision is its verdict. An Item
// belongs to one Check and is not safe for concurrent use.
type Item struct {
	// Rule is the rule, as in force when the check was built.
	Rule *rules.Rule
	// Key is the client the rule counts against.
	Key string
	// Cost is what the request spends under the rule, normalized.
	Cost float64
	// Keep is what the check's priority class keeps of the rule's
	// capacity for the classes above it (bucket.Request.Keep): 0 for the
	// most important class, or a rule without reserve.
	Keep float64
	// Decision is the verdict of this rule's bucket. In a check refused by
	// another rule it reports what the bucket has, since nothing was spent.
	Decision bucket.Decision

	// The rest is the engine's, as its stages decide the item: a front
	// door reads the fields above.

	// Entry is the rule's entry in the table the item was built from.
	Entry *Entry
	Route Route
	// Limits are the key's: its override's, or the rule's.
	Limits *Limits
	// Against is what the item is decided against: the key's limit, or
	// the region's share of a pinned rule whose home did not answer.
	Against bucket.Limit
	// Batch, for the check that takes the next lease batch, is what it
	// asks the store for (at least Cost).
	Batch float64
	// Probe: this check is the deny cache's one probe of the bucket;
	// Remembered: the check put a denial of it in the deny cache.
	Probe, Remembered bool
}

// Limit is the key's limit under the rule: its override's, the one the
// request named (UseLimit), or the rule's.
func (it *Item) Limit() bucket.Limit { return it.Limits.Limit }

// WindowMillis is the key's window for quota headers: the window of a
// window rule, the time to fill an empty bucket for a token bucket or GCRA.
func (it *Item) WindowMillis() int64 { return WindowMillis(it.Limits.Limit) }

// UseLimit decides the item against l, a limit the request named for
// itself (see rules.Rule.RequestLimit), in place of its key's. It reports
// false, and changes nothing, when the item's cost is not valid under l.
// Call it before the check is decided.
func (it *Item) UseLimit(l bucket.Limit, regions int) bool {
	if _, err := l.NormalizeCost(it.Cost); err != nil {
		return false
	}
	kl := NewLimits(l, regions)
	it.Limits, it.Against = &kl, l
	return true
}

// WindowMillis is a limit's window for quota headers: a window rule's
// window, the time to fill an empty bucket otherwise.
func WindowMillis(l bucket.Limit) int64 {
	if l.Window > 0 {
		return l.Window.Milliseconds()
	}
	return int64(math.Ceil(l.Capacity / l.RefillPerSecond * 1000))
}

// Request is what a Check and an Acquire have in common: the rate rules
// of one request, decided together by the engine (see engine.Decide), and
// how they are routed. It is not used alone. Its fields are the engine's.
type Request struct {
	// Table is the rule table the request is built from, throughout;
	// Metrics counts its invalid requests.
	Table   *Table
	Metrics *metrics.Metrics
	// Enforce and Shadow are its enforced and shadow rate rules.
	Enforce []*Item
	Shadow  []*Item
	// Leased are an Acquire's concurrency rules (nil for a check), which
	// internal/engine/concurrency holds: Reserved reads their decisions.
	Leased []*Item
	// Peer is the region that forwarded this request to its keys' home:
	// pinned rules are decided here, never forwarded again.
	Peer string
	// Sent is the deny cache's instant of the request's first routing.
	Sent int64
	// MaxWait, when above 0, paces the request (Check.Pace); always 0 for
	// an Acquire, which has no Pace, and for a check whose class keeps a
	// reserve of one of its rules (see Request.SetPriority).
	MaxWait time.Duration
	// asked is the wait Check.Pace was given (capped by the rules), which
	// MaxWait is unless the class keeps a reserve.
	asked time.Duration
	// Settle: the check spends an estimate to settle later (Check.Settle);
	// its rules are decided in the store, never from a token lease.
	Settle bool
	// Class is the request's priority class, an index of Table.Classes
	// (SetPriority); the zero Request's, until set, is the most important.
	Class int
}

// ClassName is the name of the request's priority class.
func (c *Request) ClassName() string { return c.Table.Classes.Names()[c.Class] }

// Reserved reports whether the decided request was refused only for the
// reserves its class keeps: at least one rule refused it, and each that
// did would have allowed it as the most important class
// (bucket.Decision.Reserved, of an Acquire's leases too). Such a refusal
// is the service shedding load, not the client's doing: front doors
// answer it as unavailable (503), not as over the limit (429).
func (c *Request) Reserved() bool {
	if len(c.Leased) == 0 {
		return Reserved(c.Enforce)
	}
	return Reserved(append(slices.Clip(c.Leased), c.Enforce...))
}

// Reserved reports whether items, a decided request's enforced rules,
// refused it only for the reserves its class keeps (Request.Reserved).
func Reserved(items []*Item) bool {
	refused := false
	for _, it := range items {
		if it.Decision.Allowed || it.Route == RouteNone {
			continue
		}
		if !it.Decision.Reserved {
			return false
		}
		refused = true
	}
	return refused
}

// SetPriority gives the request the priority class name: one of the
// table's classes, or its default class for an empty or unknown name.
// A name longer than rules.MaxClassLen bytes is an *InvalidError naming
// priority, counted as AddRule's are. A paced check whose class keeps a
// reserve of one of its rules is decided unpaced (see Check.Pace). Call it
// before or after the rules are added.
func (c *Request) SetPriority(name string) error {
	err := c.setPriority(name)
	c.Counted(err)
	return err
}

func (c *Request) setPriority(name string) error {
	if len(name) > rules.MaxClassLen {
		return Invalid("priority", "priority: %d bytes, the most is %d", len(name), rules.MaxClassLen)
	}
	c.Class = c.Table.Classes.Index(name)
	for _, list := range [][]*Item{c.Enforce, c.Shadow} {
		for _, it := range list {
			it.Keep = it.Entry.Keep(c.Class)
		}
	}
	c.paceKept()
	return nil
}

// paceKept sets the wait of a paced request: the one it asked for, or none
// when its class keeps a reserve of one of its rules. A reservation spends
// the refill until its slot, which a more important class arriving
// meanwhile would find gone: a wait would dip into the reserve.
func (c *Request) paceKept() {
	c.MaxWait = c.asked
	for _, it := range c.Enforce {
		if it.Keep > 0 {
			c.MaxWait = 0
		}
	}
}

// Check is one request's rate rules, decided together by engine.Engine.Decide.
// Build it with engine.Engine.NewCheck and its Add methods; it uses the rules in
// force when it was made, throughout. A concurrency rule is refused (see
// concurrency.Acquire). Not safe for concurrent use.
type Check struct {
	Request
}

// Pace makes the check paced: instead of refusing, it reserves the next
// slot within maxWait (at most bucket.MaxWait) and is allowed with a wait
// (Item.Decision.Wait, the same for every rule: they reserve at one
// instant). Call it after the rules are added. A check whose priority
// class keeps a reserve of one of its rules never waits: it is decided
// now, as unpaced, allowed only above what its class keeps. Only token bucket and GCRA
// rules pace, and a paced check's enforced rules must all count against
// one key (one store script reserves them at one instant); shadow rules are
// decided unpaced. Errors are an *InvalidError naming max_wait_ms (and the
// rule at fault), counted as AddRule's are. 0 leaves the check unpaced.
func (c *Check) Pace(maxWait time.Duration) error {
	err := c.pace(maxWait)
	c.Counted(err)
	return err
}

func (c *Check) pace(maxWait time.Duration) error {
	if err := (bucket.Limit{Algorithm: bucket.GCRA}).ValidateWait(maxWait); err != nil {
		return Invalid("max_wait_ms", "max_wait_ms: %w", err)
	}
	if maxWait == 0 {
		return nil
	}
	for _, it := range c.Enforce {
		if err := it.Limits.Limit.ValidateWait(maxWait); err != nil {
			return Invalid("max_wait_ms", "max_wait_ms: rule %s: %w", Quote(it.Rule.ID), err)
		}
		if it.Key != c.Enforce[0].Key {
			return Invalid("max_wait_ms", "max_wait_ms: rule %s: %w: its rules count against several keys, which no one script reserves at one instant",
				Quote(it.Rule.ID), bucket.ErrInvalidWait)
		}
	}
	for _, it := range c.Enforce {
		// A rule's max_wait caps the wait: its key's queue holds at most
		// that much.
		if mw := time.Duration(it.Rule.MaxWait); mw > 0 && mw < maxWait {
			maxWait = mw
		}
	}
	c.asked = maxWait
	c.paceKept()
	return nil
}

// Settle makes the check spend its cost as an estimate, to be settled
// with the actual cost later (engine.Engine.Settle): its rules are
// decided in the store, which records when it spent, never from a token
// lease. Call it after the rules are added. A paced check cannot settle:
// the error is an *InvalidError naming settle, counted as AddRule's are.
func (c *Check) Settle() error {
	var err error
	if c.asked > 0 || c.Request.MaxWait > 0 {
		err = Invalid("settle", "settle: a paced check (max_wait_ms) cannot settle its cost later")
	}
	c.Counted(err)
	if err == nil {
		c.Request.Settle = true
	}
	return err
}

// MaxWait is the check's longest wait (Pace); 0 when it is not paced.
func (c *Check) MaxWait() time.Duration { return c.Request.MaxWait }

// NewCheck starts a check under the rules of t, counting its invalid
// requests in m.
func NewCheck(t *Table, m *metrics.Metrics) *Check {
	return &Check{Request{Table: t, Metrics: m, Class: t.DefaultClass()}}
}

// FromPeer marks the request as forwarded by an authenticated peer region:
// this region is its keys' home, so pinned rules are decided here.
func (c *Request) FromPeer(region string) { c.Peer = region }

// Enforced returns the request's enforced rate rules, in the order added.
func (c *Request) Enforced() []*Item { return c.Enforce }

// Shadows returns the request's shadow rules, in the order added.
func (c *Request) Shadows() []*Item { return c.Shadow }

// AddRule adds the rule ruleID for key at cost (0 means 1). Errors are an
// *InvalidError naming rule_id (wrapping ErrUnknownRule), key or cost; each
// is counted in limiter_invalid_requests_total.
func (c *Check) AddRule(ruleID, key string, cost float64) (*Item, error) {
	it, err := c.addRule(ruleID, key, cost)
	c.Counted(err)
	return it, err
}

// Counted counts an invalid request by its field.
func (c *Request) Counted(err error) {
	if err == nil {
		return // and inv does not escape to the heap on every check
	}
	var inv *InvalidError
	if errors.As(err, &inv) {
		c.Metrics.Invalid.WithLabelValues(inv.Field).Inc()
	}
}

func (c *Check) addRule(ruleID, key string, cost float64) (*Item, error) {
	en, err := c.Lookup(ruleID, key)
	if err != nil {
		return nil, err
	}
	if en.Rule.Concurrent() {
		return nil, concurrencyCheckError("rule_id", "rule_id: ", ruleID)
	}
	return c.addRate(en, key, cost)
}

// Lookup finds the rule ruleID in force and validates key.
func (c *Request) Lookup(ruleID, key string) (*Entry, error) {
	en := c.Table.ByID[ruleID]
	if en == nil {
		return nil, Invalid("rule_id", "rule_id: %w", UnknownRule(ruleID))
	}
	if err := bucket.ValidateKey(key); err != nil {
		return nil, Invalid("key", "key: %w", err)
	}
	return en, nil
}

// addRate adds the rate rule of en for key at cost (0 means 1).
func (c *Request) addRate(en *Entry, key string, cost float64) (*Item, error) {
	lims := en.For(key)
	cost, err := lims.Limit.NormalizeCost(cost)
	if err != nil {
		return nil, Invalid("cost", "cost: %w", err)
	}
	return c.add(en, lims, key, cost)
}

type unknownRuleError struct{ id string }

func (e *unknownRuleError) Error() string { return "unknown rule " + Quote(e.id) }
func (e *unknownRuleError) Unwrap() error { return ErrUnknownRule }

// UnknownRule is the error of the rule id, which names no rule in force:
// it wraps ErrUnknownRule.
func UnknownRule(id string) error { return &unknownRuleError{id} }

// Quote quotes s for an error message, cut to 64 bytes.
func Quote(s string) string {
	if len(s) > 64 {
		s = s[:64] + "..."
	}
	return `"` + s + `"`
}

// AddAttributes adds every rule whose match a satisfies, each against the
// key its key_by picks, at its own cost times reqCost (0 means 1): the
// enforced rules and the shadow ones it added. A rule already in the check
// with the same key is one bucket, checked once at the larger cost (Envoy's
// descriptors may name it twice). Errors are *InvalidError naming
// attributes or cost, counted as AddRule's are.
func (c *Check) AddAttributes(a *rules.Attributes, reqCost float64) (enforce, shadow []*Item, err error) {
	enforce, shadow, err = c.addAttributes(a, reqCost)
	c.Counted(err)
	return enforce, shadow, err
}

func (c *Check) addAttributes(a *rules.Attributes, reqCost float64) (enforce, shadow []*Item, err error) {
	return c.Match(a, reqCost, func(r *rules.Rule, _ *Entry, _ string) error {
		return concurrencyCheckError("attributes", "attributes: ", r.ID)
	})
}

func concurrencyCheckError(field, prefix, rule string) *InvalidError {
	return Invalid(field, "%srule %s: %w: call Acquire before the request and Release after it", prefix, Quote(rule), ErrConcurrencyRule)
}

// Match adds the rate rules whose match a satisfies (see
// Check.AddAttributes); a concurrency rule that matches is given to
// concurrent, which adds it or refuses it.
func (c *Request) Match(a *rules.Attributes, reqCost float64, concurrent func(r *rules.Rule, en *Entry, key string) error) (enforce, shadow []*Item, err error) {
	if reqCost == 0 {
		reqCost = 1
	}
	if !(reqCost > 0) || math.IsInf(reqCost, 0) {
		return nil, nil, Invalid("cost", "cost: %v is not finite and > 0", reqCost)
	}
	if err := checkAttributes(a); err != nil {
		return nil, nil, err
	}
	for _, r := range c.Table.Set.Matching(a) {
		key, ok, err := r.KeyOf(a)
		if err != nil {
			return nil, nil, Invalid("attributes", "attributes.%w", err)
		}
		if !ok {
			continue
		}
		if err := bucket.ValidateKey(key); err != nil {
			return nil, nil, Invalid("attributes", "attributes: rule %q: %w", r.ID, err)
		}
		en := c.Table.ByID[r.ID]
		if r.Concurrent() {
			if err := concurrent(r, en, key); err != nil {
				return nil, nil, err
			}
			continue
		}
		lims := en.For(key)
		cost, err := lims.Limit.NormalizeCost(r.Cost * reqCost)
		if err != nil {
			return nil, nil, Invalid("cost", "cost: rule %q: %w", r.ID, err)
		}
		it, err := c.add(en, lims, key, cost)
		if err != nil {
			return nil, nil, err
		}
		if r.Shadow {
			shadow = append(shadow, it)
		} else {
			enforce = append(enforce, it)
		}
	}
	return enforce, shadow, nil
}

// Bounds of a check's attributes, whatever the front door: matching a
// rule's path pattern against them costs at most their length.
const (
	// MaxAttributeBytes bounds each attribute's value (and an extra
	// attribute's name).
	MaxAttributeBytes = 8 << 10
	// MaxExtraAttributes bounds the named attributes of a check.
	MaxExtraAttributes = 32
)

// checkAttributes refuses attributes over the bounds, naming the field.
func checkAttributes(a *rules.Attributes) *InvalidError {
	for _, f := range [...]struct{ name, v string }{{"api_key", a.APIKey}, {"user", a.User}, {"ip", a.IP},
		{"path", a.Path}, {"method", a.Method}, {"plan", a.Plan}, {"domain", a.Domain}} {
		if len(f.v) > MaxAttributeBytes {
			return Invalid("attributes", "attributes.%s: %d bytes, the most is %d", f.name, len(f.v), MaxAttributeBytes)
		}
	}
	if len(a.Extra) > MaxExtraAttributes {
		return Invalid("attributes", "attributes.extra: %d entries, the most is %d", len(a.Extra), MaxExtraAttributes)
	}
	for k, v := range a.Extra {
		if len(k) > MaxAttributeBytes || len(v) > MaxAttributeBytes {
			return Invalid("attributes", "attributes.extra[%s]: name or value over %d bytes", Quote(k), MaxAttributeBytes)
		}
	}
	return nil
}

var errTooManyRules = errors.New("the check has more rules than the most one check may have")

func (c *Request) add(en *Entry, lims *Limits, key string, cost float64) (*Item, error) {
	list := &c.Enforce
	if en.Rule.Shadow {
		list = &c.Shadow
	}
	// A linear scan: a check has a few rules, at most MaxItems.
	for _, it := range *list {
		if it.Entry == en && it.Key == key {
			it.Cost = max(it.Cost, cost)
			return it, nil
		}
	}
	if len(*list) >= MaxItems {
		return nil, Invalid("attributes", "attributes: %w (%d)", errTooManyRules, MaxItems)
	}
	it := &Item{Rule: en.Rule, Key: key, Cost: cost, Keep: en.Keep(c.Class), Entry: en, Limits: lims, Against: lims.Limit}
	*list = append(*list, it)
	return it, nil
}

// MostRestrictive is the item that decides a check: the refusal with the
// longest retry, or, when all allowed, the one with the least left for its
// limit; nil for no items.
func MostRestrictive(items []*Item) *Item {
	var top *Item
	for _, it := range items {
		switch {
		case top == nil:
			top = it
		case !it.Decision.Allowed || !top.Decision.Allowed:
			if !it.Decision.Allowed && (top.Decision.Allowed || it.Decision.RetryAfter > top.Decision.RetryAfter) {
				top = it
			}
		case it.Decision.Remaining/it.Decision.Limit < top.Decision.Remaining/top.Decision.Limit:
			top = it
		}
	}
	return top
}

// CeilMillis rounds up: a rejection never says retry in 0 ms.
func CeilMillis(d time.Duration) int64 {
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

// MaxItems bounds the enforced rules of one check (and again its shadow
// rules): what one request may cost the store.
const MaxItems = 64

// Errors of building a request. Front doors test them with errors.Is and
// errors.As and translate them into their own statuses.
var (
	// ErrUnknownRule: a check by rule id names no rule in force.
	ErrUnknownRule = errors.New("unknown rule")
	// ErrConcurrencyRule: a Check (by rule id or attributes) met a
	// concurrency rule, which only Acquire holds: a Check has no end to
	// release it at. Its *InvalidError names the rule.
	ErrConcurrencyRule = errors.New("a concurrency rule is held by Acquire and Release, not checked")
)

// InvalidError is a request refused as invalid. Field names the request
// field at fault: rule_id, key, cost or attributes.
type InvalidError struct {
	Field string
	Err   error
}

// Error is the cause's message, which starts with the path of the field
// (rule_id, key, cost, attributes.ip, descriptors[1].entries, ...).
func (e *InvalidError) Error() string { return e.Err.Error() }

// Unwrap returns the cause (bucket.ErrInvalidCost, bucket.ErrInvalidKey, ...).
func (e *InvalidError) Unwrap() error { return e.Err }

// Invalid is an *InvalidError of field whose message is format, which
// must start with the field's path.
func Invalid(field string, format string, args ...any) *InvalidError {
	return &InvalidError{Field: field, Err: fmt.Errorf(format, args...)}
}
