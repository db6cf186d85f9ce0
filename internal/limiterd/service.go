package limiterd

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/gossip"
	"github.com/limiterd/limiterd/pkg/region"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// Decision results, the values of the result label.
const (
	resultAllowed         = "allowed"
	resultLimited         = "limited"
	resultError           = "error"
	resultFallbackAllowed = "fallback_allowed"
	resultFallbackLimited = "fallback_limited"
	resultShadowAllowed   = "shadow_allowed"
	resultShadowLimited   = "shadow_limited"
)

// ruleEntry is a rule with everything the check path needs precomputed.
type ruleEntry struct {
	rule *rules.Rule
	// limit is the rule's limit; local its share for fail-open decisions
	// of one instance; regional a region's share of a pinned rule when the
	// key's home region cannot answer.
	limit, local, regional bucket.Limit
	reconciled             bool
	// decisions are the rule's counters, by result.
	allowed, limited, failed, fallbackAllowed, fallbackLimited prometheus.Counter
	// admittedCost sums the tokens admitted here, for global dashboards.
	admittedCost prometheus.Counter
	// denyHits count checks rejected by the deny cache.
	denyHits prometheus.Counter
	// leased counts checks admitted from this instance's lease.
	leased prometheus.Counter
	// shadow count a shadow rule's verdicts.
	shadowAllowed, shadowLimited prometheus.Counter
	// forwarded count checks answered by a key's home region.
	forwardedAllowed, forwardedLimited, forwardedFailed prometheus.Counter
}

func share(l bucket.Limit, n int) bucket.Limit {
	l.Capacity /= float64(n)
	l.RefillPerSecond /= float64(n)
	if l.Algorithm == bucket.SlidingLog {
		l.Capacity = max(1, float64(int(l.Capacity)))
	}
	return l
}

// table is an immutable rule set ready for the check path.
type table struct {
	set  *rules.Set
	byID map[string]*ruleEntry
}

func newTable(set *rules.Set, fleet, regions int, m *metrics) *table {
	decisions, forwarded := m.decisions, m.forwarded
	t := &table{set: set, byID: make(map[string]*ruleEntry, len(set.Rules()))}
	for _, r := range set.Rules() {
		lim := r.Bucket()
		m.ruleLimit.WithLabelValues(r.ID).Set(lim.Capacity)
		m.ruleRate.WithLabelValues(r.ID).Set(sustainedRate(lim))
		t.byID[r.ID] = &ruleEntry{
			rule: r, limit: lim, local: share(lim, fleet), regional: share(lim, regions),
			admittedCost:     m.admittedCost.WithLabelValues(r.ID),
			denyHits:         m.denyHits.WithLabelValues(r.ID),
			leased:           m.leased.WithLabelValues(r.ID),
			shadowAllowed:    decisions.WithLabelValues(r.ID, resultShadowAllowed),
			shadowLimited:    decisions.WithLabelValues(r.ID, resultShadowLimited),
			reconciled:       r.Reconciled(),
			forwardedAllowed: forwarded.WithLabelValues(r.ID, resultAllowed),
			forwardedLimited: forwarded.WithLabelValues(r.ID, resultLimited),
			forwardedFailed:  forwarded.WithLabelValues(r.ID, resultError),
			allowed:          decisions.WithLabelValues(r.ID, resultAllowed),
			limited:          decisions.WithLabelValues(r.ID, resultLimited),
			failed:           decisions.WithLabelValues(r.ID, resultError),
			fallbackAllowed:  decisions.WithLabelValues(r.ID, resultFallbackAllowed),
			fallbackLimited:  decisions.WithLabelValues(r.ID, resultFallbackLimited),
		}
	}
	return t
}

// checker decides checks: the gRPC service's core.
type checker struct {
	store    bucket.Store
	fallback *bucket.Memory
	rules    atomic.Pointer[table]
	log      *slog.Logger
	m        *metrics
	// spends accumulates what reconciled rules admit; nil without NATS.
	spends *gossip.Accumulator
	// deny remembers rejections until their retry time; nil: disabled.
	deny *denyCache
	// leases hold tokens taken in batches for rules with a lease size.
	leases *leases
	// region is this region; topo, when set, the regions whose limiterd
	// decides the keys of pinned rules homed there, reached through homes.
	region         string
	topo           *region.Topology
	homes          map[string]limiterv1.LimiterClient
	forwardTimeout time.Duration
}

// forwardedHeader marks a check forwarded by another region: it is decided
// where it lands, never forwarded again.
const forwardedHeader = "x-limiter-forwarded-from"

// errUnavailable is a check a fail-closed rule could not decide.
var errUnavailable = errors.New("store unavailable and the rule fails closed")

// check validates a request and decides it. Errors are gRPC statuses.
func (c *checker) check(ctx context.Context, ruleID, key string, cost float64) (bucket.Decision, *ruleEntry, error) {
	e := c.rules.Load().byID[ruleID]
	if e == nil {
		c.m.invalid.WithLabelValues("rule_id").Inc()
		return bucket.Decision{}, nil, status.Errorf(codes.NotFound, "rule_id: unknown rule %q", ruleID)
	}
	if err := bucket.ValidateKey(key); err != nil {
		c.m.invalid.WithLabelValues("key").Inc()
		return bucket.Decision{}, e, status.Errorf(codes.InvalidArgument, "key: %v", err)
	}
	cost, err := e.limit.NormalizeCost(cost)
	if err != nil {
		c.m.invalid.WithLabelValues("cost").Inc()
		return bucket.Decision{}, e, status.Errorf(codes.InvalidArgument, "cost: %v", err)
	}
	probe := false
	if c.deny != nil {
		var retry, reset time.Duration
		var hit bool
		if retry, reset, hit, probe = c.deny.get(ruleID, key, cost); hit {
			e.denyHits.Inc()
			e.limited.Inc()
			return bucket.Decision{Limit: e.limit.Capacity, RetryAfter: retry, ResetAfter: reset}, e, nil
		}
	}
	d, remembered, err := c.decide(ctx, e, key, cost)
	if probe && !remembered {
		// The probe's answer leaves the key free to ask the store again.
		c.deny.forget(ruleID, key)
	}
	return d, e, err
}

// decide asks the key's home region or the store, and remembers denials;
// remembered reports whether it put one in the deny cache.
func (c *checker) decide(ctx context.Context, e *ruleEntry, key string, cost float64) (d bucket.Decision, remembered bool, err error) {
	ruleID := e.rule.ID
	var sent int64
	if c.deny != nil {
		sent = c.deny.now()
	}
	if e.rule.Pinned() && c.topo != nil && !forwarded(ctx) {
		if home := c.topo.Home(key, e.rule.HomeKeys); home != c.region {
			d, err := c.forward(ctx, e, home, key, cost)
			if err == nil && !d.Allowed && c.deny != nil {
				c.deny.put(ruleID, key, cost, sent, d.RetryAfter, d.ResetAfter)
				remembered = true
			}
			return d, remembered, err
		}
	}
	if e.rule.Lease > 0 && c.leases != nil {
		return c.leased(ctx, e, key, cost, sent)
	}
	d, remembered, err = c.single(ctx, e, key, cost, sent)
	if err != nil {
		d, err = c.storeFailed(ctx, e, key, cost, err)
	}
	return d, remembered, err
}

// single asks the store for one check and remembers a denial; a store
// error is returned as is, for the caller's on_failure.
func (c *checker) single(ctx context.Context, e *ruleEntry, key string, cost float64, sent int64) (d bucket.Decision, remembered bool, err error) {
	ruleID := e.rule.ID
	d, err = c.store.Take(ctx, bucket.Request{Rule: ruleID, Key: key, Limit: e.limit, Cost: cost})
	if err == nil {
		if d.Allowed {
			e.allowed.Inc()
			c.record(e, key, cost)
			if c.deny != nil {
				// When the answer shows the next check of this cost must
				// fail, remember it now rather than ask again.
				if retry, ok := nextDenial(e.limit, d, cost); ok {
					c.deny.put(ruleID, key, cost, sent, retry, d.ResetAfter)
					remembered = true
				}
			}
		} else {
			e.limited.Inc()
			if c.deny != nil {
				c.deny.put(ruleID, key, cost, sent, d.RetryAfter, d.ResetAfter)
				remembered = true
			}
		}
		return d, remembered, nil
	}
	return d, false, err
}

// sustainedRate is a limit's long-run tokens per second.
func sustainedRate(l bucket.Limit) float64 {
	if l.Algorithm == bucket.TokenBucket || l.Algorithm == bucket.GCRA {
		return l.RefillPerSecond
	}
	return l.Capacity / l.Window.Seconds()
}

// record counts an admitted cost, and adds it to the spends reported to
// the other regions.
func (c *checker) record(e *ruleEntry, key string, cost float64) {
	e.admittedCost.Add(cost)
	if e.reconciled && c.spends != nil {
		c.spends.Add(e.rule.ID, key, cost, time.Now().UnixMicro())
	}
}

func forwarded(ctx context.Context) bool {
	md, ok := metadata.FromIncomingContext(ctx)
	return ok && len(md.Get(forwardedHeader)) > 0
}

// forward asks the key's home region to decide. When it cannot answer, the
// rule's on_failure decides: closed refuses, open decides in this region's
// store with this region's share of the limit.
func (c *checker) forward(ctx context.Context, e *ruleEntry, home, key string, cost float64) (bucket.Decision, error) {
	client := c.homes[home]
	fctx, cancel := context.WithTimeout(ctx, c.forwardTimeout)
	defer cancel()
	fctx = metadata.AppendToOutgoingContext(fctx, forwardedHeader, c.region)
	resp, err := client.Check(fctx, &limiterv1.CheckRequest{RuleId: e.rule.ID, Key: key, Cost: cost})
	if err == nil {
		if resp.GetAllowed() {
			e.forwardedAllowed.Inc()
		} else {
			e.forwardedLimited.Inc()
		}
		return bucket.Decision{
			Allowed: resp.GetAllowed(), Remaining: resp.GetRemaining(), Limit: resp.GetLimit(),
			RetryAfter: time.Duration(resp.GetRetryAfterMs()) * time.Millisecond,
			ResetAfter: time.Duration(resp.GetResetAfterMs()) * time.Millisecond,
		}, nil
	}
	e.forwardedFailed.Inc()
	if code := status.Code(err); code == codes.InvalidArgument || code == codes.NotFound {
		// The home region's rules differ from ours: its answer stands.
		return bucket.Decision{}, err
	}
	if ctx.Err() != nil {
		return bucket.Decision{}, status.FromContextError(ctx.Err()).Err()
	}
	if e.rule.OnFailure == rules.FailClosed {
		e.failed.Inc()
		c.log.Warn("home region unreachable, fail-closed rule refused", "rule", e.rule.ID, "home", home, "err", err)
		return bucket.Decision{}, status.Errorf(codes.Unavailable, "home region %s unreachable and the rule fails closed", home)
	}
	regional, nerr := e.regional.NormalizeCost(cost)
	if nerr != nil {
		e.fallbackLimited.Inc()
		return bucket.Decision{Limit: e.limit.Capacity, RetryAfter: time.Second}, nil
	}
	d, err := c.store.Take(ctx, bucket.Request{Rule: e.rule.ID, Key: key, Limit: e.regional, Cost: regional})
	if err != nil {
		d, _ = c.fallback.Take(ctx, bucket.Request{Rule: e.rule.ID, Key: key, Limit: e.regional, Cost: regional})
	}
	d.Limit = e.limit.Capacity
	if d.Allowed {
		e.admittedCost.Add(cost)
		e.fallbackAllowed.Inc()
	} else {
		e.fallbackLimited.Inc()
	}
	return d, nil
}

// leased admits from this instance's lease of (rule, key), taking the next
// batch from the shared bucket in one call when the lease runs out. The
// checks that arrive meanwhile wait for that call rather than make their
// own; when less than a batch is left, the same check asks for its own cost
// and, if refused, leaves the denial in the deny cache for the waiters.
func (c *checker) leased(ctx context.Context, e *ruleEntry, key string, cost float64, sent int64) (bucket.Decision, bool, error) {
	ruleID := e.rule.ID
	for {
		left, ok, wait, fetch := c.leases.take(ruleID, key, cost)
		switch {
		case ok:
			e.allowed.Inc()
			e.leased.Inc()
			e.admittedCost.Add(cost)
			return bucket.Decision{Allowed: true, Remaining: left, Limit: e.limit.Capacity}, false, nil
		case wait != nil:
			select {
			case <-wait:
			case <-ctx.Done():
				return bucket.Decision{}, false, status.FromContextError(ctx.Err()).Err()
			}
			if c.deny != nil {
				if retry, reset, hit, _ := c.deny.get(ruleID, key, cost); hit {
					e.denyHits.Inc()
					e.limited.Inc()
					return bucket.Decision{Limit: e.limit.Capacity, RetryAfter: retry, ResetAfter: reset}, false, nil
				}
			}
			continue
		case !fetch:
			continue
		}
		batch := max(e.rule.Lease, cost)
		d, err := c.store.Take(ctx, bucket.Request{Rule: ruleID, Key: key, Limit: e.limit, Cost: batch})
		if err == nil && d.Allowed {
			e.allowed.Inc()
			e.admittedCost.Add(cost)
			if e.reconciled && c.spends != nil {
				c.spends.Add(ruleID, key, batch, time.Now().UnixMicro())
			}
			c.leases.fetched(ruleID, key, batch-cost)
			d.Remaining += batch - cost
			return d, false, nil
		}
		remembered := false
		if err == nil && batch > cost {
			// Less than a batch is left: this check's own cost, alone.
			d, remembered, err = c.single(ctx, e, key, cost, sent)
		} else if err == nil {
			e.limited.Inc()
			if c.deny != nil {
				c.deny.put(ruleID, key, cost, sent, d.RetryAfter, d.ResetAfter)
				remembered = true
			}
		}
		c.leases.fetched(ruleID, key, 0)
		if err != nil {
			d, err = c.storeFailed(ctx, e, key, cost, err)
		}
		return d, remembered, err
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

// storeFailed decides a check the store could not: the rule's on_failure.
func (c *checker) storeFailed(ctx context.Context, e *ruleEntry, key string, cost float64, err error) (bucket.Decision, error) {
	ruleID := e.rule.ID
	if ctx.Err() != nil {
		// The caller gave up; nobody waits for a fallback decision.
		e.failed.Inc()
		return bucket.Decision{}, status.FromContextError(ctx.Err()).Err()
	}
	if e.rule.OnFailure == rules.FailClosed {
		e.failed.Inc()
		c.log.Warn("store failed, fail-closed rule refused", "rule", ruleID, "err", err)
		return bucket.Decision{}, status.Error(codes.Unavailable, errUnavailable.Error())
	}
	local, _ := e.local.NormalizeCost(cost)
	if local == 0 {
		// The cost exceeds this instance's share: refuse locally.
		e.fallbackLimited.Inc()
		return bucket.Decision{Limit: e.limit.Capacity, RetryAfter: time.Second}, nil
	}
	d, _ := c.fallback.Take(ctx, bucket.Request{Rule: ruleID, Key: key, Limit: e.local, Cost: local})
	d.Limit = e.limit.Capacity
	if d.Allowed {
		e.fallbackAllowed.Inc()
		c.record(e, key, cost)
	} else {
		e.fallbackLimited.Inc()
	}
	return d, nil
}

// limiterService is the gRPC limiter.v1.Limiter service.
type limiterService struct {
	limiterv1.UnimplementedLimiterServer
	c *checker
}

func (s *limiterService) Check(ctx context.Context, req *limiterv1.CheckRequest) (*limiterv1.CheckResponse, error) {
	start := time.Now()
	defer func() { s.c.m.duration.Observe(time.Since(start).Seconds()) }()
	if req.GetAttributes() != nil {
		if req.GetRuleId() != "" || req.GetKey() != "" {
			return nil, status.Error(codes.InvalidArgument, "rule_id, key: must be empty in a check by attributes")
		}
		return s.c.checkAttributes(ctx, req.GetAttributes(), req.GetCost())
	}
	d, e, err := s.c.check(ctx, req.GetRuleId(), req.GetKey(), req.GetCost())
	if err != nil {
		return nil, err
	}
	return &limiterv1.CheckResponse{
		Allowed:      d.Allowed,
		Remaining:    d.Remaining,
		Limit:        d.Limit,
		RetryAfterMs: ceilMillis(d.RetryAfter),
		ResetAfterMs: ceilMillis(d.ResetAfter),
		RuleId:       req.GetRuleId(),
		WindowMs:     windowMillis(e.limit),
	}, nil
}

// ceilMillis rounds up: a rejection never says retry in 0 ms.
func ceilMillis(d time.Duration) int64 {
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

type metrics struct {
	decisions    *prometheus.CounterVec
	forwarded    *prometheus.CounterVec
	admittedCost *prometheus.CounterVec
	denyHits     *prometheus.CounterVec
	leased       *prometheus.CounterVec
	ruleLimit    *prometheus.GaugeVec
	ruleRate     *prometheus.GaugeVec
	invalid      *prometheus.CounterVec
	duration     prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_decisions_total",
			Help: "Checks decided, by rule and result.",
		}, []string{"rule", "result"}),
		forwarded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_forwarded_checks_total",
			Help: "Checks of pinned rules forwarded to the key's home region, by rule and result (error: no answer).",
		}, []string{"rule", "result"}),
		admittedCost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_admitted_cost_total",
			Help: "Tokens admitted by this instance, by rule; summed over every instance of every region it is the global admission.",
		}, []string{"rule"}),
		denyHits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_deny_cache_hits_total",
			Help: "Checks rejected from the deny cache, without a store call, by rule.",
		}, []string{"rule"}),
		leased: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_leased_checks_total",
			Help: "Checks admitted from this instance's leased tokens, without a store call, by rule.",
		}, []string{"rule"}),
		ruleLimit: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_rule_capacity",
			Help: "A rule's capacity: the burst of a bucket, the limit of a window.",
		}, []string{"rule"}),
		ruleRate: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_rule_sustained_rate",
			Help: "A rule's long-run tokens per second: its refill rate, or its limit over its window.",
		}, []string{"rule"}),
		invalid: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_invalid_requests_total",
			Help: "Checks refused as invalid, by the field at fault.",
		}, []string{"field"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "limiter_check_duration_seconds",
			Help:    "Time to decide one check inside limiterd.",
			Buckets: []float64{.00005, .0001, .00025, .0005, .001, .002, .005, .01, .025, .1},
		}),
	}
	for _, c := range []prometheus.Collector{m.decisions, m.forwarded, m.admittedCost, m.denyHits, m.leased, m.ruleLimit, m.ruleRate, m.invalid, m.duration} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, f := range []string{"rule_id", "key", "cost", "attributes"} {
		m.invalid.WithLabelValues(f)
	}
	return m, nil
}
