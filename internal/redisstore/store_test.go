package redisstore

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// newTestStore makes a store with its own registry, closed with the test.
func newTestStore(t *testing.T, opts Options) (*Store, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	s, err := New(context.Background(), opts, reg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, reg
}

var testLimit = bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 1e-6}

// mustTake takes cost and returns what is left, failing t on an error or a
// refusal.
func mustTake(t *testing.T, s *Store, key string, cost float64) float64 {
	t.Helper()
	d, err := s.Take(context.Background(), bucket.Request{Rule: "r", Key: key, Limit: testLimit, Cost: cost})
	if err != nil || !d.Allowed {
		t.Fatalf("Take(%s, %v) = %+v, %v", key, cost, d, err)
	}
	return d.Remaining
}

// TestStoreErrors: a failed check is counted as what its error says: a
// reply that did not come in time after the write is an unknown outcome (a
// store error of its operation too), a check that waited too long in the
// queue is overload (and no store error), and any other failure a store
// error of its operation only. (The pipeline package's tests cover which
// failure is which.)
func TestStoreErrors(t *testing.T) {
	t.Run("counted", func(t *testing.T) {
		for _, tt := range []struct {
			name                      string
			err                       error
			overloaded, unknown, errs float64
		}{
			{"overloaded", fmt.Errorf("%w: waited 50ms in the queue of n", bucket.ErrOverloaded), 1, 0, 0},
			{"outcome unknown", fmt.Errorf("%w: redis n: %w", bucket.ErrOutcomeUnknown, context.DeadlineExceeded), 0, 1, 1},
			{"breaker open", fmt.Errorf("%w: n", pipeline.ErrBreakerOpen), 0, 0, 1},
			{"node stalled", fmt.Errorf("redis n: %w: %w", pipeline.ErrNodeStalled, context.DeadlineExceeded), 0, 0, 1},
		} {
			t.Run(tt.name, func(t *testing.T) {
				reg := prometheus.NewRegistry()
				m, err := newMetrics(reg)
				if err != nil {
					t.Fatal(err)
				}
				m.failed(opMulti, tt.err)
				if got := testenv.MetricValue(t, reg, "limiter_store_overloaded_total"); got != tt.overloaded {
					t.Errorf("limiter_store_overloaded_total = %v, want %v", got, tt.overloaded)
				}
				if got := testenv.MetricValue(t, reg, "limiter_store_outcome_unknown_total"); got != tt.unknown {
					t.Errorf("limiter_store_outcome_unknown_total = %v, want %v", got, tt.unknown)
				}
				if got := testutil.ToFloat64(m.errors[opMulti]); got != tt.errs {
					t.Errorf("limiter_store_errors_total{op=\"multi\"} = %v, want %v", got, tt.errs)
				}
				if got := testenv.MetricValue(t, reg, "limiter_store_errors_total"); got != tt.errs {
					t.Errorf("limiter_store_errors_total = %v, want %v (all of op multi)", got, tt.errs)
				}
			})
		}
	})

	t.Run("no reply within the timeout", func(t *testing.T) {
		node := redistest.NewNode(t)
		for _, noCoalesce := range []bool{false, true} {
			s, reg := newTestStore(t, Options{Addrs: []string{node.Addr()}, Mode: pipeline.ModeStandalone, NoCoalesce: noCoalesce, Timeout: 50 * time.Millisecond})
			key := "errors-" + strconv.FormatBool(noCoalesce)
			mustTake(t, s, key, 1) // connected
			unpause := redistest.Pause(t, node.Addr())
			_, err := s.Take(context.Background(), bucket.Request{Rule: "r", Key: key, Limit: testLimit, Cost: 1})
			unpause()
			if !errors.Is(err, bucket.ErrOutcomeUnknown) || errors.Is(err, bucket.ErrOverloaded) {
				t.Fatalf("no-coalesce=%v: error %v: want outcome unknown only", noCoalesce, err)
			}
			if got := testenv.MetricValue(t, reg, "limiter_store_outcome_unknown_total"); got != 1 {
				t.Errorf("no-coalesce=%v: limiter_store_outcome_unknown_total = %v, want 1", noCoalesce, got)
			}
			if got := testenv.MetricValue(t, reg, "limiter_store_errors_total"); got != 1 {
				t.Errorf("no-coalesce=%v: limiter_store_errors_total = %v, want 1", noCoalesce, got)
			}
		}
	})
}

// TestStartUnreachable: New returns a working store while no node answers;
// its checks fail at once as not connected (not applied); it connects by
// itself once Redis is up, and Health says so.
func TestStartUnreachable(t *testing.T) {
	tests := []struct {
		name string
		// start returns the store's addresses, all stopped, and the
		// function that starts them and waits for them.
		start func(t *testing.T) ([]string, func())
	}{
		{
			name: "cluster",
			start: func(t *testing.T) ([]string, func()) {
				c := redistest.NewCluster(t, 3, 0)
				c.StopAll()
				return c.Addrs(), func() { c.StartAll(); c.WaitHealthy(t) }
			},
		},
		{
			name: "one address, mode asked",
			start: func(t *testing.T) ([]string, func()) {
				n := redistest.NewNode(t)
				n.Stop()
				return []string{n.Addr()}, n.Start
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			addrs, start := tt.start(t)
			s, reg := newTestStore(t, Options{Addrs: addrs, Timeout: time.Second})
			if err := s.Health(); !errors.Is(err, pipeline.ErrNotConnected) {
				t.Fatalf("Health() = %v, want pipeline.ErrNotConnected", err)
			}
			if s.Connected() {
				t.Fatal("Connected() with every node stopped")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			req := bucket.Request{Rule: "r", Key: "unreachable", Limit: testLimit, Cost: 1}
			_, err := s.Take(ctx, req)
			if !errors.Is(err, pipeline.ErrNotConnected) || errors.Is(err, bucket.ErrOverloaded) || errors.Is(err, bucket.ErrOutcomeUnknown) {
				t.Fatalf("Take while unreachable = %v, want pipeline.ErrNotConnected only", err)
			}
			if _, err := s.TakeAll(ctx, []bucket.Request{req, {Rule: "r", Key: "other", Limit: testLimit, Cost: 1}}); !errors.Is(err, pipeline.ErrNotConnected) {
				t.Fatalf("TakeAll while unreachable = %v, want pipeline.ErrNotConnected", err)
			}
			if got := testenv.MetricValue(t, reg, "limiter_store_up"); got != 0 {
				t.Fatalf("limiter_store_up = %v while unreachable", got)
			}

			start()
			testenv.WaitFor(t, "deciding once Redis is up", func() bool {
				d, err := s.Take(context.Background(), req)
				return err == nil && d.Allowed
			})
			testenv.WaitFor(t, "healthy", func() bool { return s.Health() == nil })
			if !s.Connected() || s.Client() == nil {
				t.Fatal("not connected once healthy")
			}
			if got := testenv.MetricValue(t, reg, "limiter_store_up"); got != 1 {
				t.Fatalf("limiter_store_up = %v once healthy", got)
			}
		})
	}
}

// TestTakeAllPartialFailure: when one client's script fails and another's
// decided, the decisions known come back with a *bucket.MultiError; a
// refusal gives back what the others spent, on a context of its own, and
// never touches a client whose outcome is unknown.
func TestTakeAllPartialFailure(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ctx := context.Background()
	s, _ := newTestStore(t, Options{Addrs: c.Addrs(), Timeout: 100 * time.Millisecond})
	// Two clients on two different primaries.
	var keys [2]string
	var addrs [2]string
	for i := 0; keys[1] == ""; i++ {
		k := "client-" + strconv.Itoa(i)
		n, err := s.Client().(*redis.ClusterClient).MasterForKey(ctx, Key("r", k))
		if err != nil {
			t.Fatal(err)
		}
		switch addr := n.Options().Addr; {
		case keys[0] == "":
			keys[0], addrs[0] = k, addr
		case addr != addrs[0]:
			keys[1], addrs[1] = k, addr
		}
	}
	gate := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 1, RefillPerSecond: 1e-6}
	reqs := func(suffix string, gateKey, otherKey string) []bucket.Request {
		return []bucket.Request{
			{Rule: "gate" + suffix, Key: gateKey, Limit: gate, Cost: 1},
			{Rule: "other" + suffix, Key: otherKey, Limit: testLimit, Cost: 1},
		}
	}
	left := func(rule, key string) float64 {
		t.Helper()
		d, err := s.Take(ctx, bucket.Request{Rule: rule, Key: key, Limit: testLimit, Cost: 1})
		if err != nil {
			t.Fatal(err)
		}
		return math.Round(d.Remaining + 1)
	}
	multiErr := func(t *testing.T, err error, want []error) {
		t.Helper()
		var me *bucket.MultiError
		if !errors.As(err, &me) || len(me.Errs) != len(want) {
			t.Fatalf("error %v, want a MultiError of %d", err, len(want))
		}
		for i, w := range want {
			if (w == nil) != (me.Errs[i] == nil) || (w != nil && !errors.Is(me.Errs[i], w)) {
				t.Fatalf("Errs[%d] = %v, want %v", i, me.Errs[i], w)
			}
		}
	}

	t.Run("a refusal and an unknown outcome", func(t *testing.T) {
		rs := reqs("1", keys[0], keys[1])
		if _, err := s.Take(ctx, rs[0]); err != nil { // the gate is empty now
			t.Fatal(err)
		}
		mustTakeRule(t, s, rs[1].Rule, keys[1], 5)
		unpause := redistest.Pause(t, addrs[1])
		ds, err := s.TakeAll(ctx, rs)
		unpause()
		multiErr(t, err, []error{nil, bucket.ErrOutcomeUnknown})
		if ds[0].Allowed {
			t.Fatalf("the empty gate allowed: %+v", ds[0])
		}
		// The unknown client was not given anything back: 5 left at most
		// (4 if its script ran after the pause).
		if got := left(rs[1].Rule, keys[1]); got > 5 {
			t.Fatalf("%v left in the client whose outcome was unknown, want 5 at most", got)
		}
	})

	t.Run("an allowed client and one not applied", func(t *testing.T) {
		rs := reqs("2", keys[0], keys[1])
		refused := errors.New("refused by the test")
		s.Refuse(addrs[1], refused)
		ds, err := s.TakeAll(ctx, rs)
		s.Refuse(addrs[1], nil)
		multiErr(t, err, []error{nil, refused})
		if !ds[0].Allowed {
			t.Fatalf("gate: %+v", ds[0])
		}
	})

	t.Run("a refusal undoes on its own context", func(t *testing.T) {
		rs := reqs("3", keys[1], keys[0]) // the gate on the second node
		if _, err := s.Take(ctx, rs[0]); err != nil {
			t.Fatal(err)
		}
		cctx, cancel := context.WithCancel(ctx)
		s.beforeUndo = cancel // the caller gives up just before the undo
		defer func() { s.beforeUndo = nil }()
		ds, err := s.TakeAll(cctx, rs)
		if err != nil || ds[0].Allowed || !ds[1].Allowed {
			t.Fatalf("TakeAll = %+v, %v; want the gate refusing", ds, err)
		}
		if got := left(rs[1].Rule, keys[0]); got != testLimit.Capacity {
			t.Fatalf("%v left after a refused check, want %v: the undo did not run", got, testLimit.Capacity)
		}
	})
}

func mustTakeRule(t *testing.T, s *Store, rule, key string, cost float64) {
	t.Helper()
	d, err := s.Take(context.Background(), bucket.Request{Rule: rule, Key: key, Limit: testLimit, Cost: cost})
	if err != nil || !d.Allowed {
		t.Fatalf("Take(%s, %s, %v) = %+v, %v", rule, key, cost, d, err)
	}
}

// TestLostScripts: every store call still works on a node that lost its
// scripts (SCRIPT FLUSH, as after a restart): EVALSHA falls back to EVAL.
func TestLostScripts(t *testing.T) {
	node := redistest.NewNode(t)
	ctx := context.Background()
	tests := []struct {
		name string
		run  func(s *Store, mode string) error
	}{
		{"take", func(s *Store, _ string) error {
			_, err := s.Take(ctx, bucket.Request{Rule: "r", Key: "k", Limit: testLimit, Cost: 1})
			return err
		}},
		{"take all, refused and undone", func(s *Store, mode string) error {
			gate := bucket.Request{Rule: "gate-" + mode, Key: "b", Limit: bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 1, Window: time.Hour}, Cost: 1}
			if _, err := s.Take(ctx, gate); err != nil {
				return err
			}
			ds, err := s.TakeAll(ctx, []bucket.Request{{Rule: "r", Key: "a", Limit: testLimit, Cost: 1}, gate})
			if err == nil && (!ds[0].Allowed || ds[1].Allowed) {
				err = fmt.Errorf("decisions %+v, want the gate refusing", ds)
			}
			return err
		}},
		{"debit", func(s *Store, _ string) error {
			_, err := s.ApplyDebits(ctx, "eu", Position{Epoch: 1, Seq: 1}, time.Minute, []ClientDebits{{Key: "k", Debits: []Debit{{Rule: "r", Limit: testLimit, Amount: 1}}}})
			return err
		}},
		{"refund", func(s *Store, _ string) error { return s.Refund(ctx, "r", "k", testLimit, 1) }},
	}
	for _, noCoalesce := range []bool{false, true} {
		s, _ := newTestStore(t, Options{Addrs: []string{node.Addr()}, NoCoalesce: noCoalesce, Timeout: time.Second})
		mode := map[bool]string{false: "coalesced", true: "one-by-one"}[noCoalesce]
		for _, tt := range tests {
			t.Run(tt.name+"/"+mode, func(t *testing.T) {
				if err := s.Client().ScriptFlush(ctx).Err(); err != nil {
					t.Fatal(err)
				}
				if err := tt.run(s, mode); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}

// TestMetricsLint: the store's metrics follow Prometheus conventions.
func TestMetricsLint(t *testing.T) {
	node := redistest.NewNode(t)
	s, reg := newTestStore(t, Options{Addrs: []string{node.Addr()}})
	mustTake(t, s, "lint", 1)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	testenv.Lint(t, mfs)
}

// TestCloseStopsGoroutines: Close ends every goroutine the store started
// (the pipelines' workers, the background probe) and those of its clients,
// also after nodes went down and came back.
func TestCloseStopsGoroutines(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	before := storeGoroutines()
	s, err := New(context.Background(), Options{Addrs: c.Addrs(), Timeout: time.Second}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for i := range 20 {
		k := "close-" + strconv.Itoa(i)
		if _, err := s.TakeAll(ctx, []bucket.Request{
			{Rule: "a", Key: k, Limit: testLimit, Cost: 1},
			{Rule: "b", Key: k + "-other", Limit: testLimit, Cost: 1},
		}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "without the store's goroutines", func() bool { return len(storeGoroutines()) <= len(before) })
	if _, err := s.Take(ctx, bucket.Request{Rule: "a", Key: "k", Limit: testLimit, Cost: 1}); !errors.Is(err, redis.ErrClosed) {
		t.Fatalf("Take after Close = %v, want redis.ErrClosed", err)
	}
}

// storeGoroutines lists the goroutines running code of this package or of
// the packages under it (but not their tests), or of go-redis.
func storeGoroutines() []string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "_test.go") {
			continue
		}
		if strings.Contains(g, "limiterd/internal/redisstore.") || strings.Contains(g, "limiterd/internal/redisstore/") || strings.Contains(g, "go-redis/v9") {
			out = append(out, g)
		}
	}
	return out
}

// TestArgsCacheBound: the cache of check arguments keeps at most
// maxCachedArgs (costs come from clients: distinct ones cannot grow it), and
// what it returns past the bound is still right.
func TestArgsCacheBound(t *testing.T) {
	var c argsCache
	lim := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 2.5}
	for i := range maxCachedArgs + 100 {
		a := c.get(lim, float64(i+1))
		if want := strconv.Itoa(i + 1); a[0] != "10" || a[1] != "2.5" || a[2] != want {
			t.Fatalf("args for cost %d: %v", i+1, a)
		}
	}
	if n := len(c.m); n != maxCachedArgs {
		t.Fatalf("%d entries cached, want the bound %d", n, maxCachedArgs)
	}
	w := bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 5, Window: 1500 * time.Millisecond}
	if a := c.get(w, 1); a[0] != "5" || a[1] != "1500000" || a[2] != "1" {
		t.Fatalf("window args: %v", a)
	}
}
