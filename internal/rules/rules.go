// Package rules loads and validates the rule set limiterd enforces.
package rules

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
)

// OnFailure says what a rule does when the store cannot decide.
type OnFailure string

const (
	// FailOpen decides from a local in-memory bucket sized limit / fleet size.
	FailOpen OnFailure = "open"
	// FailClosed refuses: gRPC UNAVAILABLE, HTTP 503.
	FailClosed OnFailure = "closed"
)

// ErrInvalid wraps every error about the content of a rules file or rule.
// Those of Parse, Load, ParseRule and Build are an *Error, which names the
// file, the rule and the field.
var ErrInvalid = errors.New("invalid rules")

var (
	// idPattern puts a dot only between two other characters, so that an
	// id is also a key of the admin rules bucket (a NATS KV key refuses a
	// leading or trailing dot and two in a row).
	idPattern     = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$`)
	regionPattern = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,62}$`)
)

// Rule is one configured rule, as written in a rules file.
type Rule struct {
	// ID names the rule in checks, keys and metrics.
	ID string `yaml:"id"`
	// Algorithm defaults to token_bucket.
	Algorithm bucket.Algorithm `yaml:"algorithm"`
	// Capacity is the burst of a token bucket or GCRA; Limit the count per
	// window of the window algorithms. Either name is accepted, not both.
	Capacity *float64 `yaml:"capacity"`
	Limit    *float64 `yaml:"limit"`
	// RefillPerSecond is the refill rate of a token bucket or GCRA.
	RefillPerSecond float64 `yaml:"refill_per_second"`
	// Window is the window of the window algorithms, e.g. "1m", "24h".
	Window Duration `yaml:"window"`
	// OnFailure defaults to open.
	OnFailure OnFailure `yaml:"on_failure"`
	// Reconcile shares the rule's spends with the other regions (default
	// true). A region that does not reconcile enforces the full limit on
	// its own traffic only.
	Reconcile *bool `yaml:"reconcile"`
	// Home is "local" (the default: every region decides, spends are
	// reconciled) or "pinned": each key is decided only in its home region,
	// a hard global limit at the price of a cross-region round trip.
	Home Home `yaml:"home"`
	// Match selects the requests of attribute-based checks the rule
	// applies to; without it the rule applies only to checks naming it.
	Match *Match `yaml:"match"`
	// KeyBy picks the client key from a request's attributes: api_key,
	// user, ip (an IPv6 address counts by its /64), global (one bucket for
	// everyone) or attr:NAME. Default api_key.
	KeyBy string `yaml:"key_by"`
	// Cost is what one request spends under this rule (default 1; a check's
	// own cost multiplies it).
	Cost float64 `yaml:"cost"`
	// Shadow counts and logs what the rule would reject, and rejects nothing.
	Shadow bool `yaml:"shadow"`
	// Lease, when set, lets each limiterd take this many tokens from the
	// shared bucket in one call and hand them out locally (token_bucket
	// and gcra only): for trusted high-rate clients.
	Lease float64 `yaml:"lease"`
	// LeaseTTL is the length of a concurrency rule's lease (default
	// DefaultLeaseTTL): one neither released nor renewed within it
	// expires and its slot comes back. Not "lease", which is the tokens a
	// token_bucket or gcra rule leases per store call.
	LeaseTTL Duration `yaml:"lease_ttl"`
	// HomeKeys pins keys to regions explicitly; other keys of a pinned
	// rule go to a stable hash of the key over the regions.
	HomeKeys map[string]string `yaml:"home_keys"`
	// MaxWait, when set, caps the wait of a paced check of this rule (its
	// max_wait_ms; token_bucket and gcra only, at most bucket.MaxWait), so
	// that one key's queue of reserved slots holds at most MaxWait of them
	// and a caller asking MaxWait is never locked out by a deeper one.
	MaxWait Duration `yaml:"max_wait"`
	// SettleWithin is how long the settlement of a check that spent an
	// estimate (CheckRequest.settle) may be settled with its actual cost
	// (default DefaultSettleWithin, at most MaxSettleWithin); after it the
	// estimate stands. Not for a concurrency rule.
	SettleWithin Duration `yaml:"settle_within"`
	// MaxOvershoot is the accuracy budget of a reconciled rule, a fraction
	// of its capacity (default DefaultMaxOvershoot): a key whose spend not
	// yet published reaches it is published within a short tick instead
	// of at the next interval.
	MaxOvershoot *float64 `yaml:"max_overshoot,omitempty"`
	// Overrides give some keys a limit of their own in place of the
	// rule's: the limit fields of the rule's algorithm (capacity or
	// limit, refill_per_second, window), each defaulting to the rule's. At
	// most MaxOverrides.
	Overrides map[string]Override `yaml:"overrides,omitempty"`
	// AllowRequestLimit lets a front door's request name its own limit
	// for the rule (Envoy's descriptor limit), at most RequestLimitMax.
	AllowRequestLimit bool `yaml:"allow_request_limit,omitempty"`
	// RequestLimitMax is the highest sustained rate, in requests per
	// second, a request's own limit may have: required with
	// AllowRequestLimit.
	RequestLimitMax float64 `yaml:"request_limit_max,omitempty"`
	// Reserve keeps part of a token bucket's or GCRA's capacity, or of a
	// concurrency rule's limit, for the more important priority classes: a
	// fraction per class, each in [0, 1), adding up to less than 1. A
	// check may spend only while, after its spend, at least the reserves
	// of the classes above its own are left; an Acquire takes a lease only
	// while fewer than the limit less those reserves are held.
	Reserve map[string]float64 `yaml:"reserve,omitempty"`
	// Adaptive makes a concurrency rule's limit of each key follow the
	// latencies its callers report when they release (see bucket.Adaptive):
	// it starts at the rule's limit and stays within [min, max].
	Adaptive *Adaptive `yaml:"adaptive,omitempty"`

	limit     bucket.Limit
	overrides map[string]bucket.Limit
	leases    bucket.LeaseLimit
	source    string
	// yaml is the rule marshalled once it is valid: a set's digest reads
	// every rule's YAML, and marshalling each again on every change made a
	// put cost every daemon O(rules) marshals.
	yaml []byte
}

// Source is where the rule comes from: "file" or "admin".
func (r *Rule) Source() string { return r.source }

// Sources of rules.
const (
	SourceFile  = "file"
	SourceAdmin = "admin"
)

// Home says where a rule's keys are decided.
type Home string

const (
	// HomeLocal: every region decides with the full limit; reconciled.
	HomeLocal Home = "local"
	// HomePinned: each key is decided in its home region only.
	HomePinned Home = "pinned"
)

// Pinned reports whether the rule's keys are decided in a home region.
func (r *Rule) Pinned() bool { return r.Home == HomePinned }

// Reconciled reports whether the rule's spends go to the other regions:
// never for a pinned rule, whose only state is in the home region.
func (r *Rule) Reconciled() bool {
	return !r.Pinned() && !r.Concurrent() && (r.Reconcile == nil || *r.Reconcile)
}

// Concurrent reports whether the rule counts requests in flight
// (algorithm concurrency): it is held by leases (Acquire, Release, Renew),
// never spent by a Check.
func (r *Rule) Concurrent() bool { return r.Algorithm == bucket.Concurrency }

// Leases is a concurrency rule's validated limit and lease length.
func (r *Rule) Leases() bucket.LeaseLimit { return r.leases }

// DefaultMaxOvershoot is the accuracy budget of a rule without
// max_overshoot: a tenth of its capacity.
const DefaultMaxOvershoot = 0.1

// Overshoot is the rule's accuracy budget, a fraction of its capacity.
func (r *Rule) Overshoot() float64 {
	if r.MaxOvershoot == nil {
		return DefaultMaxOvershoot
	}
	return *r.MaxOvershoot
}

// SpendBudget is the spend of one key, in tokens, past which a region
// publishes it at once: Overshoot × capacity.
func (r *Rule) SpendBudget() float64 { return r.Overshoot() * r.limit.Capacity }

// Settlement windows (settle_within).
const (
	// DefaultSettleWithin is the settle_within of a rule without one.
	DefaultSettleWithin = 5 * time.Minute
	// MaxSettleWithin bounds settle_within: a settlement's record is kept
	// in the store that long.
	MaxSettleWithin = time.Hour
)

// SettleWindow is how long a settlement of the rule may be settled: its
// settle_within, or DefaultSettleWithin.
func (r *Rule) SettleWindow() time.Duration {
	if r.SettleWithin > 0 {
		return time.Duration(r.SettleWithin)
	}
	return DefaultSettleWithin
}

// DefaultLeaseTTL is the lease length of a concurrency rule without lease_ttl.
const DefaultLeaseTTL = 30 * time.Second

// algorithms are the values of algorithm: the rate algorithms and concurrency.
var algorithms = append(bucket.Algorithms[:len(bucket.Algorithms):len(bucket.Algorithms)], bucket.Concurrency)

func algorithmNames() []string {
	names := make([]string, len(algorithms))
	for i, a := range algorithms {
		names[i] = string(a)
	}
	return names
}

// Bucket returns the rule's validated limit.
func (r *Rule) Bucket() bucket.Limit { return r.limit }

// Duration is a time.Duration written as a Go duration string ("90s", "1h").
type Duration time.Duration

// MarshalYAML writes a duration string, omitted when zero.
func (d Duration) MarshalYAML() (any, error) {
	if d == 0 {
		return nil, nil
	}
	return time.Duration(d).String(), nil
}

// UnmarshalYAML parses a duration string.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	var s string
	if err := n.Decode(&s); err != nil {
		return err
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// Set is a validated rule set. It is immutable and safe for concurrent use.
type Set struct {
	rules     []*Rule
	byID      map[string]*Rule
	matchable []*Rule
	version   string
}

// Get returns the rule with id, or nil.
func (s *Set) Get(id string) *Rule { return s.byID[id] }

// Rules returns the rules in file order.
func (s *Set) Rules() []*Rule { return s.rules }

type file struct {
	Rules []Rule `yaml:"rules"`
}

// Load reads and validates a rules file.
func Load(path string) (*Set, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(path, data)
}

// Parse decodes a rules file strictly (unknown keys are errors) and
// validates every rule. Its errors are an *Error naming the file, the rule
// and the field.
func Parse(name string, data []byte) (*Set, error) {
	fileErr := func(field string, line int, err error) error {
		return &Error{File: name, Index: -1, Field: field, Line: line, Err: err}
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fileErr("", 0, errors.New("the file is empty"))
		}
		return nil, fileErr("", 0, err)
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return nil, fileErr("", extra.Line, errors.New("more than one YAML document"))
	}
	top := resolve(&doc)
	if top.Kind == yaml.DocumentNode && len(top.Content) == 1 {
		top = resolve(top.Content[0])
	}
	if err := checkFields(top, reflect.TypeFor[file](), ""); err != nil {
		var e *Error
		if errors.As(err, &e) {
			e.File = name
		}
		return nil, err
	}
	// checkFields found what a strict decode would refuse, and names it;
	// decoding strictly still guards against a gap in checkFields.
	strict := yaml.NewDecoder(bytes.NewReader(data))
	strict.KnownFields(true)
	var f file
	if err := strict.Decode(&f); err != nil {
		return nil, fileErr("", 0, err)
	}
	if len(f.Rules) == 0 {
		return nil, fileErr("rules", fieldLine(top, "rules"), errors.New("no rules"))
	}
	var nodes []*yaml.Node
	if _, v := lookup(top, "rules"); v != nil && resolve(v).Kind == yaml.SequenceNode {
		nodes = resolve(v).Content
	}
	list := make([]*Rule, len(f.Rules))
	lines := make([]int, len(f.Rules)) // of each rule's id
	first := make(map[string]int, len(f.Rules))
	for i := range f.Rules {
		r := &f.Rules[i]
		r.source = SourceFile
		var n *yaml.Node
		if i < len(nodes) {
			n = resolve(nodes[i])
			lines[i] = fieldLine(n, "id")
		}
		if err := r.validate(n); err != nil {
			return nil, at(err, name, i, r.ID, n)
		}
		r.yaml = r.marshal()
		if j, ok := first[r.ID]; ok {
			return nil, &Error{File: name, Index: i, ID: r.ID, Field: "id", Line: lines[i], Err: &DuplicateIDError{ID: r.ID,
				First:  Place{Index: j, Line: lines[j], Source: SourceFile},
				Second: Place{Index: i, Line: lines[i], Source: SourceFile}}}
		}
		first[r.ID] = i
		list[i] = r
	}
	s, err := Build(list)
	if err != nil {
		var e *Error
		if errors.As(err, &e) {
			e.File = name
		}
		return nil, err
	}
	return s, nil
}

// Build makes a set of validated rules; an id used twice is an *Error
// caused by a *DuplicateIDError.
func Build(list []*Rule) (*Set, error) {
	s := &Set{byID: make(map[string]*Rule, len(list))}
	index := make(map[string]int, len(list))
	for i, r := range list {
		if j, ok := index[r.ID]; ok {
			return nil, &Error{Index: i, ID: r.ID, Field: "id", Err: &DuplicateIDError{ID: r.ID,
				First:  Place{Index: j, Source: list[j].source},
				Second: Place{Index: i, Source: r.source}}}
		}
		index[r.ID] = i
		s.byID[r.ID] = r
		s.rules = append(s.rules, r)
		if r.Match != nil {
			s.matchable = append(s.matchable, r)
		}
	}
	s.version = s.digest()
	return s, nil
}

// ParseRule decodes one rule (an entry of "rules:", YAML or JSON) strictly
// and validates it; source says where it came from. Its errors are an
// *Error naming the field, with Index -1.
func ParseRule(data []byte, source string) (*Rule, error) {
	var doc yaml.Node
	if err := yaml.NewDecoder(bytes.NewReader(data)).Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, &Error{Index: -1, Err: errors.New("the rule is empty")}
		}
		return nil, &Error{Index: -1, Err: err}
	}
	n := resolve(&doc)
	if n.Kind == yaml.DocumentNode && len(n.Content) == 1 {
		n = resolve(n.Content[0])
	}
	if err := checkFields(n, reflect.TypeFor[Rule](), ""); err != nil {
		return nil, at(err, "", -1, idOf(n), nil)
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var r Rule
	if err := dec.Decode(&r); err != nil {
		return nil, &Error{Index: -1, ID: idOf(n), Err: err}
	}
	r.source = source
	if err := r.validate(n); err != nil {
		return nil, at(err, "", -1, r.ID, n)
	}
	r.yaml = r.marshal()
	return &r, nil
}

// YAML is the rule in the rules file's format, defaults filled in. The
// caller must not change the bytes.
func (r *Rule) YAML() []byte {
	if r.yaml != nil {
		return r.yaml
	}
	return r.marshal()
}

func (r *Rule) marshal() []byte {
	b, err := yaml.Marshal(r)
	if err != nil {
		panic("rules: a validated rule does not marshal: " + err.Error())
	}
	return b
}

// Version is a digest of the rules: equal sets have equal versions.
func (s *Set) Version() string { return s.version }

func (s *Set) digest() string {
	ids := make([]string, 0, len(s.rules))
	for _, r := range s.rules {
		ids = append(ids, r.ID)
	}
	sort.Strings(ids)
	h := sha256.New()
	for _, id := range ids {
		h.Write(s.byID[id].YAML())
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// MaxIDLen is the longest rule id.
const MaxIDLen = 64

// CheckID reports whether id may be a rule's id, as a rule's validation
// does; the admin API checks the id of a path with it before using it as a
// key. Its error is an *Error naming the id and the field "id".
func CheckID(id string) error {
	if err := checkID(id); err != nil {
		return &Error{Index: -1, ID: id, Field: "id", Err: err}
	}
	return nil
}

func checkID(id string) error {
	if len(id) > MaxIDLen || !idPattern.MatchString(id) {
		return fmt.Errorf("must be 1 to %d letters, digits, '_', '-' and '.', starting with a letter or digit, a '.' only between two others (%s)", MaxIDLen, idPattern)
	}
	return nil
}

// validate checks r and fills in its defaults; n is the rule's YAML, nil
// when unknown.
func (r *Rule) validate(n *yaml.Node) error {
	if err := checkID(r.ID); err != nil {
		return fieldError("id", err)
	}
	if err := choice("algorithm", r.Algorithm, algorithms...); err != nil {
		return err
	}
	if r.Algorithm == "" {
		if n != nil && writtenEmpty(n, "algorithm") {
			return fieldError("algorithm", &ChoiceError{Valid: algorithmNames()})
		}
		r.Algorithm = bucket.TokenBucket
	}
	switch {
	case r.Capacity != nil && r.Limit != nil:
		return fieldError("limit", errors.New("capacity is given too: give one of capacity and limit, not both"))
	case r.Capacity == nil && r.Limit == nil:
		return fieldError("capacity", errors.New("missing (or limit, for a window)"))
	}
	capacity, field := r.Capacity, "capacity"
	if capacity == nil {
		capacity, field = r.Limit, "limit"
	}
	if v := r.MaxOvershoot; v != nil && !(*v > 0 && *v <= 1) {
		return fieldErrorf("max_overshoot", "must be a fraction of the capacity in (0, 1], got %v", *v)
	}
	if err := choice("on_failure", r.OnFailure, FailOpen, FailClosed); err != nil {
		return err
	}
	if r.OnFailure == "" {
		r.OnFailure = FailOpen
	}
	if err := choice("home", r.Home, HomeLocal, HomePinned); err != nil {
		return err
	}
	if r.Home == "" {
		r.Home = HomeLocal
	}
	if len(r.HomeKeys) > 0 && r.Home != HomePinned {
		return fieldError("home_keys", errors.New("only a rule with home: pinned has home keys"))
	}
	for k, reg := range r.HomeKeys {
		if k == "" || len(k) > bucket.MaxKeyLen {
			return fieldErrorf("home_keys", "a key must be 1 to %d bytes", bucket.MaxKeyLen)
		}
		if !regionPattern.MatchString(reg) {
			return fieldErrorf("home_keys", "%q is not a region name", reg)
		}
	}
	if r.MaxWait != 0 {
		if r.Algorithm != bucket.TokenBucket && r.Algorithm != bucket.GCRA {
			return fieldErrorf("max_wait", "only token_bucket and gcra rules pace, not %s", r.Algorithm)
		}
		if r.MaxWait < 0 || time.Duration(r.MaxWait) > bucket.MaxWait {
			return fieldErrorf("max_wait", "must be above 0 and at most %v, got %v", bucket.MaxWait, time.Duration(r.MaxWait))
		}
	}
	if r.SettleWithin != 0 && (r.SettleWithin < 0 || time.Duration(r.SettleWithin) > MaxSettleWithin) {
		return fieldErrorf("settle_within", "must be above 0 and at most %v, got %v", MaxSettleWithin, time.Duration(r.SettleWithin))
	}
	if r.Concurrent() {
		if r.SettleWithin != 0 {
			return fieldErrorf("settle_within", "a concurrency rule spends no estimate to settle")
		}
		if r.AllowRequestLimit || r.RequestLimitMax != 0 {
			return fieldError("allow_request_limit", errors.New("a concurrency rule takes no limit from a request"))
		}
		if err := r.validateConcurrency(*capacity, field); err != nil {
			return err
		}
		if err := r.validateReserve(); err != nil {
			return err
		}
		return r.validateOverrides(n)
	}
	if r.LeaseTTL != 0 {
		return fieldErrorf("lease_ttl", "only a concurrency rule has a lease length, not %s", r.Algorithm)
	}
	if r.Adaptive != nil {
		return fieldErrorf("adaptive", "only a concurrency rule adapts its limit to latencies, not %s", r.Algorithm)
	}
	if r.Lease != 0 {
		if r.Algorithm != bucket.TokenBucket && r.Algorithm != bucket.GCRA {
			return fieldErrorf("lease", "only token_bucket and gcra rules lease tokens, not %s", r.Algorithm)
		}
		if !(r.Lease > 0) || r.Lease > *capacity {
			return fieldErrorf("lease", "must be > 0 and at most the capacity %v, got %v", *capacity, r.Lease)
		}
		if r.Home == HomePinned {
			return fieldError("lease", errors.New("a pinned rule is decided in its home region and cannot lease"))
		}
	}
	if r.Reconcile != nil && *r.Reconcile && r.Home == HomePinned {
		return fieldError("reconcile", errors.New("a pinned rule is decided in one region and has nothing to reconcile"))
	}
	if r.KeyBy == "" {
		r.KeyBy = KeyByAPIKey
	}
	if !validKeyBy(r.KeyBy) {
		return fieldErrorf("key_by", "must be api_key, user, ip, global or attr:NAME, got %q", r.KeyBy)
	}
	if r.Match != nil {
		if err := r.Match.validate(); err != nil {
			return err
		}
	}
	if r.Shadow && r.Lease != 0 {
		return fieldError("shadow", errors.New("a shadow rule rejects nothing and cannot lease"))
	}
	r.limit = bucket.Limit{Algorithm: r.Algorithm, Capacity: *capacity, RefillPerSecond: r.RefillPerSecond, Window: time.Duration(r.Window)}
	if err := r.limit.Validate(); err != nil {
		var le *bucket.LimitError
		if errors.As(err, &le) && le.Field != "capacity" {
			field = le.Field
		}
		return fieldError(field, err)
	}
	if err := r.validateCost(r.limit); err != nil {
		return err
	}
	if err := r.validateRequestLimit(); err != nil {
		return err
	}
	if err := r.validateReserve(); err != nil {
		return err
	}
	return r.validateOverrides(n)
}

// Adaptive is the range and latency goal of an adaptive concurrency rule.
type Adaptive struct {
	// Min and Max bound the limit of each key.
	Min int `yaml:"min"`
	Max int `yaml:"max"`
	// TargetLatency is the latency above which a request says the
	// backend is overloaded: from 1ms to the rule's lease_ttl.
	TargetLatency Duration `yaml:"target_latency"`
}

// validateConcurrency checks the fields of a concurrency rule, whose
// limit (given as limit or capacity, named by field) is already read.
func (r *Rule) validateConcurrency(limit float64, field string) error {
	switch {
	case r.RefillPerSecond != 0:
		return fieldError("refill_per_second", errors.New("not a parameter of a concurrency rule: it counts requests in flight"))
	case r.Window != 0:
		return fieldError("window", errors.New("not a parameter of a concurrency rule: a lease lasts lease_ttl"))
	case r.Lease != 0:
		return fieldError("lease", errors.New("a concurrency rule holds leases of requests, not tokens: its lease length is lease_ttl"))
	case r.Reconcile != nil && *r.Reconcile:
		return fieldError("reconcile", errors.New("leases in flight cannot be reconciled as spends: a concurrency rule is counted in each region, or in its key's home region (home: pinned)"))
	case r.Shadow:
		return fieldError("shadow", errors.New("a concurrency rule cannot be a shadow rule yet"))
	case r.Cost != 0 && r.Cost != 1:
		return fieldErrorf("cost", "a concurrency rule counts each request once: cost must be 1, got %v", r.Cost)
	}
	if r.KeyBy == "" {
		r.KeyBy = KeyByAPIKey
	}
	if !validKeyBy(r.KeyBy) {
		return fieldErrorf("key_by", "must be api_key, user, ip, global or attr:NAME, got %q", r.KeyBy)
	}
	if r.Match != nil {
		if err := r.Match.validate(); err != nil {
			return err
		}
	}
	r.Cost = 1
	if r.LeaseTTL == 0 {
		r.LeaseTTL = Duration(DefaultLeaseTTL)
	}
	if !(limit >= 1 && limit <= bucket.MaxConcurrency) || limit != float64(int(limit)) {
		return fieldErrorf(field, "a concurrency limit must be a whole number from 1 to %d, got %v", bucket.MaxConcurrency, limit)
	}
	r.leases = bucket.LeaseLimit{Limit: int(limit), TTL: time.Duration(r.LeaseTTL)}
	if a := r.Adaptive; a != nil {
		r.leases.Adaptive = bucket.Adaptive{Min: a.Min, Max: a.Max, Target: time.Duration(a.TargetLatency)}
		if a.Max < 1 {
			return fieldErrorf("adaptive.max", "adaptive.max must be a whole number from adaptive.min to %d, got %d", bucket.MaxConcurrency, a.Max)
		}
	}
	if err := r.leases.Validate(); err != nil {
		var le *bucket.LimitError
		switch {
		case errors.As(err, &le) && le.Field == "limit":
			return fieldError(field, err)
		case errors.As(err, &le) && strings.HasPrefix(le.Field, "adaptive."):
			return fieldError(le.Field, err)
		}
		return fieldError("lease_ttl", err)
	}
	// The limit the rest of the pipeline sees: a capacity of limit requests.
	r.limit = bucket.Limit{Algorithm: bucket.Concurrency, Capacity: limit}
	return nil
}

// HomesIn returns a check that a rule's home_keys name only regions of
// topo, for rulesource.Options.ValidateRule; its error is an *Error naming
// the key: home_keys.tenant-a: region "mars" is not in the topology.
func HomesIn(topo *region.Topology) func(*Rule) error {
	return func(r *Rule) error {
		keys := make([]string, 0, len(r.HomeKeys))
		for k := range r.HomeKeys {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			if err := topo.ValidateHomes(map[string]string{k: r.HomeKeys[k]}); err != nil {
				return &Error{Index: -1, ID: r.ID, Field: "home_keys." + k,
					Err: fmt.Errorf("region %q is not in the topology (%s)", r.HomeKeys[k], strings.Join(topo.Names(), ", "))}
			}
		}
		return nil
	}
}
