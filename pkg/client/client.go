// Package client is a Go client of limiterd's check API, and the retry
// helpers (full jitter, a retry budget) that clients of rate-limited APIs
// need so that a crowd told the same Retry-After does not return together.
package client

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// DefaultTimeout is the deadline of a check whose context has none: a check
// is on the request path of every API call, and an answer later than this is
// worth less than the caller's own on-failure policy.
const DefaultTimeout = 50 * time.Millisecond

var (
	// ErrUnreachable wraps the error of a check that limiterd never
	// answered: no connection, or the deadline passed before an answer. The
	// gRPC status stays reachable with status.Code. A check limiterd did
	// answer with UNAVAILABLE (a fail-closed rule it could not decide) does
	// not wrap it: that refusal is the rule's, not the network's.
	ErrUnreachable = errors.New("limiterd unreachable")
	// ErrClosed is the error of a check on a closed or zero Client.
	ErrClosed = errors.New("client closed")
	// ErrLeaseGone is Renew's error when the lease is gone (expired,
	// released or never held): stop the request's work, or acquire again.
	ErrLeaseGone = errors.New("lease gone: expired or released")
)

// Option configures New.
type Option func(*options)

type options struct {
	timeout  time.Duration
	creds    credentials.TransportCredentials
	dialOpts []grpc.DialOption
}

// WithTimeout sets the deadline applied to a check whose context has none
// (default DefaultTimeout). A duration ≤ 0 applies none: the caller's
// context alone bounds the check.
func WithTimeout(d time.Duration) Option {
	return func(o *options) { o.timeout = d }
}

// WithTLS connects over TLS with this configuration (nil: the system's
// roots). Without it the connection is plaintext.
func WithTLS(c *tls.Config) Option {
	return func(o *options) {
		if c == nil {
			c = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		o.creds = credentials.NewTLS(c)
	}
}

// WithDialOptions adds gRPC dial options, applied after the client's own
// (transport credentials), so they may replace them.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dialOpts = append(o.dialOpts, opts...) }
}

// Client checks limits against one limiterd target over one reused gRPC
// connection, made lazily by gRPC and re-established as needed.
//
// A Client is safe for concurrent use; make one per target and share it.
// The zero Client is not connected: its checks return ErrClosed.
type Client struct {
	cc      *grpc.ClientConn
	lc      limiterv1.LimiterClient
	timeout time.Duration
	closed  atomic.Bool
}

// New makes a client of the limiterd at target, a gRPC target such as
// "127.0.0.1:8081" or "dns:///limiterd.example:8081". It does not wait for
// a connection.
func New(target string, opts ...Option) (*Client, error) {
	o := options{timeout: DefaultTimeout, creds: insecure.NewCredentials()}
	for _, opt := range opts {
		opt(&o)
	}
	dial := append([]grpc.DialOption{grpc.WithTransportCredentials(o.creds)}, o.dialOpts...)
	cc, err := grpc.NewClient(target, dial...)
	if err != nil {
		return nil, fmt.Errorf("client %s: %w", target, err)
	}
	return &Client{cc: cc, lc: limiterv1.NewLimiterClient(cc), timeout: o.timeout}, nil
}

// Check spends cost tokens of key under rule (cost 0 means 1). A rejection
// is a response with Allowed false, not an error. Errors are gRPC statuses
// (status.Code: INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE for a fail-closed
// rule), or wrap ErrUnreachable when limiterd gave no answer.
func (c *Client) Check(ctx context.Context, rule, key string, cost float64) (*limiterv1.CheckResponse, error) {
	return c.check(ctx, &limiterv1.CheckRequest{RuleId: rule, Key: key, Cost: cost})
}

// CheckPaced is a paced Check: instead of refusing, limiterd reserves the
// next slot within maxWait (at most 10 s, whole ms) and answers allowed
// with WaitMs, the time to wait before sending, and Reservation, which
// CancelReservation gives back when the call will not be sent. Beyond
// maxWait it refuses, spending nothing, with RetryAfterMs: when the same
// check fits within its wait. Only token bucket and GCRA rules pace (else
// INVALID_ARGUMENT). Pacer wraps it. Errors as for Check.
func (c *Client) CheckPaced(ctx context.Context, rule, key string, cost float64, maxWait time.Duration) (*limiterv1.CheckResponse, error) {
	ms := int64((maxWait + time.Millisecond - 1) / time.Millisecond)
	return c.check(ctx, &limiterv1.CheckRequest{RuleId: rule, Key: key, Cost: cost, MaxWaitMs: ms})
}

// CancelReservation gives back the slot of a paced check whose call will
// not be sent. It comes back (givenBack true: the next caller gets it) only
// while no later reservation or spend is stacked behind it in the bucket;
// otherwise the slot stays unused, which keeps the rate under the limit.
func (c *Client) CancelReservation(ctx context.Context, reservation string) (givenBack bool, err error) {
	resp, err := call(c, ctx, &limiterv1.CancelReservationRequest{Reservation: reservation}, limiterv1.LimiterClient.CancelReservation)
	return resp.GetGivenBack(), err
}

// CheckEstimate is a Check that spends estimate as an estimate, to be
// settled with the actual cost once it is known (Settle): an allowed
// answer carries the Settlement to give Settle, within the rule's
// settle_within. A check no store decided (its fallback did, or its
// outcome is unknown) has none: its estimate stands. Errors as for Check.
func (c *Client) CheckEstimate(ctx context.Context, rule, key string, estimate float64) (*limiterv1.CheckResponse, error) {
	return c.check(ctx, &limiterv1.CheckRequest{RuleId: rule, Key: key, Cost: estimate, Settle: true})
}

// Settle replaces the estimate a CheckEstimate spent by what the request
// actually cost: the difference comes back, or the extra is taken (into
// debt, bounded), in every region that reconciles the rule. A settlement
// settles once: a Settle again answers as the first (Replay) and changes
// nothing, so retrying one that failed is safe. After the rule's
// settle_within it answers Expired: the estimate stands. An empty
// settlement is no error: there is nothing to settle (Settled false).
// Errors: INVALID_ARGUMENT for a malformed or altered settlement or a bad
// actual cost, NOT_FOUND for a rule no longer in force, UNAVAILABLE when
// the store did not answer; else as for Check.
func (c *Client) Settle(ctx context.Context, settlement string, actual float64) (*limiterv1.SettleResponse, error) {
	if settlement == "" {
		return &limiterv1.SettleResponse{}, nil
	}
	return call(c, ctx, &limiterv1.SettleRequest{Settlement: settlement, ActualCost: actual}, limiterv1.LimiterClient.Settle)
}

// Usage tells what a Check of rule and key at cost (0 means 1) would see
// now, spending nothing: the remaining before any spend, the limit, and the
// retry and reset. A concurrency rule answers its leases held (InFlight).
// Errors as for Check.
func (c *Client) Usage(ctx context.Context, rule, key string, cost float64) (*limiterv1.RuleUsage, error) {
	resp, err := call(c, ctx, &limiterv1.GetUsageRequest{RuleId: rule, Key: key, Cost: cost}, limiterv1.LimiterClient.GetUsage)
	if err != nil {
		return nil, err
	}
	if len(resp.GetUsages()) != 1 {
		return nil, fmt.Errorf("usage: %d answers for one rule", len(resp.GetUsages()))
	}
	return resp.GetUsages()[0], nil
}

// UsageAttributes tells what a check of every rule whose match the
// attributes satisfy would see now, one answer per rule, spending nothing.
// Errors as for Check.
func (c *Client) UsageAttributes(ctx context.Context, a *limiterv1.Attributes, cost float64) ([]*limiterv1.RuleUsage, error) {
	resp, err := call(c, ctx, &limiterv1.GetUsageRequest{Attributes: a, Cost: cost}, limiterv1.LimiterClient.GetUsage)
	return resp.GetUsages(), err
}

// CheckAttributes checks every rule whose match the attributes satisfy, all
// or nothing, each rule's cost multiplied by cost (0 means 1). The
// identities in a must come from the authenticated request. Errors are as
// for Check.
func (c *Client) CheckAttributes(ctx context.Context, a *limiterv1.Attributes, cost float64) (*limiterv1.CheckResponse, error) {
	return c.check(ctx, &limiterv1.CheckRequest{Attributes: a, Cost: cost})
}

func (c *Client) check(ctx context.Context, req *limiterv1.CheckRequest) (*limiterv1.CheckResponse, error) {
	req.Priority = PriorityOf(ctx)
	return call(c, ctx, req, limiterv1.LimiterClient.Check)
}

type priorityKey struct{}

// WithPriority returns a copy of ctx whose checks (Check, CheckPaced,
// CheckEstimate, CheckAttributes) and Acquires (Acquire,
// AcquireAttributes) carry the priority class class: one of limiterd's
// --priority.classes (critical, default, sheddable unless configured),
// most important first; "" or another is default. A rule's reserve keeps
// part of its capacity (of its limit, for a concurrency rule) for the
// classes above the request's: a refusal for that alone has Reason
// RESERVED (answer it as 503, not 429).
func WithPriority(ctx context.Context, class string) context.Context {
	return context.WithValue(ctx, priorityKey{}, class)
}

// PriorityOf is the priority class ctx carries (WithPriority), "" for none.
func PriorityOf(ctx context.Context) string {
	class, _ := ctx.Value(priorityKey{}).(string)
	return class
}

// Acquire takes a lease of the concurrency rule rule for key: the response
// says whether it was allowed and holds the lease id to Release when the
// work ends (and to Renew while it runs). A refusal is a response with
// Allowed false, its RetryAfterMs the time until the soonest lease held
// expires, its Reason RESERVED when only the reserve of the classes above
// ctx's (WithPriority) refused it. Errors as for Check.
func (c *Client) Acquire(ctx context.Context, rule, key string) (*limiterv1.AcquireResponse, error) {
	return call(c, ctx, &limiterv1.AcquireRequest{RuleId: rule, Key: key, Priority: PriorityOf(ctx)}, limiterv1.LimiterClient.Acquire)
}

// AcquireAttributes takes a lease of every concurrency rule whose match the
// attributes satisfy and spends every matching rate rule (their costs
// multiplied by cost), all or nothing. Errors as for Check.
func (c *Client) AcquireAttributes(ctx context.Context, a *limiterv1.Attributes, cost float64) (*limiterv1.AcquireResponse, error) {
	return call(c, ctx, &limiterv1.AcquireRequest{Attributes: a, Cost: cost, Priority: PriorityOf(ctx)}, limiterv1.LimiterClient.Acquire)
}

// Release gives a lease back; released is false for a lease that was not
// held (unknown, expired or already released), which is no error. It
// reports nothing of the request: see ReleaseOutcome.
func (c *Client) Release(ctx context.Context, leaseID string) (released bool, err error) {
	resp, err := call(c, ctx, &limiterv1.ReleaseRequest{LeaseId: leaseID}, limiterv1.LimiterClient.Release)
	return resp.GetReleased(), err
}

// Outcome is what a caller reports of a request when it releases its
// lease: how long it took and whether it failed for the backend's sake
// (an error, a timeout, an overload). It moves the limits of adaptive
// concurrency rules.
type Outcome struct {
	// Duration is rounded down to whole milliseconds; at most a day.
	Duration time.Duration
	Failed   bool
}

// ReleaseOutcome gives a lease back as Release does, reporting the
// request's outcome o. A Duration below 0 or above a day is refused
// (codes.InvalidArgument) and releases nothing.
func (c *Client) ReleaseOutcome(ctx context.Context, leaseID string, o Outcome) (released bool, err error) {
	ms := o.Duration.Milliseconds()
	req := &limiterv1.ReleaseRequest{LeaseId: leaseID, DurationMs: &ms, Failed: o.Failed}
	resp, err := call(c, ctx, req, limiterv1.LimiterClient.Release)
	return resp.GetReleased(), err
}

// Renew extends a lease by its rules' lease length; the response says when
// it now expires. A lease already gone is ErrLeaseGone.
func (c *Client) Renew(ctx context.Context, leaseID string) (*limiterv1.RenewResponse, error) {
	resp, err := call(c, ctx, &limiterv1.RenewRequest{LeaseId: leaseID}, limiterv1.LimiterClient.Renew)
	if err == nil && !resp.GetRenewed() {
		return resp, ErrLeaseGone
	}
	return resp, err
}

// call makes one unary call with the client's default deadline, telling an
// unreachable limiterd from an answer.
func call[Req, Resp any](c *Client, ctx context.Context, req Req, f func(limiterv1.LimiterClient, context.Context, Req, ...grpc.CallOption) (Resp, error)) (Resp, error) {
	var zero Resp
	if c.cc == nil || c.closed.Load() {
		return zero, ErrClosed
	}
	if _, ok := ctx.Deadline(); !ok && c.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.timeout)
		defer cancel()
	}
	var header, trailer metadata.MD
	resp, err := f(c.lc, ctx, req, grpc.Header(&header), grpc.Trailer(&trailer))
	if err != nil {
		if c.closed.Load() {
			return zero, ErrClosed
		}
		// A server's answer, even an error status, carries metadata (at
		// least its content-type); a failure to reach it carries none.
		if len(header) == 0 && len(trailer) == 0 {
			return zero, fmt.Errorf("%w: %w", ErrUnreachable, err)
		}
		return zero, err
	}
	return resp, nil
}

// Close closes the connection; checks in flight and later fail with
// ErrClosed.
func (c *Client) Close() error {
	if c.cc == nil || c.closed.Swap(true) {
		return nil
	}
	return c.cc.Close()
}
