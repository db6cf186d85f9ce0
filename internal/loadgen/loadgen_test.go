package loadgen

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// fakeLimiter is a target for the load tool's own tests, not a rate
// limiter: it allows the first allow checks of each key under rule "api",
// forever, and answers NOT_FOUND for any other rule.
type fakeLimiter struct {
	limiterv1.UnimplementedLimiterServer
	allow int
	delay time.Duration

	mu    sync.Mutex
	calls int64
	spent map[string]int
}

func (f *fakeLimiter) Check(ctx context.Context, req *limiterv1.CheckRequest) (*limiterv1.CheckResponse, error) {
	if f.delay > 0 {
		select {
		case <-time.After(f.delay):
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if req.GetRuleId() != "api" {
		return nil, status.Errorf(codes.NotFound, "unknown rule %q", req.GetRuleId())
	}
	allowed := f.spent[req.GetKey()] < f.allow
	if allowed {
		f.spent[req.GetKey()]++
	}
	return &limiterv1.CheckResponse{
		Allowed:   allowed,
		Remaining: float64(f.allow - f.spent[req.GetKey()]),
		Limit:     float64(f.allow),
		RuleId:    req.GetRuleId(),
	}, nil
}

func (f *fakeLimiter) callCount() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

// startServer serves f and the health service on a free port of 127.0.0.1
// until the test ends, and returns its address.
func startServer(t *testing.T, f *fakeLimiter) string {
	t.Helper()
	f.spent = make(map[string]int)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	s := grpc.NewServer()
	limiterv1.RegisterLimiterServer(s, f)
	healthpb.RegisterHealthServer(s, health.NewServer())
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	return lis.Addr().String()
}

// testOptions returns a short run against addr.
func testOptions(addr string) Options {
	o := DefaultOptions()
	o.Target = addr
	o.Concurrency = 4
	o.Conns = 2
	o.Duration = 300 * time.Millisecond
	o.Warmup = 0
	o.Keys = 20
	o.Seed = 42
	return o
}

// checkCounts checks the invariants of every result.
func checkCounts(t *testing.T, res *Result) {
	t.Helper()
	if res.Total != res.Allowed+res.Limited+res.Errors {
		t.Errorf("total %d != allowed %d + limited %d + errors %d", res.Total, res.Allowed, res.Limited, res.Errors)
	}
	var byCode int64
	for _, n := range res.ErrorsByCode {
		byCode += n
	}
	if byCode != res.Errors {
		t.Errorf("errors by code %v sum to %d, want %d", res.ErrorsByCode, byCode, res.Errors)
	}
	if got := res.Histogram.TotalCount(); got != res.Total {
		t.Errorf("histogram holds %d latencies, want %d", got, res.Total)
	}
	if res.Total > 0 {
		l := res.Latency
		if l.P50 <= 0 || l.P90 < l.P50 || l.P99 < l.P90 || l.P999 < l.P99 || l.Max < l.P999 {
			t.Errorf("latency %+v: want 0 < p50 <= p90 <= p99 <= p99.9 <= max", l)
		}
	}
}

func TestRunClosedLoop(t *testing.T) {
	const allow = 5
	tests := []struct {
		name        string
		mode        Mode
		rule        string
		wantErrCode string // every request fails with it
	}{
		{name: "check", mode: ModeCheck, rule: "api"},
		{name: "check unknown rule", mode: ModeCheck, rule: "missing", wantErrCode: codes.NotFound.String()},
		{name: "health", mode: ModeHealth, rule: "api"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeLimiter{allow: allow}
			o := testOptions(startServer(t, f))
			o.Mode, o.Rule = tt.mode, tt.rule
			if tt.mode == ModeCheck {
				// The fake is a bucket of capacity allow that never refills.
				o.ExpectRate, o.ExpectBurst = 1e-9, allow
			}
			res, err := Run(t.Context(), o)
			if err != nil {
				t.Fatalf("Run: %v", err)
			}
			checkCounts(t, res)
			if res.Total == 0 || res.ChecksPerSecond <= 0 {
				t.Fatalf("total %d, %.1f checks/s: want load", res.Total, res.ChecksPerSecond)
			}
			if res.Interrupted || res.Unsent != 0 {
				t.Errorf("interrupted %v, unsent %d: want false, 0", res.Interrupted, res.Unsent)
			}
			if tt.wantErrCode != "" {
				if res.ErrorsByCode[tt.wantErrCode] != res.Total || res.Allowed != 0 {
					t.Errorf("errors by code %v, allowed %d: want all %d %s", res.ErrorsByCode, res.Allowed, res.Total, tt.wantErrCode)
				}
			} else if res.Errors != 0 {
				t.Errorf("errors by code %v, want none", res.ErrorsByCode)
			}

			if tt.mode == ModeHealth {
				if res.Allowed != res.Total || res.PerKey != nil || f.callCount() != 0 {
					t.Errorf("health: allowed %d of %d, %d keys, %d limiter calls: want all allowed, no keys, no calls",
						res.Allowed, res.Total, len(res.PerKey), f.callCount())
				}
				return
			}
			if got := f.callCount(); got != res.Total {
				t.Errorf("the server answered %d checks, the result counts %d", got, res.Total)
			}
			var sent, allowed int64
			for _, k := range res.PerKey {
				sent += k.Sent
				allowed += k.Allowed
				if k.Allowed > allow {
					t.Errorf("key %s: %d allowed, more than %d", k.Key, k.Allowed, allow)
				}
				if k.Allowed+k.Limited+k.Errors != k.Sent {
					t.Errorf("key %s: %d allowed + %d limited + %d errors != %d sent", k.Key, k.Allowed, k.Limited, k.Errors, k.Sent)
				}
				if tt.wantErrCode == "" && k.Allowed != min(k.Sent, allow) {
					t.Errorf("key %s: %d allowed of %d sent, want %d", k.Key, k.Allowed, k.Sent, min(k.Sent, allow))
				}
			}
			if sent != res.Total || allowed != res.Allowed {
				t.Errorf("keys sum to %d sent, %d allowed; want %d, %d (no warmup)", sent, allowed, res.Total, res.Allowed)
			}
			if tt.wantErrCode == "" && res.Total > 20*allow && res.Limited == 0 {
				t.Errorf("%d checks over 20 keys of %d, none limited", res.Total, allow)
			}
			a := res.Accuracy
			if a == nil {
				t.Fatal("no accuracy report with --expect-rate set")
			}
			if a.Keys != len(res.PerKey) || a.Admitted != res.Allowed || a.OverKeys != 0 || a.WorstOvershoot > 1+1e-6 {
				t.Errorf("accuracy %+v: want %d keys, %d admitted, no overshoot", *a, len(res.PerKey), res.Allowed)
			}
		})
	}
}

func TestRunOpenLoopWithWarmup(t *testing.T) {
	f := &fakeLimiter{allow: 3}
	o := testOptions(startServer(t, f))
	o.Rate = 1000
	o.Warmup = 100 * time.Millisecond
	// 2 s measured: on a busy machine the 4 callers can be stalled for
	// all of a shorter window, and send none of it.
	o.Duration = 2 * time.Second
	res, err := Run(t.Context(), o)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	checkCounts(t, res)
	// Requests are due every 1ms; 100 in the warmup, 2000 measured.
	if res.Total == 0 || res.Total+res.Unsent != 2000 {
		t.Errorf("total %d + unsent %d, want 2000 measured", res.Total, res.Unsent)
	}
	var sent int64
	for _, k := range res.PerKey {
		sent += k.Sent
	}
	if sent < res.Total || sent != f.callCount() {
		t.Errorf("keys count %d sent, the server %d, the measured total is %d: want keys = server >= total",
			sent, f.callCount(), res.Total)
	}
}

func TestRunRequestsCap(t *testing.T) {
	tests := []struct {
		name string
		rate float64
	}{
		{name: "closed loop", rate: 0},
		{name: "open loop", rate: 5000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := testOptions(startServer(t, &fakeLimiter{allow: 1}))
			o.Rate = tt.rate
			o.Duration = time.Minute
			o.Requests = 50
			res, err := Run(t.Context(), o)
			if err != nil {
				t.Fatalf("Run: %v", err)
			}
			checkCounts(t, res)
			if res.Total+res.Unsent != 50 {
				t.Errorf("total %d + unsent %d, want 50", res.Total, res.Unsent)
			}
			if res.Elapsed >= o.Duration {
				t.Errorf("elapsed %s: the cap did not end the run", res.Elapsed)
			}
		})
	}
}

// A server slower than the schedule must show as latency, not as fewer
// samples: latency counts from the time a request was due.
func TestRunOpenLoopCountsQueueing(t *testing.T) {
	const service = 20 * time.Millisecond
	o := testOptions(startServer(t, &fakeLimiter{allow: 1, delay: service}))
	o.Concurrency, o.Conns = 1, 1
	o.Rate = 200 // a request due every 5ms, served every 20ms
	res, err := Run(t.Context(), o)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	checkCounts(t, res)
	if res.Unsent == 0 {
		t.Errorf("unsent = 0, want the requests the one worker could not send")
	}
	// The n-th request waits about n*15ms behind the schedule.
	if res.Latency.P99 < 3*service {
		t.Errorf("p99 = %s with a %s service time and a growing backlog, want at least %s",
			res.Latency.P99, service, 3*service)
	}
}

func TestRunInterrupted(t *testing.T) {
	o := testOptions(startServer(t, &fakeLimiter{allow: 1}))
	o.Duration = MaxDuration
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	res, err := Run(ctx, o)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	checkCounts(t, res)
	if !res.Interrupted || res.Total == 0 || res.Errors != 0 {
		t.Errorf("interrupted %v, total %d, errors %v: want a partial run without errors",
			res.Interrupted, res.Total, res.ErrorsByCode)
	}
}

func TestRunUnreachable(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	addr := lis.Addr().String()
	lis.Close()
	o := testOptions(addr)
	o.Timeout = 300 * time.Millisecond
	res, err := Run(t.Context(), o)
	if !errors.Is(err, context.DeadlineExceeded) || res != nil {
		t.Fatalf("Run() = %v, %v; want nil and a deadline error", res, err)
	}
}

func TestWriteResult(t *testing.T) {
	o := testOptions(startServer(t, &fakeLimiter{allow: 2}))
	o.ExpectRate, o.ExpectBurst = 1, 2
	o.KeyDist = Zipf
	res, err := Run(t.Context(), o)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}

	var table bytes.Buffer
	if err := res.WriteTable(&table); err != nil {
		t.Fatalf("WriteTable: %v", err)
	}
	for _, label := range []string{"checks ", "checks/s", "allowed", "limited", "errors",
		"latency p50", "latency p90", "latency p99 ", "latency p99.9", "latency max", "accuracy", "worst key"} {
		if !strings.Contains(table.String(), label) {
			t.Errorf("table has no %q row:\n%s", label, table.String())
		}
	}

	var buf bytes.Buffer
	if err := res.WriteJSON(&buf); err != nil {
		t.Fatalf("WriteJSON: %v", err)
	}
	var got jsonResult
	dec := json.NewDecoder(&buf)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&got); err != nil {
		t.Fatalf("decode the JSON result: %v", err)
	}
	if got.Checks != res.Total || got.Allowed != res.Allowed || got.Limited != res.Limited ||
		got.LatencyMicros.P99 != res.Latency.P99.Microseconds() || got.Accuracy == nil ||
		got.Accuracy.Admitted != res.Accuracy.Admitted || got.KeyDist != Zipf {
		t.Errorf("JSON result %+v does not match %+v", got, *res)
	}
}
