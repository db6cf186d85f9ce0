// Package tally counts what the engine decided: each rule's decisions by
// where they were decided (this region's store, a home region, a token
// lease, the fallback, the deny cache), paced checks and their waits, the
// keys refused most (topkeys), and the spends reconciled rules admitted,
// for the other regions (SpendRecorder). The engine counts each check and
// each Acquire once it is decided (Tally.Count).
package tally

import (
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/topkeys"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// SpendRecorder collects the tokens admitted for reconciled rules, for the
// other regions (gossip.Accumulator). budget is the rule's spend per key
// past which the key is published at once (rules.Rule.SpendBudget); rate
// the key's refill rate (tokens a second) for a token bucket or GCRA, by
// which its spends are paced, and 0 for the other algorithms and for a
// settlement's change (see gossip.Accumulator.AddPaced).
type SpendRecorder interface {
	AddPaced(rule, key string, cost, budget, rate float64, admittedMicros int64)
}

// SpanRecorder keeps the span context of a sampled check whose spends
// were recorded, for the flush that carries them to the other regions
// (spendpub.Publisher).
type SpanRecorder interface {
	SampledSpend(sc trace.SpanContext)
}

// Tally counts decided checks and Acquires. Metrics, Top and Fleet are
// required; Spends, when nil, records nothing, and Spans, when nil,
// nothing of the sampled checks.
type Tally struct {
	Metrics *metrics.Metrics
	Top     *topkeys.Tracker
	Spends  SpendRecorder
	Spans   SpanRecorder
	// Fleet returns the live number of instances in this region: each
	// holds its share of a key's spend budget.
	Fleet func() int
	// KeyAffinity: each key's checks come to one instance, which holds the
	// key's whole budget (Fleet is not read).
	KeyAffinity bool
}

// Count updates the metrics of c, a check or an Acquire decided (allowed
// or not), and records what it admitted for the other regions: its class
// and result in limiter_priority_decisions_total (reserved when only the
// reserves its class keeps refused it, of a lease or a rate rule), and
// each rate rule's decision. It reports whether it recorded a spend.
func (t *Tally) Count(c *request.Request, allowed bool) (spent bool) {
	result := metrics.PriorityAllowed
	switch {
	case allowed:
	case c.Reserved():
		result = metrics.PriorityReserved
	default:
		result = metrics.PriorityLimited
	}
	t.Metrics.PriorityDecisions.WithLabelValues(c.ClassName(), result).Inc()
	var now int64 // read once, when a spend is recorded or a refusal counted
	// Each of the region's instances holds its own unpublished spends: a
	// key's budget is shared between them, so that the region's together
	// stay within the rule's, unless each key comes to one instance
	// (KeyAffinity). Read with the first spend recorded.
	share := 0.0
	for _, it := range c.Enforce {
		en := it.Entry
		if c.MaxWait > 0 {
			// The series of a rule appear with its first paced check:
			// most rules never pace.
			switch {
			case allowed:
				t.Metrics.Paced.WithLabelValues(it.Rule.ID, metrics.ResultAllowed).Inc()
				t.Metrics.PacedWait.WithLabelValues(it.Rule.ID).Observe(it.Decision.Wait.Seconds())
			case !it.Decision.Allowed && it.Route != request.RouteNone:
				t.Metrics.Paced.WithLabelValues(it.Rule.ID, metrics.ResultLimited).Inc()
			}
		}
		if !allowed {
			if !it.Decision.Allowed && it.Route != request.RouteNone {
				if now == 0 {
					now = time.Now().UnixMicro()
				}
				t.Top.Add(it.Rule.ID, it.Key, 1, now*1000)
			}
			switch {
			case it.Decision.Allowed || it.Route == request.RouteNone:
			case it.Route == request.RouteDeny:
				en.DenyHits.Inc()
				en.Limited.Inc()
			case it.Route == request.RouteHome:
				en.ForwardedLimited.Inc()
			case it.Route == request.RouteFallback:
				en.FallbackLimited.Inc()
			default:
				en.Limited.Inc()
			}
			continue
		}
		en.AdmittedCost.Add(it.Cost)
		spend := it.Cost
		switch it.Route {
		case request.RouteHome:
			en.ForwardedAllowed.Inc()
			continue // the home region reports its own spends
		case request.RouteLease:
			en.Allowed.Inc()
			en.Leased.Inc()
			continue // reported when the batch was taken
		case request.RouteFallback:
			en.FallbackAllowed.Inc()
		case request.RouteUnknown:
			en.Uncertain.Inc()
		default:
			en.Allowed.Inc()
			if it.Batch > 0 {
				spend = it.Batch
			}
		}
		if en.Reconciled && t.Spends != nil {
			if now == 0 {
				now = time.Now().UnixMicro()
			}
			if share == 0 {
				share = 1
				if !t.KeyAffinity {
					share = 1 / float64(max(1, t.Fleet()))
				}
			}
			budget := en.SpendBudget
			if it.Limits != &en.Limits {
				// An override's budget is its own capacity's share.
				budget = it.Rule.Overshoot() * it.Limits.Limit.Capacity
			}
			t.Spends.AddPaced(it.Rule.ID, it.Key, spend, budget*share, pacedRate(it.Limits.Limit), now)
			spent = true
		}
	}
	return spent
}

// Sampled tells Spans of sc, the span context of a check whose spends
// Count recorded, when it is sampled.
func (t *Tally) Sampled(sc trace.SpanContext) {
	if t.Spans != nil && sc.IsSampled() {
		t.Spans.SampledSpend(sc)
	}
}

// Settled records what a settlement changed of a spend of en's key: the
// extra it took (delta > 0), counted as admitted, or the part of the
// estimate it gave back (delta < 0); for a reconciled rule, the other
// regions receive it as a spend (negative for a give-back), so that each
// ends with the settled cost.
func (t *Tally) Settled(en *request.Entry, key string, delta float64) {
	if delta > 0 {
		en.AdmittedCost.Add(delta)
	}
	if delta == 0 || !en.Reconciled || t.Spends == nil {
		return
	}
	share := 1.0
	if !t.KeyAffinity {
		share = 1 / float64(max(1, t.Fleet()))
	}
	t.Spends.AddPaced(en.Rule.ID, key, delta, en.SpendBudget*share, 0, time.Now().UnixMicro())
}

// pacedRate is the rate a spend under l is paced by: its refill rate for a
// token bucket or GCRA, whose debits are applied as of an instant; 0 for
// the windows, whose debits count in the window of the last admission.
func pacedRate(l bucket.Limit) float64 {
	if l.Algorithm == bucket.TokenBucket || l.Algorithm == bucket.GCRA {
		return l.RefillPerSecond
	}
	return 0
}
