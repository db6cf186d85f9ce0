package checkapi

import (
	"context"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/usage"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// GetUsage answers what a check would see now, without spending.
func (s *Service) GetUsage(ctx context.Context, req *limiterv1.GetUsageRequest) (*limiterv1.GetUsageResponse, error) {
	resp, err := s.Usage(ctx, req)
	if err != nil {
		return nil, Status(err)
	}
	return resp, nil
}

// Usage is GetUsage with the engine's errors as they are, for in-process
// front doors (the HTTP usage endpoint) that translate them themselves.
func (s *Service) Usage(ctx context.Context, req *limiterv1.GetUsageRequest) (*limiterv1.GetUsageResponse, error) {
	u := s.e.NewUsage()
	if err := u.SetPriority(req.GetPriority()); err != nil {
		return nil, err
	}
	if a := req.GetAttributes(); a != nil {
		if req.GetRuleId() != "" || req.GetKey() != "" {
			s.e.Invalid("attributes")
			return nil, &request.InvalidError{Field: "attributes", Err: errAttributesAlone}
		}
		if err := u.AddAttributes(Attributes(a), req.GetCost()); err != nil {
			return nil, err
		}
	} else if _, err := u.AddRule(req.GetRuleId(), req.GetKey(), req.GetCost()); err != nil {
		return nil, err
	}
	if err := s.e.Usage(ctx, u); err != nil {
		return nil, err
	}
	resp := &limiterv1.GetUsageResponse{Usages: make([]*limiterv1.RuleUsage, len(u.Items()))}
	for i, it := range u.Items() {
		resp.Usages[i] = RuleUsage(it)
	}
	return resp, nil
}

// RuleUsage is one item's usage as limiter.v1 reports it.
func RuleUsage(it *usage.Item) *limiterv1.RuleUsage {
	d, r := it.Usage, it.Rule()
	ru := &limiterv1.RuleUsage{
		RuleId: r.ID, Key: it.Key, Allowed: d.Allowed, Remaining: d.Remaining, Limit: d.Limit,
		RetryAfterMs: request.CeilMillis(d.RetryAfter), ResetAfterMs: request.CeilMillis(d.ResetAfter),
		Shadow: r.Shadow, Concurrency: r.Concurrent(),
	}
	if ru.Concurrency {
		ru.InFlight = int64(it.Held())
	} else {
		ru.WindowMs = request.WindowMillis(it.Entry.Limit)
	}
	return ru
}
