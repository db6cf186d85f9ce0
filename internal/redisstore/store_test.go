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
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	"github.com/redis/go-redis/v9"

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

// pause stops node addr from running scripts (CLIENT PAUSE WRITE: PING and
// the handshake still pass, and so does CLIENT UNPAUSE, which PAUSE ALL
// would hold too) until the returned function is called, or 10 s at most.
func pause(t *testing.T, addr string) (unpause func()) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	ctx := context.Background()
	if err := c.Do(ctx, "client", "pause", 10_000, "write").Err(); err != nil {
		t.Fatal(err)
	}
	done := false
	unpause = func() {
		if done {
			return
		}
		done = true
		if err := c.Do(ctx, "client", "unpause").Err(); err != nil {
			t.Error(err)
		}
		c.Close()
	}
	t.Cleanup(unpause)
	return unpause
}

// sampleCount is the number of observations of the histogram name in reg.
func sampleCount(t testing.TB, reg *prometheus.Registry, name string) uint64 {
	t.Helper()
	n, _ := histogram(t, reg, name)
	return n
}

// sampleSum is the sum of the observations of the histogram name in reg.
func sampleSum(t testing.TB, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	_, sum := histogram(t, reg, name)
	return sum
}

// histogram is the count and sum of the observations of the histogram
// name in reg, over its series (0 and 0 when it has none).
func histogram(t testing.TB, reg *prometheus.Registry, name string) (uint64, float64) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var (
		n   uint64
		sum float64
	)
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				n += m.GetHistogram().GetSampleCount()
				sum += m.GetHistogram().GetSampleSum()
			}
		}
	}
	return n, sum
}

// metricValue is the value of the counter or gauge name in reg (summed
// over its labels).
func metricValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			v := 0.0
			for _, m := range mf.GetMetric() {
				v += m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
			return v
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// waitFor polls cond until it holds, failing t after 20 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still not %s after 20 s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
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

// TestStoreErrors: each way a check can fail says what happened to it.
// Waiting in limiterd's own queue past the cap or the caller's deadline is
// overload (never sent, nothing spent), unless the node answered nothing
// meanwhile while pipelines to it were in flight: then the node is stalled
// (not applied, a store failure); a reply that does not come in time after
// the write is an unknown outcome; a node that refuses connections, or
// whose breaker is open, is neither (not applied).
func TestStoreErrors(t *testing.T) {
	node := redistest.NewNode(t)
	type want int
	const (
		wantOverloaded want = iota
		wantUnknown
		wantNotApplied
	)
	tests := []struct {
		name string
		opts Options
		// only, when set, runs the case with that NoCoalesce only.
		only *bool
		// run makes one check fail and returns its error.
		run  func(t *testing.T, s *Store, reg *prometheus.Registry, key string) error
		want want
		// stalledCoalesced: coalesced, the error is ErrNodeStalled (not
		// applied) instead of want, which is then the one-by-one error.
		stalledCoalesced bool
		// cause, when set, must be wrapped too.
		cause error
	}{
		{
			name: "queued past the cap behind a paused node",
			opts: Options{Timeout: 10 * time.Second, MaxQueueWait: 50 * time.Millisecond, PipelinesPerNode: 1, MaxBatch: 1, PoolSize: 1},
			run: func(t *testing.T, s *Store, reg *prometheus.Registry, key string) error {
				return queuedBehindPaused(t, s, reg, node.Addr(), key, context.Background())
			},
			want: wantOverloaded, stalledCoalesced: true,
		},
		{
			name: "queued past the cap behind checks the node answers",
			opts: Options{Timeout: 10 * time.Second, MaxQueueWait: 5 * time.Millisecond, PipelinesPerNode: 1, MaxBatch: 1},
			only: new(false),
			run: func(t *testing.T, s *Store, _ *prometheus.Registry, key string) error {
				mustTake(t, s, key, 1) // connected
				// 1,000 callers, one check in flight at a time: the last
				// wait far longer than 5 ms while the node answers.
				const callers = 1000
				errs := make(chan error, callers)
				for i := range callers {
					go func() {
						_, err := s.Take(context.Background(), bucket.Request{Rule: "r", Key: fmt.Sprint(key, i), Limit: testLimit, Cost: 1})
						errs <- err
					}()
				}
				// One overloaded answer is enough; on a busy machine a
				// pipeline may take longer than 5 ms, and a check queued
				// behind only that one is told the node stalled.
				var first error
				for range callers {
					if err := <-errs; err != nil && (first == nil || errors.Is(err, bucket.ErrOverloaded)) {
						first = err
					}
				}
				return first
			},
			want: wantOverloaded,
		},
		{
			name: "caller deadline passes in the queue",
			opts: Options{Timeout: 10 * time.Second, MaxQueueWait: 10 * time.Second, PipelinesPerNode: 1, MaxBatch: 1, PoolSize: 1},
			run: func(t *testing.T, s *Store, reg *prometheus.Registry, key string) error {
				ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
				defer cancel()
				return queuedBehindPaused(t, s, reg, node.Addr(), key, ctx)
			},
			want: wantOverloaded, stalledCoalesced: true, cause: context.DeadlineExceeded,
		},
		{
			name: "no reply within the timeout",
			opts: Options{Timeout: 50 * time.Millisecond},
			run: func(t *testing.T, s *Store, _ *prometheus.Registry, key string) error {
				mustTake(t, s, key, 1) // connected
				unpause := pause(t, node.Addr())
				defer unpause()
				_, err := s.Take(context.Background(), bucket.Request{Rule: "r", Key: key, Limit: testLimit, Cost: 1})
				return err
			},
			want: wantUnknown,
		},
		{
			name: "caller deadline passes after the write",
			opts: Options{Timeout: 10 * time.Second},
			only: new(false), // with NoCoalesce the reply wait is Options.Timeout
			run: func(t *testing.T, s *Store, _ *prometheus.Registry, key string) error {
				mustTake(t, s, key, 1)
				unpause := pause(t, node.Addr())
				defer unpause()
				ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
				defer cancel()
				_, err := s.Take(ctx, bucket.Request{Rule: "r", Key: key, Limit: testLimit, Cost: 1})
				return err
			},
			want: wantUnknown, cause: context.DeadlineExceeded,
		},
	}
	for _, tt := range tests {
		for _, noCoalesce := range []bool{false, true} {
			if tt.only != nil && *tt.only != noCoalesce {
				continue
			}
			name := tt.name + map[bool]string{false: "/coalesced", true: "/one-by-one"}[noCoalesce]
			t.Run(name, func(t *testing.T) {
				opts := tt.opts
				opts.Addrs, opts.Mode, opts.NoCoalesce = []string{node.Addr()}, ModeStandalone, noCoalesce
				s, reg := newTestStore(t, opts)
				key := "errors-" + name
				err := tt.run(t, s, reg, key)
				if err == nil {
					t.Fatal("no error")
				}
				isOverloaded, isUnknown := errors.Is(err, bucket.ErrOverloaded), errors.Is(err, bucket.ErrOutcomeUnknown)
				switch {
				case tt.stalledCoalesced && !noCoalesce:
					if !errors.Is(err, ErrNodeStalled) || isOverloaded || isUnknown {
						t.Fatalf("error %v: want ErrNodeStalled only", err)
					}
					if got := metricValue(t, reg, "limiter_store_overloaded_total"); got != 0 {
						t.Errorf("limiter_store_overloaded_total = %v, want 0", got)
					}
				case tt.want == wantOverloaded:
					if !isOverloaded || isUnknown {
						t.Fatalf("error %v: want overloaded only", err)
					}
					if got := metricValue(t, reg, "limiter_store_overloaded_total"); got < 1 {
						t.Errorf("limiter_store_overloaded_total = %v, want at least 1", got)
					}
				case tt.want == wantUnknown:
					if !isUnknown || isOverloaded {
						t.Fatalf("error %v: want outcome unknown only", err)
					}
					if got := metricValue(t, reg, "limiter_store_outcome_unknown_total"); got != 1 {
						t.Errorf("limiter_store_outcome_unknown_total = %v, want 1", got)
					}
				}
				if tt.cause != nil && !errors.Is(err, tt.cause) {
					t.Errorf("error %v does not wrap %v", err, tt.cause)
				}
			})
		}
	}

	// Not applied: a stopped node. The first checks fail to connect, then
	// the breaker opens; neither is overload or an unknown outcome.
	for _, noCoalesce := range []bool{false, true} {
		t.Run(map[bool]string{false: "connection refused/coalesced", true: "connection refused/one-by-one"}[noCoalesce], func(t *testing.T) {
			stopped := redistest.NewNode(t)
			stopped.Stop()
			s, _ := newTestStore(t, Options{Addrs: []string{stopped.Addr()}, Mode: ModeStandalone, NoCoalesce: noCoalesce, Timeout: time.Second})
			var errs []error
			for range breakerConnFailures + 1 {
				_, err := s.Take(context.Background(), bucket.Request{Rule: "r", Key: "k", Limit: testLimit, Cost: 1})
				if err == nil {
					t.Fatal("a check on a stopped node succeeded")
				}
				if errors.Is(err, bucket.ErrOverloaded) || errors.Is(err, bucket.ErrOutcomeUnknown) {
					t.Fatalf("error %v: want neither overloaded nor outcome unknown", err)
				}
				errs = append(errs, err)
			}
			if last := errs[len(errs)-1]; !errors.Is(last, ErrBreakerOpen) {
				t.Fatalf("after %d refused connections: %v, want ErrBreakerOpen", breakerConnFailures, last)
			}
		})
	}
}

// queuedBehindPaused makes the one connection (or pipeline) to addr busy
// with a check the paused node does not answer, then returns the error of a
// second check, made with ctx, that can only wait behind it. The first
// check is answered once the node resumes, and it alone spent: the second
// was never sent.
func queuedBehindPaused(t *testing.T, s *Store, reg *prometheus.Registry, addr, key string, ctx context.Context) error {
	t.Helper()
	left := mustTake(t, s, key, 1) // connected
	unpause := pause(t, addr)
	first := make(chan error, 1)
	go func() {
		d, err := s.Take(context.Background(), bucket.Request{Rule: "r", Key: key, Limit: testLimit, Cost: 1})
		if err == nil && !d.Allowed {
			err = errors.New("refused")
		}
		first <- err
	}()
	n := s.node(addr)
	if s.coalesce {
		waitFor(t, "sending the first check", func() bool { return sampleCount(t, reg, "limiter_store_pipeline_checks") == 2 })
	} else {
		waitFor(t, "holding the pool's connection", func() bool {
			st := n.pooled.PoolStats()
			return st.TotalConns == 1 && st.IdleConns == 0
		})
	}
	_, err := s.Take(ctx, bucket.Request{Rule: "r", Key: key, Limit: testLimit, Cost: 1})
	unpause()
	if ferr := <-first; ferr != nil {
		t.Fatalf("first check: %v", ferr)
	}
	// The first check spent 1; the second nothing. (The bucket refills by
	// a millionth of a token a second.)
	if got := mustTake(t, s, key, 1); math.Round(got) != math.Round(left-2) {
		t.Fatalf("%v tokens left after two checks, want %v: the queued check spent", got, left-2)
	}
	return err
}

// TestBreaker: a node that answers slowly a few times keeps its breaker
// closed; a stopped node opens it; it closes again once the node is back.
func TestBreaker(t *testing.T) {
	for _, noCoalesce := range []bool{false, true} {
		t.Run(map[bool]string{false: "coalesced", true: "one-by-one"}[noCoalesce], func(t *testing.T) {
			node := redistest.NewNode(t)
			s, reg := newTestStore(t, Options{Addrs: []string{node.Addr()}, Mode: ModeStandalone, NoCoalesce: noCoalesce,
				Timeout: 50 * time.Millisecond, BreakerOpen: 100 * time.Millisecond})
			ctx := context.Background()
			req := bucket.Request{Rule: "r", Key: "breaker", Limit: testLimit, Cost: 1}
			mustTake(t, s, req.Key, 1)

			// More slow answers in a row than the old breaker allowed (5).
			unpause := pause(t, node.Addr())
			for i := range 2 * breakerConnFailures {
				_, err := s.Take(ctx, req)
				if err == nil {
					t.Fatalf("slow check %d answered", i)
				}
				if errors.Is(err, ErrBreakerOpen) {
					t.Fatalf("slow check %d: %v: the breaker opened on slow answers", i, err)
				}
			}
			unpause()
			waitFor(t, "answering after the pause", func() bool {
				d, err := s.Take(ctx, req)
				if errors.Is(err, ErrBreakerOpen) {
					t.Fatalf("after slow answers: %v", err)
				}
				return err == nil && d.Allowed
			})
			if got := metricValue(t, reg, "limiter_store_breakers_open"); got != 0 {
				t.Fatalf("limiter_store_breakers_open = %v after slow answers, want 0", got)
			}

			node.Stop()
			waitFor(t, "open on a stopped node", func() bool {
				_, err := s.Take(ctx, req)
				if err == nil || errors.Is(err, bucket.ErrOverloaded) {
					t.Fatalf("check on a stopped node: %v", err)
				}
				return errors.Is(err, ErrBreakerOpen)
			})
			if got := metricValue(t, reg, "limiter_store_breakers_open"); got != 1 {
				t.Fatalf("limiter_store_breakers_open = %v on a stopped node, want 1", got)
			}

			node.Start()
			waitFor(t, "closed once the node is back", func() bool {
				d, err := s.Take(ctx, req)
				return err == nil && d.Allowed
			})
			if got := metricValue(t, reg, "limiter_store_breakers_open"); got != 0 {
				t.Fatalf("limiter_store_breakers_open = %v with the node back, want 0", got)
			}
		})
	}
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
			if err := s.Health(); !errors.Is(err, ErrNotConnected) {
				t.Fatalf("Health() = %v, want ErrNotConnected", err)
			}
			if s.Connected() {
				t.Fatal("Connected() with every node stopped")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			req := bucket.Request{Rule: "r", Key: "unreachable", Limit: testLimit, Cost: 1}
			_, err := s.Take(ctx, req)
			if !errors.Is(err, ErrNotConnected) || errors.Is(err, bucket.ErrOverloaded) || errors.Is(err, bucket.ErrOutcomeUnknown) {
				t.Fatalf("Take while unreachable = %v, want ErrNotConnected only", err)
			}
			if _, err := s.TakeAll(ctx, []bucket.Request{req, {Rule: "r", Key: "other", Limit: testLimit, Cost: 1}}); !errors.Is(err, ErrNotConnected) {
				t.Fatalf("TakeAll while unreachable = %v, want ErrNotConnected", err)
			}
			if got := metricValue(t, reg, "limiter_store_up"); got != 0 {
				t.Fatalf("limiter_store_up = %v while unreachable", got)
			}

			start()
			waitFor(t, "deciding once Redis is up", func() bool {
				d, err := s.Take(context.Background(), req)
				return err == nil && d.Allowed
			})
			waitFor(t, "healthy", func() bool { return s.Health() == nil })
			if !s.Connected() || s.Client() == nil {
				t.Fatal("not connected once healthy")
			}
			if got := metricValue(t, reg, "limiter_store_up"); got != 1 {
				t.Fatalf("limiter_store_up = %v once healthy", got)
			}
		})
	}
}

// TestGuard: the eviction guard refuses an unsafe node at start; it works
// while the store is unreachable at start and reads the nodes once they
// answer; a node found unsafe then has its checks failed (not applied)
// unless unsafe policies are allowed, until it is safe again.
func TestGuard(t *testing.T) {
	ctx := context.Background()
	setPolicy := func(t *testing.T, addr, policy string) {
		t.Helper()
		c := redis.NewClient(&redis.Options{Addr: addr})
		defer c.Close()
		if err := c.ConfigSet(ctx, "maxmemory-policy", policy).Err(); err != nil {
			t.Fatal(err)
		}
		// Kept across a restart.
		if err := c.ConfigRewrite(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("unsafe at start", func(t *testing.T) {
		node := redistest.NewNode(t)
		setPolicy(t, node.Addr(), "volatile-lru")
		s, _ := newTestStore(t, Options{Addrs: []string{node.Addr()}})
		if _, err := NewGuard(ctx, s, false, prometheus.NewRegistry()); !errors.Is(err, ErrUnsafeEviction) {
			t.Fatalf("NewGuard with a volatile-lru node = %v, want ErrUnsafeEviction", err)
		}
		if _, err := NewGuard(ctx, s, true, prometheus.NewRegistry()); err != nil {
			t.Fatalf("NewGuard allowing unsafe policies: %v", err)
		}
	})

	for _, allow := range []bool{false, true} {
		t.Run(map[bool]string{false: "unsafe once reachable", true: "unsafe once reachable, allowed"}[allow], func(t *testing.T) {
			node := redistest.NewNode(t)
			setPolicy(t, node.Addr(), "allkeys-lru")
			node.Stop()
			s, reg := newTestStore(t, Options{Addrs: []string{node.Addr()}, Timeout: time.Second})
			g, err := NewGuard(ctx, s, allow, reg)
			if err != nil {
				t.Fatalf("NewGuard with the store unreachable: %v", err)
			}
			found := make(chan MemoryReading, 100)
			rctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() {
				g.Run(rctx, 100*time.Millisecond, func(r MemoryReading) {
					select {
					case found <- r:
					default:
					}
				})
				close(done)
			}()
			t.Cleanup(func() { cancel(); <-done })

			node.Start()
			if r := <-found; r.Policy != "allkeys-lru" || r.Node != node.Addr() {
				t.Fatalf("onUnsafe(%+v)", r)
			}
			if got := metricValue(t, reg, "limiter_store_unsafe_eviction_policy"); got != 1 {
				t.Fatalf("limiter_store_unsafe_eviction_policy = %v, want 1", got)
			}
			req := bucket.Request{Rule: "r", Key: "guarded", Limit: testLimit, Cost: 1}
			if allow {
				waitFor(t, "deciding", func() bool { d, err := s.Take(ctx, req); return err == nil && d.Allowed })
				return
			}
			waitFor(t, "connected", s.Connected)
			_, err = s.Take(ctx, req)
			if !errors.Is(err, ErrUnsafeEviction) || errors.Is(err, bucket.ErrOverloaded) || errors.Is(err, bucket.ErrOutcomeUnknown) {
				t.Fatalf("Take on an unsafe node = %v, want ErrUnsafeEviction (not applied)", err)
			}
			setPolicy(t, node.Addr(), "noeviction")
			waitFor(t, "deciding once the node is safe", func() bool { d, err := s.Take(ctx, req); return err == nil && d.Allowed })
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
		n, err := s.nodeFor(ctx, Key("r", k))
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case keys[0] == "":
			keys[0], addrs[0] = k, n.addr
		case n.addr != addrs[0]:
			keys[1], addrs[1] = k, n.addr
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
		unpause := pause(t, addrs[1])
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
		s.setUnsafe(addrs[1], true)
		ds, err := s.TakeAll(ctx, rs)
		s.setUnsafe(addrs[1], false)
		multiErr(t, err, []error{nil, ErrUnsafeEviction})
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
	if _, err := NewGuard(context.Background(), s, false, reg); err != nil {
		t.Fatal(err)
	}
	mustTake(t, s, "lint", 1)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	problems, err := promlint.NewWithMetricFamilies(mfs).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("promlint: %s: %s", p.Metric, p.Text)
	}
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
	waitFor(t, "without the store's goroutines", func() bool { return len(storeGoroutines()) <= len(before) })
	if _, err := s.Take(ctx, bucket.Request{Rule: "a", Key: "k", Limit: testLimit, Cost: 1}); !errors.Is(err, redis.ErrClosed) {
		t.Fatalf("Take after Close = %v, want redis.ErrClosed", err)
	}
}

// storeGoroutines lists the goroutines running code of this package (but
// not its tests) or of go-redis.
func storeGoroutines() []string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "_test.go") {
			continue
		}
		if strings.Contains(g, "limiterd/internal/redisstore.") || strings.Contains(g, "go-redis/v9") {
			out = append(out, g)
		}
	}
	return out
}

// TestLateReplyIsUsed: a reply that comes after the store timeout and
// before the reply deadline is Redis's decision, known: it is used, not
// answered as an unknown outcome (which would be decided without the
// store), and counted as a slow reply.
func TestLateReplyIsUsed(t *testing.T) {
	node := redistest.NewNode(t)
	s, reg := newTestStore(t, Options{Addrs: []string{node.Addr()}, Mode: ModeStandalone,
		Timeout: 5 * time.Millisecond, ReplyDeadline: 5 * time.Second})
	mustTake(t, s, "late", 1) // connected
	unpause := pause(t, node.Addr())
	go func() {
		time.Sleep(100 * time.Millisecond)
		unpause()
	}()
	d, err := s.Take(context.Background(), bucket.Request{Rule: "r", Key: "late", Limit: testLimit, Cost: 1})
	if err != nil || !d.Allowed || d.Remaining < 7.99 || d.Remaining > 8.01 {
		t.Fatalf("a check answered 100 ms late = %+v, %v; want allowed with 8 left", d, err)
	}
	if got := metricValue(t, reg, "limiter_store_slow_replies_total"); got != 1 {
		t.Errorf("limiter_store_slow_replies_total = %v, want 1", got)
	}
	if got := metricValue(t, reg, "limiter_store_outcome_unknown_total"); got != 0 {
		t.Errorf("limiter_store_outcome_unknown_total = %v, want 0", got)
	}
}
