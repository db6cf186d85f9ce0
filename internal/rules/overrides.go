package rules

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// MaxOverrides bounds the overrides of one rule. A rule travels to every
// daemon as one value of the admin rules bucket, and NATS refuses a value
// over its default max_payload of 1 MB: a thousand overrides whose keys
// have the longest length (bucket.MaxKeyLen) stay under it. Every daemon
// parses a rule again when one of its overrides changes, so the bound also
// keeps that change cheap (about 20 ms of one core at the bound).
const MaxOverrides = 1000

// ErrTooManyOverrides: a rule would have more than MaxOverrides overrides.
// It is wrapped in an *Error whose Field is "overrides".
var ErrTooManyOverrides = errors.New("too many overrides")

// Override is the limit of one key of a rule, in place of the rule's: the
// limit fields of the rule's algorithm (only limit, the leases held at
// once, for a concurrency rule), each optional (one not given is the
// rule's). Capacity and Limit are one field under two names, as in a rule.
type Override struct {
	Capacity        *float64 `yaml:"capacity,omitempty"`
	Limit           *float64 `yaml:"limit,omitempty"`
	RefillPerSecond *float64 `yaml:"refill_per_second,omitempty"`
	Window          Duration `yaml:"window,omitempty"`
}

// OverrideField is the dotted field of key's override, for errors:
// overrides["tenant-acme"].capacity (field empty: the override itself).
func OverrideField(key, field string) string {
	f := "overrides[" + strconv.Quote(key) + "]"
	if field != "" {
		f += "." + field
	}
	return f
}

// BucketFor returns the limit of key under the rule: its override's, or
// the rule's.
func (r *Rule) BucketFor(key string) bucket.Limit {
	if len(r.overrides) != 0 {
		if l, ok := r.overrides[key]; ok {
			return l
		}
	}
	return r.limit
}

// OverrideLimits returns the validated limit of each overridden key; the
// caller must not change the map. Nil for a rule without overrides.
func (r *Rule) OverrideLimits() map[string]bucket.Limit { return r.overrides }

// LeasesFor returns the lease limit of key under a concurrency rule: its
// override's, or the rule's.
func (r *Rule) LeasesFor(key string) bucket.LeaseLimit {
	if r.Concurrent() && len(r.overrides) != 0 {
		if l, ok := r.overrides[key]; ok {
			return bucket.LeaseLimit{Limit: int(l.Capacity), TTL: r.leases.TTL, Adaptive: r.leases.Adaptive}
		}
	}
	return r.leases
}

// validateOverrides checks the overrides of r, whose limit is already
// valid, and makes their limits; n is the rule's YAML, nil when unknown.
func (r *Rule) validateOverrides(n *yaml.Node) error {
	if len(r.Overrides) == 0 {
		r.Overrides, r.overrides = nil, nil
		return nil
	}
	if len(r.Overrides) > MaxOverrides {
		return &Error{Index: -1, Field: "overrides", Line: fieldLine0(n, "overrides"),
			Err: fmt.Errorf("%w: %d overrides, the most a rule may have is %d", ErrTooManyOverrides, len(r.Overrides), MaxOverrides)}
	}
	r.overrides = make(map[string]bucket.Limit, len(r.Overrides))
	// In key order: of several bad overrides, the same one is reported
	// every time.
	for _, key := range slices.Sorted(maps.Keys(r.Overrides)) {
		l, field, err := r.overrideLimit(key, r.Overrides[key])
		if err != nil {
			return &Error{Index: -1, Field: OverrideField(key, field), Line: overrideLine(n, key, field), Err: err}
		}
		r.overrides[key] = l
	}
	return nil
}

// overrideLimit is the limit of key's override o, or the error of its
// field (empty: the override or its key).
func (r *Rule) overrideLimit(key string, o Override) (bucket.Limit, string, error) {
	if err := bucket.ValidateKey(key); err != nil {
		return bucket.Limit{}, "", err
	}
	if r.Concurrent() {
		return r.overrideLeases(o)
	}
	l := r.limit
	window := r.Algorithm == bucket.SlidingWindow || r.Algorithm == bucket.SlidingLog || r.Algorithm == bucket.FixedWindow
	switch {
	case o.Capacity != nil && o.Limit != nil:
		return l, "limit", errors.New("capacity is given too: give one of capacity and limit, not both")
	case o.RefillPerSecond != nil && window:
		return l, "refill_per_second", fmt.Errorf("not a parameter of %s: its limit fields are limit (or capacity) and window", r.Algorithm)
	case o.Window != 0 && !window:
		return l, "window", fmt.Errorf("not a parameter of %s: its limit fields are capacity (or limit) and refill_per_second", r.Algorithm)
	case o.Capacity == nil && o.Limit == nil && o.RefillPerSecond == nil && o.Window == 0:
		return l, "", errors.New("sets no limit field: give capacity (or limit), refill_per_second or window")
	}
	field := "capacity"
	if o.Capacity != nil {
		l.Capacity = *o.Capacity
	}
	if o.Limit != nil {
		l.Capacity, field = *o.Limit, "limit"
	}
	if o.RefillPerSecond != nil {
		l.RefillPerSecond = *o.RefillPerSecond
	}
	if o.Window != 0 {
		l.Window = time.Duration(o.Window)
	}
	if err := l.Validate(); err != nil {
		var le *bucket.LimitError
		if errors.As(err, &le) && le.Field != "capacity" {
			field = le.Field
		}
		return l, field, err
	}
	if _, err := l.NormalizeCost(r.Cost); err != nil {
		return l, field, fmt.Errorf("the rule's cost: %w", err)
	}
	if r.Lease > l.Capacity {
		return l, field, fmt.Errorf("must be at least the rule's lease %v, got %v", r.Lease, l.Capacity)
	}
	return l, "", nil
}

// overrideLeases is the limit of an override o of a concurrency rule,
// whose one limit field is limit (or capacity), or the error of its field.
func (r *Rule) overrideLeases(o Override) (bucket.Limit, string, error) {
	switch {
	case o.Capacity != nil && o.Limit != nil:
		return bucket.Limit{}, "limit", errors.New("capacity is given too: give one of capacity and limit, not both")
	case o.RefillPerSecond != nil:
		return bucket.Limit{}, "refill_per_second", errors.New("not a parameter of a concurrency rule: its limit field is limit (or capacity)")
	case o.Window != 0:
		return bucket.Limit{}, "window", errors.New("not a parameter of a concurrency rule: its limit field is limit (or capacity)")
	case o.Capacity == nil && o.Limit == nil:
		return bucket.Limit{}, "", errors.New("sets no limit field: give limit (or capacity)")
	}
	v, field := o.Limit, "limit"
	if v == nil {
		v, field = o.Capacity, "capacity"
	}
	if !(*v >= 1 && *v <= bucket.MaxConcurrency) || *v != float64(int(*v)) {
		return bucket.Limit{}, field, fmt.Errorf("a concurrency limit must be a whole number from 1 to %d, got %v", bucket.MaxConcurrency, *v)
	}
	return bucket.Limit{Algorithm: bucket.Concurrency, Capacity: *v}, "", nil
}

// overrideLine is the line of field of key's override in the rule n (of
// the override, or of overrides, when the field is not written); 0 when n
// is nil.
func overrideLine(n *yaml.Node, key, field string) int {
	if n == nil {
		return 0
	}
	k, v := lookup(n, "overrides")
	if k == nil {
		return n.Line
	}
	ok, ov := lookup(v, key)
	if ok == nil {
		return k.Line
	}
	if field == "" {
		return ok.Line
	}
	if fk, _ := lookup(ov, field); fk != nil {
		return fk.Line
	}
	return ok.Line
}

func fieldLine0(n *yaml.Node, field string) int {
	if n == nil {
		return 0
	}
	return fieldLine(n, field)
}

// WithOverride returns a copy of r with key's override set to o (nil:
// removed), validated as a rule is; r does not change. Its errors are an
// *Error naming the override's field.
func (r *Rule) WithOverride(key string, o *Override) (*Rule, error) {
	c := *r
	c.Overrides = make(map[string]Override, len(r.Overrides)+1)
	for k, v := range r.Overrides {
		c.Overrides[k] = v
	}
	if o == nil {
		delete(c.Overrides, key)
	} else {
		if _, ok := c.Overrides[key]; !ok && len(c.Overrides) >= MaxOverrides {
			return nil, &Error{Index: -1, ID: r.ID, Field: "overrides",
				Err: fmt.Errorf("%w: the rule has %d overrides, the most it may have: delete one first", ErrTooManyOverrides, len(c.Overrides))}
		}
		c.Overrides[key] = *o
	}
	c.overrides, c.yaml = nil, nil
	if err := c.validateOverrides(nil); err != nil {
		return nil, at(err, "", -1, r.ID, nil)
	}
	c.yaml = c.marshal()
	return &c, nil
}

// validateRequestLimit checks allow_request_limit and request_limit_max.
func (r *Rule) validateRequestLimit() error {
	switch {
	case !r.AllowRequestLimit && r.RequestLimitMax != 0:
		return fieldError("request_limit_max", errors.New("only a rule with allow_request_limit: true takes a limit from a request"))
	case r.AllowRequestLimit && r.RequestLimitMax == 0:
		return fieldError("request_limit_max", errors.New("missing: a rule with allow_request_limit: true needs the highest rate, in requests per second, a request may ask"))
	case r.AllowRequestLimit && r.Home == HomePinned:
		return fieldError("allow_request_limit", errors.New("a pinned rule is decided in its keys' home region, which does not see a request's own limit"))
	case r.AllowRequestLimit && !(r.RequestLimitMax > 0 && r.RequestLimitMax <= bucket.MaxRefillPerSecond):
		return fieldErrorf("request_limit_max", "must be above 0 and at most %g requests per second, got %v", float64(bucket.MaxRefillPerSecond), r.RequestLimitMax)
	}
	return nil
}

// Why a request's own limit is ignored (see Rule.RequestLimit).
var (
	// ErrRequestLimitNotAllowed: the rule does not set allow_request_limit.
	ErrRequestLimitNotAllowed = errors.New("the rule does not allow a request's own limit")
	// ErrRequestLimitAboveMax: the limit's rate is above the rule's
	// request_limit_max.
	ErrRequestLimitAboveMax = errors.New("the limit's rate is above the rule's request_limit_max")
)

// RequestLimit is the limit of a request that names its own, requests per
// unit (Envoy's descriptor limit), in the rule's algorithm: a window rule
// counts requests per window of unit; a token bucket or GCRA holds a
// burst of requests, refilled at requests per unit. The request's limit is
// to be ignored when there is an error: ErrRequestLimitNotAllowed,
// ErrRequestLimitAboveMax, or one wrapping bucket.ErrInvalidLimit or
// bucket.ErrInvalidCost for a limit the rule could not have (a sliding log
// above bucket.MaxLogCapacity, a burst below the rule's cost or lease).
func (r *Rule) RequestLimit(requests float64, unit time.Duration) (bucket.Limit, error) {
	if !r.AllowRequestLimit {
		return bucket.Limit{}, ErrRequestLimitNotAllowed
	}
	if !(requests > 0) || unit <= 0 {
		return bucket.Limit{}, fmt.Errorf("%w: %v requests per %v", bucket.ErrInvalidLimit, requests, unit)
	}
	if requests/unit.Seconds() > r.RequestLimitMax {
		return bucket.Limit{}, ErrRequestLimitAboveMax
	}
	l := bucket.Limit{Algorithm: r.Algorithm, Capacity: requests}
	switch r.Algorithm {
	case bucket.TokenBucket, bucket.GCRA:
		l.RefillPerSecond = requests / unit.Seconds()
	default:
		l.Window = unit
	}
	if err := l.Validate(); err != nil {
		return bucket.Limit{}, err
	}
	if _, err := l.NormalizeCost(r.Cost); err != nil {
		return bucket.Limit{}, err
	}
	if r.Lease > l.Capacity {
		return bucket.Limit{}, fmt.Errorf("%w: a burst of %v is below the rule's lease %v", bucket.ErrInvalidLimit, l.Capacity, r.Lease)
	}
	return l, nil
}

// ParseOverride decodes one key's override (YAML or JSON) strictly; the
// rule's WithOverride validates it. Its errors are an *Error naming the
// field: overrides["tenant-a"].burst.
func ParseOverride(key string, data []byte) (*Override, error) {
	if err := bucket.ValidateKey(key); err != nil {
		return nil, &Error{Index: -1, Field: OverrideField(key, ""), Err: err}
	}
	var doc yaml.Node
	if err := yaml.NewDecoder(bytes.NewReader(data)).Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			err = errors.New("empty: give capacity (or limit), refill_per_second or window")
		}
		return nil, &Error{Index: -1, Field: OverrideField(key, ""), Err: err}
	}
	n := resolve(&doc)
	if n.Kind == yaml.DocumentNode && len(n.Content) == 1 {
		n = resolve(n.Content[0])
	}
	if n.Kind != yaml.MappingNode {
		return nil, &Error{Index: -1, Field: OverrideField(key, ""), Err: fmt.Errorf("want a mapping, got %s", describe(n))}
	}
	if err := checkFields(n, reflect.TypeFor[Override](), OverrideField(key, "")+"."); err != nil {
		return nil, err
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var o Override
	if err := dec.Decode(&o); err != nil {
		return nil, &Error{Index: -1, Field: OverrideField(key, ""), Err: err}
	}
	return &o, nil
}
