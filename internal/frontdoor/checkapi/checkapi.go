// Package checkapi is the limiter.v1.Limiter gRPC service: a front door
// that translates Check requests into engine checks and their decisions
// into responses, and engine errors into gRPC statuses for every front
// door.
package checkapi

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/usage"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// Service is limiter.v1.Limiter over an engine. Safe for concurrent use.
type Service struct {
	limiterv1.UnimplementedLimiterServer
	e *engine.Engine
}

// New returns the service deciding with e.
func New(e *engine.Engine) *Service { return &Service{e: e} }

// Check decides one rule and key, or every rule the attributes match.
func (s *Service) Check(ctx context.Context, req *limiterv1.CheckRequest) (*limiterv1.CheckResponse, error) {
	start := time.Now()
	defer func() { s.e.Observe(time.Since(start).Seconds()) }()
	resp, err := s.Decide(ctx, req)
	if err != nil {
		return nil, Status(err)
	}
	return resp, nil
}

// Decide is Check with the engine's errors as they are, for in-process
// front doors (forward-auth) that translate them themselves.
func (s *Service) Decide(ctx context.Context, req *limiterv1.CheckRequest) (*limiterv1.CheckResponse, error) {
	c := s.e.NewCheck()
	if err := c.SetPriority(req.GetPriority()); err != nil {
		return nil, err
	}
	if a := req.GetAttributes(); a != nil {
		if req.GetRuleId() != "" || req.GetKey() != "" {
			s.e.Invalid("attributes")
			return nil, &request.InvalidError{Field: "attributes", Err: errAttributesAlone}
		}
		if req.GetSettle() {
			s.e.Invalid("settle")
			return nil, &request.InvalidError{Field: "settle", Err: errSettleByRule}
		}
		enforce, shadow, err := c.AddAttributes(Attributes(a), req.GetCost())
		if err != nil {
			return nil, err
		}
		if err := s.pace(c, req.GetMaxWaitMs()); err != nil {
			return nil, err
		}
		allowed, err := s.e.Decide(ctx, c)
		if err != nil {
			return nil, err
		}
		return Response(enforce, shadow, allowed, true), nil
	}
	it, err := c.AddRule(req.GetRuleId(), req.GetKey(), req.GetCost())
	if err != nil {
		return nil, err
	}
	if err := s.pace(c, req.GetMaxWaitMs()); err != nil {
		return nil, err
	}
	if req.GetSettle() {
		if err := c.Settle(); err != nil {
			return nil, err
		}
	}
	allowed, err := s.e.Decide(ctx, c)
	if err != nil {
		return nil, err
	}
	if it.Rule.Shadow {
		// A check of a shadow rule by its id: its verdict, refusing nothing.
		return Response([]*request.Item{it}, nil, true, false), nil
	}
	resp := Response([]*request.Item{it}, nil, allowed, false)
	if allowed && c.MaxWait() > 0 {
		resp.Reservation = s.e.Reservation(it)
	}
	if allowed && req.GetSettle() {
		resp.Settlement = s.e.Settlement(it)
	}
	return resp, nil
}

// pace makes c paced by max_wait_ms (0: not paced).
func (s *Service) pace(c *request.Check, ms int64) error {
	if ms == 0 {
		return nil
	}
	if most := bucket.MaxWait.Milliseconds(); ms < 0 || ms > most {
		s.e.Invalid("max_wait_ms")
		return &request.InvalidError{Field: "max_wait_ms",
			Err: fmt.Errorf("max_wait_ms: %w: must be 0 to %d, got %d", bucket.ErrInvalidWait, most, ms)}
	}
	return c.Pace(time.Duration(ms) * time.Millisecond)
}

// CancelReservation gives back a paced check's slot while nothing was
// reserved after it.
func (s *Service) CancelReservation(ctx context.Context, req *limiterv1.CancelReservationRequest) (*limiterv1.CancelReservationResponse, error) {
	back, err := s.e.CancelReservation(ctx, req.GetReservation())
	if err != nil {
		return nil, Status(err)
	}
	return &limiterv1.CancelReservationResponse{GivenBack: back}, nil
}

// Settle replaces a check's estimate by its actual cost, once.
func (s *Service) Settle(ctx context.Context, req *limiterv1.SettleRequest) (*limiterv1.SettleResponse, error) {
	r, err := s.e.Settle(ctx, req.GetSettlement(), req.GetActualCost())
	if err != nil {
		return nil, Status(err)
	}
	resp := &limiterv1.SettleResponse{Settled: r.Settled, Expired: r.Expired, Replay: r.Replay}
	if st := r.Settlement; st != nil {
		resp.Estimate, resp.ActualCost = st.Estimate, r.Actual
	}
	return resp, nil
}

var (
	errAttributesAlone = errors.New("rule_id, key: must be empty in a check by attributes")
	errSettleByRule    = errors.New("settle: only a check by rule_id settles its cost later")
)

// Attributes converts the API's attributes to the rules' matching input.
func Attributes(a *limiterv1.Attributes) *rules.Attributes {
	return &rules.Attributes{
		APIKey: a.GetApiKey(), User: a.GetUser(), IP: a.GetIp(), Path: a.GetPath(),
		Method: a.GetMethod(), Plan: a.GetPlan(), Domain: a.GetDomain(), Extra: a.GetExtra(),
	}
}

// Response reports a check: the deciding rule (the refusal with the longest
// retry, or the rule with the least left for its limit) and, with statuses,
// every rule's status, shadow rules included.
func Response(enforce, shadow []*request.Item, allowed, statuses bool) *limiterv1.CheckResponse {
	resp := &limiterv1.CheckResponse{Allowed: allowed}
	switch {
	case allowed:
	case request.Reserved(enforce):
		resp.Reason = limiterv1.Reason_RESERVED
	default:
		resp.Reason = limiterv1.Reason_REASON_LIMIT
	}
	if top := request.MostRestrictive(enforce); top != nil {
		d := top.Decision
		resp.Remaining, resp.Limit = d.Remaining, d.Limit
		resp.RetryAfterMs, resp.ResetAfterMs = request.CeilMillis(d.RetryAfter), request.CeilMillis(d.ResetAfter)
		resp.RuleId, resp.WindowMs = top.Rule.ID, top.WindowMillis()
		if allowed {
			resp.WaitMs = request.CeilMillis(d.Wait)
		}
	} else if top := request.MostRestrictive(shadow); top != nil && !statuses {
		resp.RuleId = top.Rule.ID
	}
	if statuses {
		for _, list := range [][]*request.Item{enforce, shadow} {
			for _, it := range list {
				resp.Statuses = append(resp.Statuses, RuleStatus(it))
			}
		}
	}
	return resp
}

// RuleStatus is one item's decision as limiter.v1 reports it.
func RuleStatus(it *request.Item) *limiterv1.RuleStatus {
	d := it.Decision
	return &limiterv1.RuleStatus{
		RuleId: it.Rule.ID, Allowed: d.Allowed, Remaining: d.Remaining, Limit: d.Limit,
		RetryAfterMs: request.CeilMillis(d.RetryAfter), ResetAfterMs: request.CeilMillis(d.ResetAfter),
		WindowMs: it.WindowMillis(), Shadow: it.Rule.Shadow, WaitMs: request.CeilMillis(d.Wait),
	}
}

// Status translates an error of the engine into a gRPC status: NOT_FOUND
// for an unknown rule,
// INVALID_ARGUMENT naming the field, UNAVAILABLE for an undecided
// fail-closed rule, RESOURCE_EXHAUSTED when limiterd is overloaded, and
// the context's status.
func Status(err error) error {
	if st, ok := leaseStatus(err); ok {
		return st
	}
	var inv *request.InvalidError
	switch {
	case errors.Is(err, request.ErrUnknownRule):
		return status.Error(codes.NotFound, err.Error())
	case errors.As(err, &inv):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, engine.ErrUnavailable), errors.Is(err, usage.ErrUnavailable), errors.Is(err, engine.ErrNotSettled):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, engine.ErrOverloaded):
		return status.Error(codes.ResourceExhausted, err.Error())
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err).Err()
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Error(codes.Internal, err.Error())
}
