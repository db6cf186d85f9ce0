package engine

import (
	"errors"
	"math"
	"time"

	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// route says where an item was decided.
type route uint8

const (
	routeNone     route = iota // not decided (another rule refused first)
	routeDeny                  // refused by the deny cache
	routeStore                 // this region's store
	routeHome                  // the key's home region
	routeLease                 // this instance's lease
	routeFallback              // this instance's memory: the store failed
	routeUnknown               // sent to the store, no reply in time
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
	// Decision is the verdict of this rule's bucket. In a check refused by
	// another rule it reports what the bucket has, since nothing was spent.
	Decision bucket.Decision

	e     *entry
	route route
	// limit is what the item is decided against: the rule's limit, or
	// the region's share of a pinned rule whose home did not answer.
	limit bucket.Limit
	// batch, for the check that takes the next lease batch, is what it
	// asks the store for (at least Cost).
	batch float64
	// probe: this check is the deny cache's one probe of the bucket;
	// remembered: the check put a denial of it in the deny cache.
	probe, remembered bool
}

// Limit is the rule's limit.
func (it *Item) Limit() bucket.Limit { return it.e.limit }

// WindowMillis is the rule's window for quota headers: the window of a
// window rule, the time to fill an empty bucket for a token bucket or GCRA.
func (it *Item) WindowMillis() int64 { return WindowMillis(it.e.limit) }

// WindowMillis is a limit's window for quota headers: a window rule's
// window, the time to fill an empty bucket otherwise.
func WindowMillis(l bucket.Limit) int64 {
	if l.Window > 0 {
		return l.Window.Milliseconds()
	}
	return int64(math.Ceil(l.Capacity / l.RefillPerSecond * 1000))
}

// request is what a Check and an Acquire have in common: the rate rules
// of one request, decided together by the pipeline (see Decide), and how
// they are routed. It is not used alone.
type request struct {
	t       *table
	m       *metrics.Metrics
	enforce []*Item
	shadow  []*Item
	// peer is the region that forwarded this request to its keys' home:
	// pinned rules are decided here, never forwarded again.
	peer string
	// sent is the deny cache's instant of the request's first routing.
	sent int64
	// maxWait, when above 0, paces the request (Check.Pace); always 0 for
	// an Acquire, which has no Pace.
	maxWait time.Duration
}

// Check is one request's rate rules, decided together by Engine.Decide.
// Build it with Engine.NewCheck and its Add methods; it uses the rules in
// force when it was made, throughout. A concurrency rule is refused (see
// Acquire). Not safe for concurrent use.
type Check struct {
	request
}

// Pace makes the check paced: instead of refusing, it reserves the next
// slot within maxWait (at most bucket.MaxWait) and is allowed with a wait
// (Item.Decision.Wait, the same for every rule: they reserve at one
// instant). Call it after the rules are added. Only token bucket and GCRA
// rules pace, and a paced check's enforced rules must all count against
// one key (one store script reserves them at one instant); shadow rules are
// decided unpaced. Errors are an *InvalidError naming max_wait_ms (and the
// rule at fault), counted as AddRule's are. 0 leaves the check unpaced.
func (c *Check) Pace(maxWait time.Duration) error {
	err := c.pace(maxWait)
	c.counted(err)
	return err
}

func (c *Check) pace(maxWait time.Duration) error {
	if err := (bucket.Limit{Algorithm: bucket.GCRA}).ValidateWait(maxWait); err != nil {
		return invalid("max_wait_ms", "max_wait_ms: %w", err)
	}
	if maxWait == 0 {
		return nil
	}
	for _, it := range c.enforce {
		if err := it.e.limit.ValidateWait(maxWait); err != nil {
			return invalid("max_wait_ms", "max_wait_ms: rule %s: %w", quote(it.Rule.ID), err)
		}
		if it.Key != c.enforce[0].Key {
			return invalid("max_wait_ms", "max_wait_ms: rule %s: %w: its rules count against several keys, which no one script reserves at one instant",
				quote(it.Rule.ID), bucket.ErrInvalidWait)
		}
	}
	for _, it := range c.enforce {
		// A rule's max_wait caps the wait: its key's queue holds at most
		// that much.
		if mw := time.Duration(it.Rule.MaxWait); mw > 0 && mw < maxWait {
			maxWait = mw
		}
	}
	c.maxWait = maxWait
	return nil
}

// MaxWait is the check's longest wait (Pace); 0 when it is not paced.
func (c *Check) MaxWait() time.Duration { return c.maxWait }

// NewCheck starts a check under the rules in force now.
func (e *Engine) NewCheck() *Check { return &Check{request{t: e.table.Load(), m: e.m}} }

// FromPeer marks the request as forwarded by an authenticated peer region:
// this region is its keys' home, so pinned rules are decided here.
func (c *request) FromPeer(region string) { c.peer = region }

// Enforced returns the request's enforced rate rules, in the order added.
func (c *request) Enforced() []*Item { return c.enforce }

// Shadows returns the request's shadow rules, in the order added.
func (c *request) Shadows() []*Item { return c.shadow }

// AddRule adds the rule ruleID for key at cost (0 means 1). Errors are an
// *InvalidError naming rule_id (wrapping ErrUnknownRule), key or cost; each
// is counted in limiter_invalid_requests_total.
func (c *Check) AddRule(ruleID, key string, cost float64) (*Item, error) {
	it, err := c.addRule(ruleID, key, cost)
	c.counted(err)
	return it, err
}

// counted counts an invalid request by its field.
func (c *request) counted(err error) {
	if err == nil {
		return // and inv does not escape to the heap on every check
	}
	var inv *InvalidError
	if errors.As(err, &inv) {
		c.m.Invalid.WithLabelValues(inv.Field).Inc()
	}
}

func (c *Check) addRule(ruleID, key string, cost float64) (*Item, error) {
	en, err := c.lookup(ruleID, key)
	if err != nil {
		return nil, err
	}
	if en.rule.Concurrent() {
		return nil, concurrencyCheckError("rule_id", "rule_id: ", ruleID)
	}
	return c.addRate(en, key, cost)
}

// lookup finds the rule ruleID in force and validates key.
func (c *request) lookup(ruleID, key string) (*entry, error) {
	en := c.t.byID[ruleID]
	if en == nil {
		return nil, invalid("rule_id", "rule_id: %w", errUnknownRule(ruleID))
	}
	if err := bucket.ValidateKey(key); err != nil {
		return nil, invalid("key", "key: %w", err)
	}
	return en, nil
}

// addRate adds the rate rule of en for key at cost (0 means 1).
func (c *request) addRate(en *entry, key string, cost float64) (*Item, error) {
	cost, err := en.limit.NormalizeCost(cost)
	if err != nil {
		return nil, invalid("cost", "cost: %w", err)
	}
	return c.add(en, key, cost)
}

type unknownRuleError struct{ id string }

func (e *unknownRuleError) Error() string { return "unknown rule " + quote(e.id) }
func (e *unknownRuleError) Unwrap() error { return ErrUnknownRule }

func errUnknownRule(id string) error { return &unknownRuleError{id} }

func quote(s string) string {
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
	c.counted(err)
	return enforce, shadow, err
}

func (c *Check) addAttributes(a *rules.Attributes, reqCost float64) (enforce, shadow []*Item, err error) {
	return c.matching(a, reqCost, func(r *rules.Rule, _ *entry, _ string) error {
		return concurrencyCheckError("attributes", "attributes: ", r.ID)
	})
}

// matching adds the rate rules whose match a satisfies (see
// Check.AddAttributes); a concurrency rule that matches is given to
// concurrent, which adds it or refuses it.
func (c *request) matching(a *rules.Attributes, reqCost float64, concurrent func(r *rules.Rule, en *entry, key string) error) (enforce, shadow []*Item, err error) {
	if reqCost == 0 {
		reqCost = 1
	}
	if !(reqCost > 0) || math.IsInf(reqCost, 0) {
		return nil, nil, invalid("cost", "cost: %v is not finite and > 0", reqCost)
	}
	if err := checkAttributes(a); err != nil {
		return nil, nil, err
	}
	for _, r := range c.t.set.Matching(a) {
		key, ok, err := r.KeyOf(a)
		if err != nil {
			return nil, nil, invalid("attributes", "attributes.%w", err)
		}
		if !ok {
			continue
		}
		if err := bucket.ValidateKey(key); err != nil {
			return nil, nil, invalid("attributes", "attributes: rule %q: %w", r.ID, err)
		}
		en := c.t.byID[r.ID]
		if r.Concurrent() {
			if err := concurrent(r, en, key); err != nil {
				return nil, nil, err
			}
			continue
		}
		cost, err := en.limit.NormalizeCost(r.Cost * reqCost)
		if err != nil {
			return nil, nil, invalid("cost", "cost: rule %q: %w", r.ID, err)
		}
		it, err := c.add(en, key, cost)
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
			return invalid("attributes", "attributes.%s: %d bytes, the most is %d", f.name, len(f.v), MaxAttributeBytes)
		}
	}
	if len(a.Extra) > MaxExtraAttributes {
		return invalid("attributes", "attributes.extra: %d entries, the most is %d", len(a.Extra), MaxExtraAttributes)
	}
	for k, v := range a.Extra {
		if len(k) > MaxAttributeBytes || len(v) > MaxAttributeBytes {
			return invalid("attributes", "attributes.extra[%s]: name or value over %d bytes", quote(k), MaxAttributeBytes)
		}
	}
	return nil
}

var errTooManyRules = errors.New("the check has more rules than the most one check may have")

func (c *request) add(en *entry, key string, cost float64) (*Item, error) {
	list := &c.enforce
	if en.rule.Shadow {
		list = &c.shadow
	}
	// A linear scan: a check has a few rules, at most MaxItems.
	for _, it := range *list {
		if it.e == en && it.Key == key {
			it.Cost = max(it.Cost, cost)
			return it, nil
		}
	}
	if len(*list) >= MaxItems {
		return nil, invalid("attributes", "attributes: %w (%d)", errTooManyRules, MaxItems)
	}
	it := &Item{Rule: en.rule, Key: key, Cost: cost, e: en, limit: en.limit}
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
