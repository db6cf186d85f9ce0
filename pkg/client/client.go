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

// CheckAttributes checks every rule whose match the attributes satisfy, all
// or nothing, each rule's cost multiplied by cost (0 means 1). The
// identities in a must come from the authenticated request. Errors are as
// for Check.
func (c *Client) CheckAttributes(ctx context.Context, a *limiterv1.Attributes, cost float64) (*limiterv1.CheckResponse, error) {
	return c.check(ctx, &limiterv1.CheckRequest{Attributes: a, Cost: cost})
}

func (c *Client) check(ctx context.Context, req *limiterv1.CheckRequest) (*limiterv1.CheckResponse, error) {
	if c.cc == nil || c.closed.Load() {
		return nil, ErrClosed
	}
	if _, ok := ctx.Deadline(); !ok && c.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.timeout)
		defer cancel()
	}
	var header, trailer metadata.MD
	resp, err := c.lc.Check(ctx, req, grpc.Header(&header), grpc.Trailer(&trailer))
	if err != nil {
		if c.closed.Load() {
			return nil, ErrClosed
		}
		// A server's answer, even an error status, carries metadata (at
		// least its content-type); a failure to reach it carries none.
		if len(header) == 0 && len(trailer) == 0 {
			return nil, fmt.Errorf("%w: %w", ErrUnreachable, err)
		}
		return nil, err
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
