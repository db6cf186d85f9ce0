package client_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/client"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// fakeLimiter records the deadline each check arrived with and answers
// with err, or allows.
type fakeLimiter struct {
	limiterv1.UnimplementedLimiterServer
	err error

	mu        sync.Mutex
	deadlines []time.Duration // -1: none
	reqs      []*limiterv1.CheckRequest
	releases  []*limiterv1.ReleaseRequest
}

func (f *fakeLimiter) Check(ctx context.Context, req *limiterv1.CheckRequest) (*limiterv1.CheckResponse, error) {
	left := time.Duration(-1)
	if dl, ok := ctx.Deadline(); ok {
		left = time.Until(dl)
	}
	f.mu.Lock()
	f.deadlines = append(f.deadlines, left)
	f.reqs = append(f.reqs, req)
	f.mu.Unlock()
	if f.err != nil {
		return nil, f.err
	}
	return &limiterv1.CheckResponse{Allowed: true, Limit: 10, Remaining: 9}, nil
}

func (f *fakeLimiter) Release(_ context.Context, req *limiterv1.ReleaseRequest) (*limiterv1.ReleaseResponse, error) {
	f.mu.Lock()
	f.releases = append(f.releases, req)
	f.mu.Unlock()
	return &limiterv1.ReleaseResponse{Released: true}, nil
}

// TestReleaseOutcome: Release reports nothing of the request, and
// ReleaseOutcome its duration in ms and whether it failed.
func TestReleaseOutcome(t *testing.T) {
	f := &fakeLimiter{}
	c := newClient(t, serveFake(t, f))
	ctx := context.Background()
	if ok, err := c.Release(ctx, "a"); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if ok, err := c.ReleaseOutcome(ctx, "b", client.Outcome{Duration: 1500 * time.Microsecond, Failed: true}); !ok || err != nil {
		t.Fatal(ok, err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if r := f.releases[0]; r.GetLeaseId() != "a" || r.DurationMs != nil || r.GetFailed() {
		t.Errorf("Release sent %v, want no outcome", r)
	}
	if r := f.releases[1]; r.GetLeaseId() != "b" || r.DurationMs == nil || r.GetDurationMs() != 1 || !r.GetFailed() {
		t.Errorf("ReleaseOutcome sent %v, want duration_ms 1 and failed", r)
	}
}

func (f *fakeLimiter) last() (time.Duration, *limiterv1.CheckRequest) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.deadlines[len(f.deadlines)-1], f.reqs[len(f.reqs)-1]
}

func serveFake(t *testing.T, f limiterv1.LimiterServer) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	limiterv1.RegisterLimiterServer(s, f)
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	return lis.Addr().String()
}

func newClient(t *testing.T, target string, opts ...client.Option) *client.Client {
	t.Helper()
	c, err := client.New(target, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestDefaultDeadline: a check whose context has no deadline gets the
// client's; a caller's own deadline stands.
func TestDefaultDeadline(t *testing.T) {
	f := &fakeLimiter{}
	addr := serveFake(t, f)
	tests := []struct {
		name string
		opts []client.Option
		// ctxTimeout is the caller's deadline; 0: none.
		ctxTimeout time.Duration
		// the deadline the server sees is in (min, max]; max -1: none.
		min, max time.Duration
	}{
		{"default applied", nil, 0, 0, client.DefaultTimeout},
		{"configured default applied", []client.Option{client.WithTimeout(2 * time.Second)}, 0, time.Second, 2 * time.Second},
		{"caller's longer deadline kept", nil, 5 * time.Second, 4 * time.Second, 5 * time.Second},
		{"caller's shorter deadline kept", []client.Option{client.WithTimeout(time.Minute)}, 3 * time.Second, 2 * time.Second, 3 * time.Second},
		{"no default", []client.Option{client.WithTimeout(0)}, 0, -1, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newClient(t, addr, tt.opts...)
			ctx := context.Background()
			if tt.ctxTimeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tt.ctxTimeout)
				defer cancel()
			}
			if _, err := c.Check(ctx, "api", "user:1", 2); err != nil {
				t.Fatal(err)
			}
			got, req := f.last()
			if req.GetRuleId() != "api" || req.GetKey() != "user:1" || req.GetCost() != 2 {
				t.Fatalf("request %v", req)
			}
			if tt.max < 0 {
				if got != -1 {
					t.Fatalf("server saw a deadline %v, want none", got)
				}
				return
			}
			if got <= tt.min || got > tt.max {
				t.Fatalf("server saw a deadline in %v, want in (%v, %v]", got, tt.min, tt.max)
			}
		})
	}
}

// TestErrors: no answer wraps ErrUnreachable; limiterd's own UNAVAILABLE
// (a fail-closed rule) does not; a closed or zero client says ErrClosed.
func TestErrors(t *testing.T) {
	answered := serveFake(t, &fakeLimiter{err: status.Error(codes.Unavailable, "store unavailable and the rule fails closed")})
	invalid := serveFake(t, &fakeLimiter{err: status.Error(codes.InvalidArgument, "key: empty")})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := lis.Addr().String()
	lis.Close()
	// A listener that never answers: the default deadline passes.
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { silent.Close() })

	tests := []struct {
		name        string
		target      string
		code        codes.Code
		unreachable bool
	}{
		{"connection refused", refused, codes.Unavailable, true},
		{"no answer before the deadline", silent.Addr().String(), codes.DeadlineExceeded, true},
		{"fail-closed refusal", answered, codes.Unavailable, false},
		{"invalid argument", invalid, codes.InvalidArgument, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newClient(t, tt.target)
			_, err := c.CheckAttributes(context.Background(), &limiterv1.Attributes{User: "u"}, 0)
			if status.Code(err) != tt.code || errors.Is(err, client.ErrUnreachable) != tt.unreachable {
				t.Fatalf("err = %v (code %v, unreachable %v); want code %v, unreachable %v",
					err, status.Code(err), errors.Is(err, client.ErrUnreachable), tt.code, tt.unreachable)
			}
		})
	}

	c := newClient(t, answered)
	c.Close()
	if _, err := c.Check(context.Background(), "api", "k", 1); !errors.Is(err, client.ErrClosed) {
		t.Fatalf("check after Close: %v, want ErrClosed", err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	var zero client.Client
	if _, err := zero.Check(context.Background(), "api", "k", 1); !errors.Is(err, client.ErrClosed) {
		t.Fatalf("check on the zero Client: %v, want ErrClosed", err)
	}
}

const e2eRules = `rules:
  - id: api
    capacity: 3
    refill_per_second: 0.000001
  - id: per-user
    capacity: 2
    refill_per_second: 0.000001
    key_by: user
    match:
      path: /api/**
`

// TestAgainstLimiterd: one shared Client, concurrent checks by rule and by
// attributes, against a real in-process limiterd on a Redis Cluster.
func TestAgainstLimiterd(t *testing.T) {
	cluster := redistest.NewCluster(t, 3, 0)
	rules := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(rules, []byte(e2eRules), 0o600); err != nil {
		t.Fatal(err)
	}
	o := limiterd.DefaultOptions()
	o.Server.GRPCAddress, o.Server.HTTPAddress, o.Rules.File = "127.0.0.1:0", "127.0.0.1:0", rules
	o.Redis.Addrs, o.RedisTuning.Timeout = cluster.Addrs(), time.Second
	o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	d, err := limiterd.New(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop(context.Background()) })
	// A first check may wait for the connection: a generous default.
	c := newClient(t, d.GRPCAddr(), client.WithTimeout(5*time.Second))
	ctx := context.Background()

	var wg sync.WaitGroup
	var mu sync.Mutex
	allowed := 0
	for range 10 {
		wg.Go(func() {
			resp, err := c.Check(ctx, "api", "user:42", 1)
			if err != nil {
				t.Error(err)
				return
			}
			if resp.GetLimit() != 3 || resp.GetRuleId() != "api" {
				t.Errorf("resp = %v", resp)
			}
			if resp.GetAllowed() {
				mu.Lock()
				allowed++
				mu.Unlock()
			} else if resp.GetRetryAfterMs() <= 0 {
				t.Errorf("rejection without retry_after_ms: %v", resp)
			}
		})
	}
	wg.Wait()
	if allowed != 3 {
		t.Fatalf("%d of 10 concurrent checks allowed, want 3", allowed)
	}

	if _, err := c.Check(ctx, "nope", "k", 1); status.Code(err) != codes.NotFound || errors.Is(err, client.ErrUnreachable) {
		t.Fatalf("unknown rule: %v, want NotFound (answered)", err)
	}

	// The usage of the spent bucket: a check would be refused, and the
	// usage spends nothing, so a fresh key reads full twice.
	if u, err := c.Usage(ctx, "api", "user:42", 0); err != nil || u.GetAllowed() || u.GetRemaining() > 0.01 || u.GetRetryAfterMs() <= 0 || u.GetLimit() != 3 {
		t.Fatalf("usage of a spent bucket: %v, %v", u, err)
	}
	for range 2 {
		if u, err := c.Usage(ctx, "api", "user:43", 0); err != nil || !u.GetAllowed() || u.GetRemaining() != 3 {
			t.Fatalf("usage of a fresh bucket: %v, %v", u, err)
		}
	}
	if _, err := c.Usage(ctx, "api", "", 0); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("usage of an empty key: %v, want InvalidArgument", err)
	}

	a := &limiterv1.Attributes{User: "alice", Path: "/api/orders", Method: "GET", Ip: "192.0.2.7"}
	for i := range 3 {
		resp, err := c.CheckAttributes(ctx, a, 0)
		if err != nil {
			t.Fatal(err)
		}
		if want := i < 2; resp.GetAllowed() != want || resp.GetRuleId() != "per-user" || len(resp.GetStatuses()) != 1 {
			t.Fatalf("attribute check %d: %v, want allowed=%v by per-user", i, resp, want)
		}
	}
	// Another user has their own bucket.
	resp, err := c.CheckAttributes(ctx, &limiterv1.Attributes{User: "bob", Path: "/api/orders"}, 0)
	if err != nil || !resp.GetAllowed() || resp.GetRemaining() != 1 {
		t.Fatalf("bob: %v, %v", resp, err)
	}
	if us, err := c.UsageAttributes(ctx, a, 0); err != nil || len(us) != 1 || us[0].GetRuleId() != "per-user" || us[0].GetAllowed() {
		t.Fatalf("usage by attributes: %v, %v", us, err)
	}
}
