// Package envoyrls is Envoy's rate limit service (envoy.service.ratelimit.v3)
// as a front door of the engine, so that an Envoy gateway's ratelimit
// filter works unchanged.
package envoyrls

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/frontdoor/checkapi"
	"github.com/limiterd/limiterd/internal/rules"
)

// Service is Envoy's rate limit service, envoy.service.ratelimit.v3
// RateLimitService. It decides in-process, with the same engine as
// limiter.v1.Limiter/Check by attributes; it is safe for concurrent use.
//
// The mapping of a RateLimitRequest:
//
//   - domain is Attributes.domain (match.domain of a rule). It must not be
//     empty.
//   - Each descriptor is one set of attributes: every entry is a named
//     attribute (Attributes.extra: key → value, for match.attributes and
//     key_by attr:NAME), and these keys also fill the typed fields:
//     remote_address → ip (so key_by ip counts IPv6 clients by their /64),
//     path or :path → path (without its query), method or :method → method,
//     api_key, user and plan. When two entries fill one field, the later
//     wins. A descriptor needs at least one entry; a key given twice in one
//     descriptor is an error (set descriptor_key on Envoy's actions to tell
//     them apart).
//   - An entry with the key priority is the request's priority class (see
//     limiterd's --priority.classes; none or an unknown one: default), not
//     an attribute: no rule matches or counts by it. Every descriptor that
//     gives one must give the same; over 32 bytes is INVALID_ARGUMENT.
//   - hits_addend is the cost (0 means 1); a descriptor's own hits_addend,
//     when set and not 0, overrides it for that descriptor. Like the cost
//     of a Check, it multiplies each rule's own cost. is_negative_hits is
//     refused.
//   - A descriptor's limit (requests_per_unit per unit, times
//     unit_multiplier when set) replaces the limit of each rule it matches
//     that sets allow_request_limit, for this request (see
//     rules.Rule.RequestLimit), unless its rate is above the rule's
//     request_limit_max or it is no valid limit of the rule. Otherwise it
//     is ignored, and counted in
//     limiter_envoy_request_limits_ignored_total{reason}.
//
// Every rule a descriptor matches is checked against the key its key_by
// picks from that descriptor, and the rules of all descriptors are checked
// together, all or nothing: when one descriptor is over its limit, nothing
// is spent for any. A rule that several descriptors match with the same key
// is checked once, at the largest of their costs. Shadow rules are checked
// for a request that passed, and never refuse.
//
// The response has one status per descriptor, in the request's order: code
// OVER_LIMIT when one of the rules the descriptor matches refused, OK
// otherwise (also when it matches no rule; its status then has no limit);
// current_limit, limit_remaining (rounded down) and duration_until_reset are
// those of its most restrictive rule (the refusal with the longest retry, or
// the rule with the least left for its limit). current_limit is named by the
// rule's id; its unit is the rule's window (see request.WindowMillis) when that is
// a second, a minute, an hour or a day, otherwise the limit over the window
// scaled to a per-second rate, or per minute, hour or day when that rate
// rounds to less than 1. overall_code is OVER_LIMIT when any descriptor is,
// OK otherwise, UNKNOWN for a request without descriptors.
//
// A request refused only for the reserve a rule keeps for more important
// priority classes than its own is OVER_LIMIT too, as Envoy's API has no
// other refusal: Envoy answers it with its filter's rate_limited_status
// (429 by default). Its response_headers_to_add then always hold
// x-ratelimit-reason: reserved and retry-after (whole seconds, rounded up),
// which Envoy adds to its answer; put such rules (a fleet-wide shedder) in
// a filter of their own with rate_limited_status 503 to answer them 503.
//
// response_headers_to_add is empty unless Options.QuotaHeaders is set (as
// Envoy's reference service adds none unless configured): Envoy's filter
// makes X-RateLimit-Limit, X-RateLimit-Remaining and X-RateLimit-Reset
// from the statuses itself with enable_x_ratelimit_headers:
// DRAFT_VERSION_03. With QuotaHeaders they are the quota headers
// pkg/httplimit's SetHeaders writes for the most restrictive rule of all
// descriptors (RateLimit-Limit, RateLimit-Remaining, RateLimit-Reset in
// seconds, X-RateLimit-Limit, X-RateLimit-Remaining, X-RateLimit-Reset as
// a Unix time, Retry-After in whole seconds, rounded up, when over the
// limit; RateLimit-Policy and RateLimit list every enforced rule checked),
// names in lower case, sorted; none when no rule matched.
//
// Errors: INVALID_ARGUMENT for invalid input (the message names the
// descriptor), UNAVAILABLE when a fail-closed rule cannot be decided. Envoy
// then applies its filter's failure_mode_deny to the whole request, as it
// does when limiterd cannot be reached. Where fail-open rules go it must be
// false (Envoy's default) for them to stay open: limiterd decides those
// itself when its store is down. A filter with false lets a fail-closed
// rule's request through too, so the descriptors of fail-closed rules
// belong to a filter of another stage with failure_mode_deny true
// (deploy/envoy/envoy.yaml does so).
type Service struct {
	rlsv3.UnimplementedRateLimitServiceServer
	e    *engine.Engine
	opts Options
	// ignored counts descriptor limits ignored, by reason.
	ignored map[string]prometheus.Counter
	// scratch holds *scratch: the memory one request maps its descriptors
	// with, reused by the next.
	scratch sync.Pool
}

// Options configure a Service. The zero value adds no headers.
type Options struct {
	// QuotaHeaders adds the quota headers to each answer
	// (response_headers_to_add), as Envoy's reference service does with
	// LIMIT_RESPONSE_HEADERS_ENABLED. Envoy's own filter can compute its
	// X-RateLimit-* headers from the statuses instead
	// (enable_x_ratelimit_headers: DRAFT_VERSION_03).
	QuotaHeaders bool
}

// Reasons a descriptor's limit is ignored, the values of the reason label
// of limiter_envoy_request_limits_ignored_total.
const (
	// IgnoredNotAllowed: the rule does not set allow_request_limit.
	IgnoredNotAllowed = "not_allowed"
	// IgnoredAboveMax: the limit's rate is above request_limit_max.
	IgnoredAboveMax = "above_max"
	// IgnoredInvalid: no valid limit of the rule (a unit of 0, a sliding
	// log above 1000, a burst below the rule's or the request's cost).
	IgnoredInvalid = "invalid"
)

// New returns the service deciding with e, registering its metrics on reg.
func New(e *engine.Engine, opts Options, reg prometheus.Registerer) (*Service, error) {
	ignored := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "limiter_envoy_request_limits_ignored_total",
		Help: "Limits sent with Envoy descriptors and ignored, one per rule they would have replaced, by reason (not_allowed: the rule does not set allow_request_limit; above_max: above its request_limit_max; invalid: no valid limit of the rule).",
	}, []string{"reason"})
	if err := reg.Register(ignored); err != nil {
		return nil, err
	}
	s := &Service{e: e, opts: opts, ignored: make(map[string]prometheus.Counter, 3)}
	for _, r := range []string{IgnoredNotAllowed, IgnoredAboveMax, IgnoredInvalid} {
		s.ignored[r] = ignored.WithLabelValues(r)
	}
	return s, nil
}

// Bounds of one request: what one ShouldRateLimit may cost.
const (
	// MaxDescriptors bounds the descriptors of a request.
	MaxDescriptors = 64
	// MaxEntries bounds the entries of one descriptor.
	MaxEntries = 32
	// MaxValueBytes bounds an entry's key and value.
	MaxValueBytes = 1024
)

// Descriptor entry keys that also fill typed attributes.
const (
	envoyKeyRemoteAddress = "remote_address"
	envoyKeyPath          = "path"
	envoyKeyPseudoPath    = ":path"
	envoyKeyMethod        = "method"
	envoyKeyPseudoMethod  = ":method"
	// envoyKeyPriority is the request's priority class, not an attribute.
	envoyKeyPriority = "priority"
)

// ShouldRateLimit decides every descriptor's rules together.
func (s *Service) ShouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	start := time.Now()
	resp, err := s.decide(ctx, req)
	s.e.Observe(time.Since(start).Seconds())
	if err != nil {
		return nil, checkapi.Status(err)
	}
	return resp, nil
}

// scratch is what a request maps its descriptors with: the named
// attributes of the descriptor being mapped (the engine keeps none of
// them), and each descriptor's enforced rules.
type scratch struct {
	extra map[string]string
	sets  [][]*request.Item
}

func (s *Service) getScratch() *scratch {
	if sc, ok := s.scratch.Get().(*scratch); ok {
		return sc
	}
	return &scratch{extra: make(map[string]string, 8)}
}

// putScratch returns sc for the next request, holding nothing of this one.
func (s *Service) putScratch(sc *scratch) {
	clear(sc.extra)
	clear(sc.sets)
	sc.sets = sc.sets[:0]
	s.scratch.Put(sc)
}

func (s *Service) decide(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	if req.GetDomain() == "" {
		s.e.Invalid("attributes")
		return nil, &request.InvalidError{Field: "attributes", Err: errNoDomain}
	}
	descs := req.GetDescriptors()
	if len(descs) == 0 {
		return &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_UNKNOWN}, nil
	}
	if n := len(descs); n > MaxDescriptors {
		s.e.Invalid("attributes")
		return nil, &request.InvalidError{Field: "attributes", Err: fmt.Errorf("descriptors: %d descriptors, the most is %d", n, MaxDescriptors)}
	}
	cost := float64(req.GetHitsAddend())
	if cost == 0 {
		cost = 1
	}
	sc := s.getScratch()
	defer s.putScratch(sc)
	c := s.e.NewCheck()
	a := rules.Attributes{Domain: req.GetDomain(), Extra: sc.extra}
	var priority string
	for i, desc := range descs {
		descCost, err := envoyAttributes(&a, desc, cost, &priority)
		if err != nil {
			s.e.Invalid("attributes")
			return nil, &request.InvalidError{Field: "attributes", Err: fmt.Errorf("descriptors[%d].%w", i, err)}
		}
		set, shadow, err := c.AddAttributes(&a, descCost)
		if err != nil {
			var inv *request.InvalidError
			if errors.As(err, &inv) {
				inv.Err = fmt.Errorf("descriptors[%d]: %w", i, inv.Err)
				return nil, inv
			}
			return nil, err
		}
		if l := desc.GetLimit(); l != nil {
			s.useLimit(c.Table.Regions, l, set)
			s.useLimit(c.Table.Regions, l, shadow)
		}
		sc.sets = append(sc.sets, set)
	}
	if err := c.SetPriority(priority); err != nil {
		return nil, err
	}
	allowed, err := s.e.Decide(ctx, c)
	if err != nil {
		return nil, err
	}
	resp := answer(sc.sets)
	if !allowed {
		resp.OverallCode = rlsv3.RateLimitResponse_OVER_LIMIT
	}
	if s.opts.QuotaHeaders {
		all := c.Enforced()
		resp.ResponseHeadersToAdd = quotaHeaders(all, request.MostRestrictive(all), allowed, time.Now())
	}
	if !allowed && c.Reserved() {
		resp.ResponseHeadersToAdd = reservedHeaders(resp.ResponseHeadersToAdd, request.MostRestrictive(c.Enforced()))
	}
	return resp, nil
}

var errNoDomain = errors.New("domain: must not be empty")

// envoyUnitLengths are the lengths of Envoy's units of a descriptor's
// limit; a month is 30 days, a year 365.
var envoyUnitLengths = map[typev3.RateLimitUnit]time.Duration{
	typev3.RateLimitUnit_SECOND: time.Second,
	typev3.RateLimitUnit_MINUTE: time.Minute,
	typev3.RateLimitUnit_HOUR:   time.Hour,
	typev3.RateLimitUnit_DAY:    24 * time.Hour,
	typev3.RateLimitUnit_MONTH:  30 * 24 * time.Hour,
	typev3.RateLimitUnit_YEAR:   365 * 24 * time.Hour,
}

// useLimit decides each of items, the rules one descriptor matched,
// against the descriptor's limit l where its rule allows it; the others
// keep their own, and l is counted as ignored for them.
func (s *Service) useLimit(regions int, l *ratelimitv3.RateLimitDescriptor_RateLimitOverride, items []*request.Item) {
	unit := envoyUnitLengths[l.GetUnit()]
	if m := l.GetUnitMultiplier(); m != nil && m.GetValue() > 0 {
		unit *= time.Duration(m.GetValue())
	}
	for _, it := range items {
		lim, err := it.Rule.RequestLimit(float64(l.GetRequestsPerUnit()), unit)
		switch {
		case errors.Is(err, rules.ErrRequestLimitNotAllowed):
			s.ignored[IgnoredNotAllowed].Inc()
		case errors.Is(err, rules.ErrRequestLimitAboveMax):
			s.ignored[IgnoredAboveMax].Inc()
		case err != nil || !it.UseLimit(lim, regions):
			s.ignored[IgnoredInvalid].Inc()
		}
	}
}

// envoyAttributes maps one descriptor onto a, keeping its domain and
// reusing its Extra map (emptied first), and returns its cost. Its
// priority entry, if any, goes to priority, which must be empty or the
// same.
func envoyAttributes(a *rules.Attributes, desc *ratelimitv3.RateLimitDescriptor, cost float64, priority *string) (float64, error) {
	*a = rules.Attributes{Domain: a.Domain, Extra: a.Extra}
	clear(a.Extra)
	if desc.GetIsNegativeHits() {
		return 0, errors.New("is_negative_hits: not supported: limiterd gives no tokens back on request")
	}
	if h := desc.GetHitsAddend(); h != nil && h.GetValue() != 0 {
		cost = float64(h.GetValue())
	}
	entries := desc.GetEntries()
	if len(entries) == 0 {
		return 0, errors.New("entries: a descriptor needs at least one entry")
	}
	if len(entries) > MaxEntries {
		return 0, fmt.Errorf("entries: %d entries, the most is %d", len(entries), MaxEntries)
	}
	attrs := 0 // the entries that are attributes
	for j, e := range entries {
		k, v := e.GetKey(), e.GetValue()
		if k == "" {
			return 0, fmt.Errorf("entries[%d].key: empty", j)
		}
		if len(k) > MaxValueBytes || len(v) > MaxValueBytes {
			return 0, fmt.Errorf("entries[%d]: key or value over %d bytes", j, MaxValueBytes)
		}
		if k == envoyKeyPriority {
			if *priority != "" && *priority != v {
				return 0, fmt.Errorf("entries[%d]: priority %s, where another entry says %s: a request has one class", j, request.Quote(v), request.Quote(*priority))
			}
			*priority = v
			continue
		}
		// One hash per entry: a key given before does not grow the map.
		if a.Extra[k] = v; len(a.Extra) == attrs {
			return 0, fmt.Errorf("entries[%d].key: %q given twice in one descriptor (set descriptor_key on Envoy's actions)", j, k)
		}
		attrs++
		switch k {
		case envoyKeyRemoteAddress:
			a.IP = v
		case envoyKeyPath, envoyKeyPseudoPath:
			a.Path, _, _ = strings.Cut(v, "?")
		case envoyKeyMethod, envoyKeyPseudoMethod:
			a.Method = v
		case rules.KeyByAPIKey:
			a.APIKey = v
		case rules.KeyByUser:
			a.User = v
		case "plan":
			a.Plan = v
		}
	}
	return cost, nil
}

// statusMem is the memory of one descriptor's status, allocated together
// for all of a request's.
type statusMem struct {
	st    rlsv3.RateLimitResponse_DescriptorStatus
	limit rlsv3.RateLimitResponse_RateLimit
	reset durationpb.Duration
}

// answer is the response with one status per descriptor, each by its most
// restrictive rule, overall code OK; its statuses take three allocations
// whatever their number.
func answer(sets [][]*request.Item) *rlsv3.RateLimitResponse {
	mem := make([]statusMem, len(sets))
	resp := &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OK, Statuses: make([]*rlsv3.RateLimitResponse_DescriptorStatus, len(sets))}
	for i, set := range sets {
		m := &mem[i]
		resp.Statuses[i] = &m.st
		m.st.Code = rlsv3.RateLimitResponse_OK
		top := request.MostRestrictive(set)
		if top == nil {
			continue
		}
		d := top.Decision
		if !d.Allowed {
			m.st.Code = rlsv3.RateLimitResponse_OVER_LIMIT
		}
		m.limit.Name = top.Rule.ID
		m.limit.RequestsPerUnit, m.limit.Unit = envoyLimit(d.Limit, top.WindowMillis())
		m.st.CurrentLimit = &m.limit
		m.st.LimitRemaining = clampUint32(math.Floor(d.Remaining))
		// As durationpb.New.
		reset := time.Duration(request.CeilMillis(d.ResetAfter)) * time.Millisecond
		m.reset.Seconds, m.reset.Nanos = int64(reset/time.Second), int32(reset%time.Second)
		m.st.DurationUntilReset = &m.reset
	}
	return resp
}

// envoyUnits are Envoy's units of a limit, shortest first.
var envoyUnits = []struct {
	unit   rlsv3.RateLimitResponse_RateLimit_Unit
	length time.Duration
}{
	{rlsv3.RateLimitResponse_RateLimit_SECOND, time.Second},
	{rlsv3.RateLimitResponse_RateLimit_MINUTE, time.Minute},
	{rlsv3.RateLimitResponse_RateLimit_HOUR, time.Hour},
	{rlsv3.RateLimitResponse_RateLimit_DAY, 24 * time.Hour},
}

// envoyLimit expresses limit per windowMs in Envoy's units: exactly when
// the window is one unit, otherwise scaled to the shortest unit in which
// it is at least 1 request (a day at most). Envoy's quota headers ignore
// unit_multiplier, so it is not used.
func envoyLimit(limit float64, windowMs int64) (uint32, rlsv3.RateLimitResponse_RateLimit_Unit) {
	window := time.Duration(windowMs) * time.Millisecond
	for _, u := range envoyUnits {
		if window == u.length {
			return clampUint32(math.Floor(limit)), u.unit
		}
	}
	var perUnit float64
	unit := rlsv3.RateLimitResponse_RateLimit_DAY
	for _, u := range envoyUnits {
		if perUnit = limit * float64(u.length) / float64(max(window, time.Millisecond)); math.Round(perUnit) >= 1 {
			unit = u.unit
			break
		}
	}
	return clampUint32(max(1, math.Round(perUnit))), unit
}

func clampUint32(f float64) uint32 {
	switch {
	case !(f > 0):
		return 0
	case f >= math.MaxUint32:
		return math.MaxUint32
	}
	return uint32(f)
}
