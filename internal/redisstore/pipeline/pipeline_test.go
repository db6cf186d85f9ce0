package pipeline

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// incrScript adds ARGV[1] to the counter KEYS[1] and returns {the sum}.
var incrScript = redis.NewScript(`return {redis.call('incrby', KEYS[1], ARGV[1])}`)

// newTestNodes makes Nodes with their own registry, closed with the test.
func newTestNodes(t *testing.T, opts Options) (*Nodes, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	ns, err := New(context.Background(), opts, reg, []*redis.Script{incrScript})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Close() })
	return ns, reg
}

// discard observes nothing.
var discard = prometheus.ObserverFunc(func(float64) {})

// incr adds by to the counter key, with ctx, and returns the sum.
func incr(ctx context.Context, ns *Nodes, key string, by int) (int64, error) {
	res, err := ns.Eval(ctx, key, Call{Script: incrScript, Keys: []string{key}, Args: []any{by}}, discard)
	if err != nil {
		return 0, err
	}
	if len(res) != 1 {
		return 0, fmt.Errorf("reply %v", res)
	}
	n, ok := res[0].(int64)
	if !ok {
		return 0, fmt.Errorf("reply %v", res)
	}
	return n, nil
}

// mustIncr adds by to the counter key and returns the sum, failing t on an
// error.
func mustIncr(t *testing.T, ns *Nodes, key string, by int) int64 {
	t.Helper()
	n, err := incr(context.Background(), ns, key, by)
	if err != nil {
		t.Fatalf("incr(%s, %d): %v", key, by, err)
	}
	return n
}

// TestErrors: each way a call can fail says what happened to it. Waiting
// in the node's queue past the cap or the caller's deadline is overload
// (never sent, nothing run), unless the node answered nothing meanwhile
// while pipelines to it were in flight: then the node is stalled (not
// applied, a store failure); a reply that does not come in time after the
// write is an unknown outcome; a node that refuses connections, or whose
// breaker is open, is neither (not applied).
func TestErrors(t *testing.T) {
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
		// run makes one call fail and returns its error.
		run  func(t *testing.T, ns *Nodes, reg *prometheus.Registry, key string) error
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
			run: func(t *testing.T, ns *Nodes, reg *prometheus.Registry, key string) error {
				return queuedBehindPaused(t, ns, reg, node.Addr(), key, context.Background())
			},
			want: wantOverloaded, stalledCoalesced: true,
		},
		{
			// The reader of the node's replies may not have run: the
			// check is limiterd's overload, not the node's stall.
			name: "queued past the cap behind a paused node while limiterd went unscheduled",
			opts: Options{Timeout: 10 * time.Second, MaxQueueWait: 50 * time.Millisecond, PipelinesPerNode: 1, MaxBatch: 1, PoolSize: 1},
			run: func(t *testing.T, ns *Nodes, reg *prometheus.Registry, key string) error {
				defer starving(ns)()
				return queuedBehindPaused(t, ns, reg, node.Addr(), key, context.Background())
			},
			want: wantOverloaded,
		},
		{
			name: "queued past the cap behind calls the node answers",
			opts: Options{Timeout: 10 * time.Second, MaxQueueWait: 5 * time.Millisecond, PipelinesPerNode: 1, MaxBatch: 1},
			only: new(false),
			run: func(t *testing.T, ns *Nodes, _ *prometheus.Registry, key string) error {
				mustIncr(t, ns, key, 1) // connected
				// 1,000 callers, one call in flight at a time: the last
				// wait far longer than 5 ms while the node answers.
				const callers = 1000
				errs := make(chan error, callers)
				for i := range callers {
					go func() {
						_, err := incr(context.Background(), ns, fmt.Sprint(key, i), 1)
						errs <- err
					}()
				}
				// One overloaded answer is enough; on a busy machine a
				// pipeline may take longer than 5 ms, and a call queued
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
			run: func(t *testing.T, ns *Nodes, reg *prometheus.Registry, key string) error {
				ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
				defer cancel()
				return queuedBehindPaused(t, ns, reg, node.Addr(), key, ctx)
			},
			want: wantOverloaded, stalledCoalesced: true, cause: context.DeadlineExceeded,
		},
		{
			name: "no reply within the timeout",
			opts: Options{Timeout: 50 * time.Millisecond},
			run: func(t *testing.T, ns *Nodes, _ *prometheus.Registry, key string) error {
				mustIncr(t, ns, key, 1) // connected
				unpause := redistest.Pause(t, node.Addr())
				defer unpause()
				_, err := incr(context.Background(), ns, key, 1)
				return err
			},
			want: wantUnknown,
		},
		{
			name: "caller deadline passes after the write",
			opts: Options{Timeout: 10 * time.Second},
			only: new(false), // with NoCoalesce the reply wait is Options.Timeout
			run: func(t *testing.T, ns *Nodes, _ *prometheus.Registry, key string) error {
				mustIncr(t, ns, key, 1)
				unpause := redistest.Pause(t, node.Addr())
				defer unpause()
				ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
				defer cancel()
				_, err := incr(ctx, ns, key, 1)
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
				ns, reg := newTestNodes(t, opts)
				key := "errors-" + name
				began := time.Now().UnixNano()
				err := tt.run(t, ns, reg, key)
				if err == nil {
					t.Fatal("no error")
				}
				isOverloaded, isUnknown := errors.Is(err, bucket.ErrOverloaded), errors.Is(err, bucket.ErrOutcomeUnknown)
				switch {
				case tt.stalledCoalesced && !noCoalesce && isOverloaded && !isUnknown && ns.sched.late.Load() >= began:
					// A busy machine left this process unscheduled during
					// the case: overload is then the right answer.
					t.Logf("error %v: overloaded, as this process went unscheduled during the case", err)
				case tt.stalledCoalesced && !noCoalesce:
					if !errors.Is(err, ErrNodeStalled) || isOverloaded || isUnknown {
						t.Fatalf("error %v: want ErrNodeStalled only", err)
					}
				case tt.want == wantOverloaded:
					if !isOverloaded || isUnknown {
						t.Fatalf("error %v: want overloaded only", err)
					}
				case tt.want == wantUnknown:
					if !isUnknown || isOverloaded {
						t.Fatalf("error %v: want outcome unknown only", err)
					}
				}
				if tt.cause != nil && !errors.Is(err, tt.cause) {
					t.Errorf("error %v does not wrap %v", err, tt.cause)
				}
			})
		}
	}

	// Not applied: a stopped node. The first calls fail to connect, then
	// the breaker opens; neither is overload or an unknown outcome.
	for _, noCoalesce := range []bool{false, true} {
		t.Run(map[bool]string{false: "connection refused/coalesced", true: "connection refused/one-by-one"}[noCoalesce], func(t *testing.T) {
			stopped := redistest.NewNode(t)
			stopped.Stop()
			ns, _ := newTestNodes(t, Options{Addrs: []string{stopped.Addr()}, Mode: ModeStandalone, NoCoalesce: noCoalesce, Timeout: time.Second})
			var errs []error
			for range breakerConnFailures + 1 {
				_, err := incr(context.Background(), ns, "k", 1)
				if err == nil {
					t.Fatal("a call on a stopped node succeeded")
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

// starving marks ns's scheduling watch late every millisecond until the
// returned stop is called, as when a host's CPUs are all busy.
func starving(ns *Nodes) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(time.Millisecond)
		defer t.Stop()
		for {
			ns.sched.late.Store(time.Now().UnixNano())
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	})
	return func() { close(done); wg.Wait() }
}

// queuedBehindPaused makes the one connection (or pipeline) to addr busy
// with a call the paused node does not answer, then returns the error of a
// second call, made with ctx, that can only wait behind it. The first call
// is answered once the node resumes, and it alone ran: the second was
// never sent.
func queuedBehindPaused(t *testing.T, ns *Nodes, reg *prometheus.Registry, addr, key string, ctx context.Context) error {
	t.Helper()
	before := mustIncr(t, ns, key, 1) // connected
	unpause := redistest.Pause(t, addr)
	first := make(chan error, 1)
	go func() {
		_, err := incr(context.Background(), ns, key, 1)
		first <- err
	}()
	n := ns.node(addr)
	if ns.coalesce {
		testenv.WaitFor(t, "sending the first call", func() bool { return testenv.SampleCount(t, reg, "limiter_store_pipeline_checks") == 2 })
	} else {
		testenv.WaitFor(t, "holding the pool's connection", func() bool {
			st := n.pooled.PoolStats()
			return st.TotalConns == 1 && st.IdleConns == 0
		})
	}
	_, err := incr(ctx, ns, key, 1)
	unpause()
	if ferr := <-first; ferr != nil {
		t.Fatalf("first call: %v", ferr)
	}
	// The first call added 1; the second nothing.
	if got := mustIncr(t, ns, key, 1); got != before+2 {
		t.Fatalf("counter %d after two calls and this one, want %d: the queued call ran", got, before+2)
	}
	return err
}

// TestBreaker: a node that answers slowly a few times keeps its breaker
// closed; a stopped node opens it; it closes again once the node is back.
func TestBreaker(t *testing.T) {
	for _, noCoalesce := range []bool{false, true} {
		t.Run(map[bool]string{false: "coalesced", true: "one-by-one"}[noCoalesce], func(t *testing.T) {
			node := redistest.NewNode(t)
			ns, reg := newTestNodes(t, Options{Addrs: []string{node.Addr()}, Mode: ModeStandalone, NoCoalesce: noCoalesce,
				Timeout: 50 * time.Millisecond, BreakerOpen: 100 * time.Millisecond})
			ctx := context.Background()
			const key = "breaker"
			mustIncr(t, ns, key, 1)

			// More slow answers in a row than the old breaker allowed (5).
			unpause := redistest.Pause(t, node.Addr())
			for i := range 2 * breakerConnFailures {
				_, err := incr(ctx, ns, key, 1)
				if err == nil {
					t.Fatalf("slow call %d answered", i)
				}
				if errors.Is(err, ErrBreakerOpen) {
					t.Fatalf("slow call %d: %v: the breaker opened on slow answers", i, err)
				}
			}
			unpause()
			testenv.WaitFor(t, "answering after the pause", func() bool {
				_, err := incr(ctx, ns, key, 1)
				if errors.Is(err, ErrBreakerOpen) {
					t.Fatalf("after slow answers: %v", err)
				}
				return err == nil
			})
			if got := testenv.MetricValue(t, reg, "limiter_store_breakers_open"); got != 0 {
				t.Fatalf("limiter_store_breakers_open = %v after slow answers, want 0", got)
			}

			node.Stop()
			testenv.WaitFor(t, "open on a stopped node", func() bool {
				_, err := incr(ctx, ns, key, 1)
				if err == nil || errors.Is(err, bucket.ErrOverloaded) {
					t.Fatalf("call on a stopped node: %v", err)
				}
				return errors.Is(err, ErrBreakerOpen)
			})
			if got := testenv.MetricValue(t, reg, "limiter_store_breakers_open"); got != 1 {
				t.Fatalf("limiter_store_breakers_open = %v on a stopped node, want 1", got)
			}

			node.Start()
			testenv.WaitFor(t, "closed once the node is back", func() bool {
				_, err := incr(ctx, ns, key, 1)
				return err == nil
			})
			if got := testenv.MetricValue(t, reg, "limiter_store_breakers_open"); got != 0 {
				t.Fatalf("limiter_store_breakers_open = %v with the node back, want 0", got)
			}
		})
	}
}

// TestLateReplyIsUsed: a reply that comes after the timeout and before the
// reply deadline is Redis's answer, known: it is used, not answered as an
// unknown outcome, and counted as a slow reply.
func TestLateReplyIsUsed(t *testing.T) {
	node := redistest.NewNode(t)
	ns, reg := newTestNodes(t, Options{Addrs: []string{node.Addr()}, Mode: ModeStandalone,
		Timeout: 5 * time.Millisecond, ReplyDeadline: 5 * time.Second})
	mustIncr(t, ns, "late", 1) // connected
	// The first call may itself pass the 5 ms timeout on a busy machine.
	before := testenv.MetricValue(t, reg, "limiter_store_slow_replies_total")
	unpause := redistest.Pause(t, node.Addr())
	go func() {
		time.Sleep(100 * time.Millisecond)
		unpause()
	}()
	if n, err := incr(context.Background(), ns, "late", 1); err != nil || n != 2 {
		t.Fatalf("a call answered 100 ms late = %v, %v; want 2", n, err)
	}
	if got := testenv.MetricValue(t, reg, "limiter_store_slow_replies_total") - before; got != 1 {
		t.Errorf("limiter_store_slow_replies_total rose by %v, want 1", got)
	}
}

// TestRefuse: the calls bound for a refused node fail unsent with an error
// wrapping the reason (not applied), coalesced or not, for a node met
// before or after the refusal, until the refusal is lifted.
func TestRefuse(t *testing.T) {
	node := redistest.NewNode(t)
	reason := errors.New("refused for the test")
	for _, noCoalesce := range []bool{false, true} {
		for _, met := range []bool{false, true} {
			t.Run(fmt.Sprintf("no-coalesce=%v/met=%v", noCoalesce, met), func(t *testing.T) {
				ns, reg := newTestNodes(t, Options{Addrs: []string{node.Addr()}, Mode: ModeStandalone, NoCoalesce: noCoalesce, Timeout: time.Second})
				key := "refuse-" + strconv.FormatBool(noCoalesce) + strconv.FormatBool(met)
				before := int64(0)
				if met {
					before = mustIncr(t, ns, key, 1)
				}
				sent := testenv.SampleCount(t, reg, "limiter_store_pipeline_checks")
				ns.Refuse(node.Addr(), reason)
				_, err := incr(context.Background(), ns, key, 1)
				if !errors.Is(err, reason) || errors.Is(err, bucket.ErrOverloaded) || errors.Is(err, bucket.ErrOutcomeUnknown) {
					t.Fatalf("call on a refused node = %v, want the reason only", err)
				}
				if got := testenv.SampleCount(t, reg, "limiter_store_pipeline_checks"); got != sent {
					t.Fatalf("%d pipelines sent to a refused node", got-sent)
				}
				ns.Refuse(node.Addr(), nil)
				if got := mustIncr(t, ns, key, 1); got != before+1 {
					t.Fatalf("counter %d once the refusal is lifted, want %d", got, before+1)
				}
			})
		}
	}
}
