package limiterd

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// Decision results, the values of the result label.
const (
	resultAllowed         = "allowed"
	resultLimited         = "limited"
	resultError           = "error"
	resultFallbackAllowed = "fallback_allowed"
	resultFallbackLimited = "fallback_limited"
)

// ruleEntry is a rule with everything the check path needs precomputed.
type ruleEntry struct {
	rule *rules.Rule
	// limit is the rule's limit; local its share for fail-open decisions.
	limit, local bucket.Limit
	// decisions are the rule's counters, by result.
	allowed, limited, failed, fallbackAllowed, fallbackLimited prometheus.Counter
}

// table is an immutable rule set ready for the check path.
type table struct {
	byID map[string]*ruleEntry
}

func newTable(set *rules.Set, fleet int, decisions *prometheus.CounterVec) *table {
	t := &table{byID: make(map[string]*ruleEntry, len(set.Rules()))}
	for _, r := range set.Rules() {
		lim := r.Bucket()
		local := lim
		local.Capacity /= float64(fleet)
		local.RefillPerSecond /= float64(fleet)
		if local.Algorithm == bucket.SlidingLog {
			local.Capacity = max(1, float64(int(local.Capacity)))
		}
		t.byID[r.ID] = &ruleEntry{
			rule: r, limit: lim, local: local,
			allowed:         decisions.WithLabelValues(r.ID, resultAllowed),
			limited:         decisions.WithLabelValues(r.ID, resultLimited),
			failed:          decisions.WithLabelValues(r.ID, resultError),
			fallbackAllowed: decisions.WithLabelValues(r.ID, resultFallbackAllowed),
			fallbackLimited: decisions.WithLabelValues(r.ID, resultFallbackLimited),
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
}

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
	d, err := c.store.Take(ctx, bucket.Request{Rule: ruleID, Key: key, Limit: e.limit, Cost: cost})
	if err == nil {
		if d.Allowed {
			e.allowed.Inc()
		} else {
			e.limited.Inc()
		}
		return d, e, nil
	}
	if ctx.Err() != nil {
		// The caller gave up; nobody waits for a fallback decision.
		e.failed.Inc()
		return bucket.Decision{}, e, status.FromContextError(ctx.Err()).Err()
	}
	if e.rule.OnFailure == rules.FailClosed {
		e.failed.Inc()
		c.log.Warn("store failed, fail-closed rule refused", "rule", ruleID, "err", err)
		return bucket.Decision{}, e, status.Error(codes.Unavailable, errUnavailable.Error())
	}
	local, _ := e.local.NormalizeCost(cost)
	if local == 0 {
		// The cost exceeds this instance's share: refuse locally.
		e.fallbackLimited.Inc()
		return bucket.Decision{Limit: e.limit.Capacity, RetryAfter: time.Second}, e, nil
	}
	d, _ = c.fallback.Take(ctx, bucket.Request{Rule: ruleID, Key: key, Limit: e.local, Cost: local})
	d.Limit = e.limit.Capacity
	if d.Allowed {
		e.fallbackAllowed.Inc()
	} else {
		e.fallbackLimited.Inc()
	}
	return d, e, nil
}

// limiterService is the gRPC limiter.v1.Limiter service.
type limiterService struct {
	limiterv1.UnimplementedLimiterServer
	c *checker
}

func (s *limiterService) Check(ctx context.Context, req *limiterv1.CheckRequest) (*limiterv1.CheckResponse, error) {
	start := time.Now()
	d, _, err := s.c.check(ctx, req.GetRuleId(), req.GetKey(), req.GetCost())
	s.c.m.duration.Observe(time.Since(start).Seconds())
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
	}, nil
}

// ceilMillis rounds up: a rejection never says retry in 0 ms.
func ceilMillis(d time.Duration) int64 {
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

type metrics struct {
	decisions *prometheus.CounterVec
	invalid   *prometheus.CounterVec
	duration  prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_decisions_total",
			Help: "Checks decided, by rule and result.",
		}, []string{"rule", "result"}),
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
	for _, c := range []prometheus.Collector{m.decisions, m.invalid, m.duration} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, f := range []string{"rule_id", "key", "cost"} {
		m.invalid.WithLabelValues(f)
	}
	return m, nil
}
