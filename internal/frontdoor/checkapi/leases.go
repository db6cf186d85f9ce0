package checkapi

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/engine/concurrency"
	"github.com/limiterd/limiterd/internal/engine/request"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// Acquire takes the leases of the concurrency rules a request names or
// matches and spends its rate rules, all or nothing, as its priority
// class.
func (s *Service) Acquire(ctx context.Context, req *limiterv1.AcquireRequest) (*limiterv1.AcquireResponse, error) {
	start := time.Now()
	defer func() { s.e.Observe(time.Since(start).Seconds()) }()
	c := s.e.NewAcquire()
	if err := c.SetPriority(req.GetPriority()); err != nil {
		return nil, Status(err)
	}
	statuses := false
	if a := req.GetAttributes(); a != nil {
		if req.GetRuleId() != "" || req.GetKey() != "" {
			s.e.Invalid("attributes")
			return nil, Status(&request.InvalidError{Field: "attributes", Err: errAttributesAlone})
		}
		if _, _, err := c.AddAttributes(Attributes(a), req.GetCost()); err != nil {
			return nil, Status(err)
		}
		statuses = true
	} else if _, err := c.AddRule(req.GetRuleId(), req.GetKey(), req.GetCost()); err != nil {
		return nil, Status(err)
	}
	allowed, l, err := s.e.Acquire(ctx, c)
	if err != nil {
		return nil, Status(err)
	}
	items := append(append([]*request.Item(nil), c.Leases()...), c.Enforced()...)
	check := Response(items, c.Shadows(), allowed, statuses)
	resp := &limiterv1.AcquireResponse{
		Allowed: allowed, RetryAfterMs: check.RetryAfterMs, RuleId: check.RuleId,
		Remaining: check.Remaining, Limit: check.Limit, Statuses: check.Statuses, Reason: check.Reason,
	}
	if l != nil {
		resp.LeaseId, resp.ExpiresAtUnixMs, resp.LeaseTtlMs = l.ID, l.Expires.UnixMilli(), l.TTL.Milliseconds()
	}
	return resp, nil
}

// Release gives a lease back; an unknown or expired one is no error. The
// request's duration and failure, when reported, move adaptive limits.
func (s *Service) Release(ctx context.Context, req *limiterv1.ReleaseRequest) (*limiterv1.ReleaseResponse, error) {
	sample, err := concurrency.Sample(req.DurationMs, req.GetFailed())
	if err != nil {
		return nil, Status(err)
	}
	released, err := s.e.Concurrency().Release(ctx, req.GetLeaseId(), sample)
	if err != nil {
		return nil, Status(err)
	}
	return &limiterv1.ReleaseResponse{Released: released}, nil
}

// Renew extends a lease; renewed false says it is gone.
func (s *Service) Renew(ctx context.Context, req *limiterv1.RenewRequest) (*limiterv1.RenewResponse, error) {
	renewed, l, err := s.e.Concurrency().Renew(ctx, req.GetLeaseId())
	if err != nil {
		return nil, Status(err)
	}
	resp := &limiterv1.RenewResponse{Renewed: renewed}
	if l != nil {
		resp.ExpiresAtUnixMs, resp.LeaseTtlMs = l.Expires.UnixMilli(), l.TTL.Milliseconds()
	}
	return resp, nil
}

// leaseStatus is the status of a lease store, or of a region holding a
// lease, that did not answer: UNAVAILABLE, since the lease may still be
// held (it expires on its own) and a Release again is safe.
func leaseStatus(err error) (error, bool) {
	if errors.Is(err, concurrency.ErrLeaseStore) || errors.Is(err, concurrency.ErrLeaseHome) {
		return status.Error(codes.Unavailable, err.Error()), true
	}
	return nil, false
}
