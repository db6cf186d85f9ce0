package demo

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// fakeLimiter admits the first admit checks of each (rule, key) and refuses
// the rest; after failAfter checks (if > 0) it answers UNAVAILABLE. It is
// only the demo's test target: it knows nothing of buckets or regions.
type fakeLimiter struct {
	limiterv1.UnimplementedLimiterServer
	admit, failAfter int

	mu     sync.Mutex
	checks map[[2]string]int
	calls  int
}

func (f *fakeLimiter) Check(_ context.Context, req *limiterv1.CheckRequest) (*limiterv1.CheckResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if f.failAfter > 0 && f.calls > f.failAfter {
		return nil, status.Error(codes.Unavailable, "fake limiter gone")
	}
	id := [2]string{req.GetRuleId(), req.GetKey()}
	f.checks[id]++
	return &limiterv1.CheckResponse{Allowed: f.checks[id] <= f.admit, RuleId: req.GetRuleId()}, nil
}

// counts returns how many checks each (rule, key) had.
func (f *fakeLimiter) counts() map[[2]string]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[[2]string]int, len(f.checks))
	for k, v := range f.checks {
		out[k] = v
	}
	return out
}

// serve runs f on a free loopback port until the test ends.
func serve(t *testing.T, f *fakeLimiter) string {
	t.Helper()
	f.checks = make(map[[2]string]int)
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

const testRules = `rules:
  - id: shared
    capacity: 10
    refill_per_second: 2
  - id: solo
    algorithm: gcra
    capacity: 10
    refill_per_second: 2
    reconcile: false
  - id: pinned
    capacity: 10
    refill_per_second: 2
    home: pinned
  - id: window
    algorithm: fixed_window
    limit: 10
    window: 1m
  - id: shadow
    capacity: 10
    refill_per_second: 2
    shadow: true
  - id: costly
    capacity: 10
    refill_per_second: 2
    cost: 2
`

// testOptions is a run of 1 s at 20 checks/s per region against us, eu and ap,
// with a gossip interval longer than the run, so one interval of remote
// spending is everything a region admitted.
func testOptions(t *testing.T, us, eu, ap string) Options {
	t.Helper()
	file := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(file, []byte(testRules), 0o644); err != nil {
		t.Fatal(err)
	}
	opts := DefaultOptions()
	opts.USEastAddress, opts.EUWestAddress, opts.APSouthAddress = us, eu, ap
	opts.RulesFile = file
	opts.ReconciledRule, opts.UnreconciledRule = "shared", "solo"
	opts.Rate, opts.Duration, opts.GossipInterval = 20, time.Second, 2*time.Second
	return opts
}

func TestMeasureAgainstFakes(t *testing.T) {
	us, eu, ap := &fakeLimiter{admit: 15}, &fakeLimiter{admit: 10}, &fakeLimiter{admit: 5}
	opts := testOptions(t, serve(t, us), serve(t, eu), serve(t, ap))
	start := time.Now()
	rep, err := Measure(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < 2*time.Second {
		t.Errorf("two runs of 1s took %v", took)
	}
	if !strings.HasPrefix(rep.Key, "limiterdemo-") || rep.Rate != 20 || rep.Duration != time.Second {
		t.Errorf("report key %q, rate %v, duration %v", rep.Key, rep.Rate, rep.Duration)
	}
	if len(rep.Runs) != 2 {
		t.Fatalf("%d runs, want 2", len(rep.Runs))
	}
	for i, want := range []struct {
		rule       string
		reconciled bool
	}{{"shared", true}, {"solo", false}} {
		r := &rep.Runs[i]
		if r.Rule != want.rule || r.Reconciled != want.reconciled {
			t.Errorf("run %d: rule %s (reconciled %v), want %s (%v)", i, r.Rule, r.Reconciled, want.rule, want.reconciled)
		}
		if r.Capacity != 10 || r.RefillPerSecond != 2 || r.GossipInterval != 2*time.Second {
			t.Errorf("%s: capacity %v, refill %v, interval %v", r.Rule, r.Capacity, r.RefillPerSecond, r.GossipInterval)
		}
		if r.Elapsed < time.Second || r.Elapsed > 3*time.Second {
			t.Errorf("%s: T = %v, want about 1s and never less", r.Rule, r.Elapsed)
		}
		for j, w := range []struct {
			region, addr string
			admitted     int
		}{{"us-east", opts.USEastAddress, 15}, {"eu-west", opts.EUWestAddress, 10}, {"ap-south", opts.APSouthAddress, 5}} {
			reg := r.Regions[j]
			if reg.Region != w.region || reg.Address != w.addr || reg.Sent != 20 || len(reg.Admitted) != w.admitted {
				t.Errorf("%s: region %d = %s at %s, %d of %d admitted; want %s at %s, %d of 20",
					r.Rule, j, reg.Region, reg.Address, len(reg.Admitted), reg.Sent, w.region, w.addr, w.admitted)
			}
			for k := 1; k < len(reg.Admitted); k++ {
				if reg.Admitted[k] < reg.Admitted[k-1] {
					t.Errorf("%s %s: admission instants out of order", r.Rule, reg.Region)
				}
			}
		}
		// The report's arithmetic on what the fakes admitted: ap-south's
		// remote spending, us-east's and eu-west's, is the largest.
		limit := 10 + 2*r.Elapsed.Seconds()
		if r.Total() != 30 || !near(r.Limit(), limit) || !near(r.Overshoot(), 30-limit) ||
			r.RemoteSpend() != 25 || !near(r.OvershootIntervals(), (30-limit)/25) {
			t.Errorf("%s: total %d, limit %v, overshoot %v, remote %d, intervals %v; want 30, %v, %v, 25, %v",
				r.Rule, r.Total(), r.Limit(), r.Overshoot(), r.RemoteSpend(), r.OvershootIntervals(), limit, 30-limit, (30-limit)/25)
		}
	}
	// One fresh key, the same for both rules and regions: 20 checks each,
	// besides one probe per rule on a key of its own.
	for _, f := range []*fakeLimiter{us, eu, ap} {
		want := map[[2]string]int{
			{"shared", rep.Key}: 20, {"solo", rep.Key}: 20,
			{"shared", rep.Key + "-probe"}: 1, {"solo", rep.Key + "-probe"}: 1,
		}
		got := f.counts()
		if len(got) != len(want) {
			t.Errorf("checks by (rule, key) = %v, want %v", got, want)
		}
		for k, n := range want {
			if got[k] != n {
				t.Errorf("checks of %v = %d, want %d", k, got[k], n)
			}
		}
	}
	var b strings.Builder
	if err := rep.Write(&b); err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{
		"admitted    us-east 15 of 20, eu-west 10 of 20, ap-south 5 of 20\n",
		"total       30\n",
		"(25: the most admitted in 2s by every region but one)\n",
	} {
		if strings.Count(b.String(), line) != 2 {
			t.Errorf("report has not twice %q:\n%s", line, b.String())
		}
	}
}

func TestFreshKeys(t *testing.T) {
	seen := map[string]bool{}
	for range 100 {
		k, err := freshKey()
		if err != nil {
			t.Fatal(err)
		}
		if seen[k] {
			t.Fatalf("key %q made twice", k)
		}
		seen[k] = true
	}
}

func TestMeasureFails(t *testing.T) {
	down := func(t *testing.T) string {
		// A port that was free a moment ago: nothing listens there.
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := lis.Addr().String()
		lis.Close()
		return addr
	}
	tests := []struct {
		name string
		edit func(t *testing.T, o *Options)
		flag string     // the *OptionError's flag, or
		code codes.Code // the gRPC code of the error
	}{
		{name: "invalid option", edit: func(_ *testing.T, o *Options) { o.Rate = 0 }, flag: "rate"},
		{name: "no rules file", edit: func(t *testing.T, o *Options) { o.RulesFile = filepath.Join(t.TempDir(), "none.yml") }, flag: "rules.file"},
		{name: "unknown rule", edit: func(_ *testing.T, o *Options) { o.ReconciledRule = "nope" }, flag: "rule.reconciled"},
		{name: "reconciled rule not reconciled", edit: func(_ *testing.T, o *Options) { o.ReconciledRule = "solo"; o.UnreconciledRule = "shared" }, flag: "rule.reconciled"},
		{name: "unreconciled rule reconciled", edit: func(_ *testing.T, o *Options) { o.UnreconciledRule = "pinned"; o.ReconciledRule = "shared" }, flag: "rule.unreconciled"},
		{name: "not a bucket", edit: func(_ *testing.T, o *Options) { o.ReconciledRule = "window" }, flag: "rule.reconciled"},
		{name: "shadow rule", edit: func(_ *testing.T, o *Options) { o.ReconciledRule = "shadow" }, flag: "rule.reconciled"},
		{name: "two tokens a check", edit: func(_ *testing.T, o *Options) { o.ReconciledRule = "costly" }, flag: "rule.reconciled"},
		{name: "region down", edit: func(t *testing.T, o *Options) { o.EUWestAddress = down(t) }, code: codes.Unavailable},
		{name: "region fails during the run", edit: func(t *testing.T, o *Options) { o.EUWestAddress = serve(t, &fakeLimiter{admit: 5, failAfter: 10}) }, code: codes.Unavailable},
		{name: "third region down", edit: func(t *testing.T, o *Options) { o.APSouthAddress = down(t) }, code: codes.Unavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := testOptions(t, serve(t, &fakeLimiter{admit: 5}), serve(t, &fakeLimiter{admit: 5}), serve(t, &fakeLimiter{admit: 5}))
			tt.edit(t, &opts)
			rep, err := Measure(context.Background(), opts)
			if err == nil {
				t.Fatalf("Measure = %+v, want an error", rep)
			}
			if tt.flag != "" {
				if got := invalidFlags(t, err); len(got) != 1 || got[0] != tt.flag {
					t.Errorf("error %v names %q, want %q", err, got, tt.flag)
				}
				return
			}
			if got := status.Code(err); got != tt.code {
				t.Errorf("error %v has code %v, want %v", err, got, tt.code)
			}
		})
	}
}

func TestMeasureCancelled(t *testing.T) {
	opts := testOptions(t, serve(t, &fakeLimiter{admit: 5}), serve(t, &fakeLimiter{admit: 5}), serve(t, &fakeLimiter{admit: 5}))
	opts.Duration = time.Minute
	// As SIGINT does: cancelled in the middle of a run.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	time.AfterFunc(300*time.Millisecond, cancel)
	start := time.Now()
	_, err := Measure(ctx, opts)
	if !errors.Is(err, context.Canceled) {
		t.Errorf("Measure = %v, want context.Canceled", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("a cancelled demo took %v to return", took)
	}
}
