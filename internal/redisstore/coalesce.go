package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// Defaults of coalescing and the breaker.
const (
	DefaultMaxBatch         = 128
	DefaultPipelinesPerNode = 2
	DefaultBreakerOpen      = 2 * time.Second
	// breakerFailures in a row open a node's breaker.
	breakerFailures = 5
)

// ErrBreakerOpen is returned, without calling Redis, for a check bound for
// a node whose circuit breaker is open.
var ErrBreakerOpen = errors.New("redis node circuit breaker open")

// call is one check waiting for its node's next pipeline.
type call struct {
	ctx    context.Context
	key    string
	script int
	args   [3]string
	limit  float64
	done   chan result
}

type result struct {
	d   bucket.Decision
	err error
}

var callPool = sync.Pool{New: func() any { return &call{done: make(chan result, 1)} }}

// node is one primary's queue: checks bound for it wait there and go out
// together, as one pipeline, while the previous pipelines are in flight
// (no timer: a lone check goes out at once). Its breaker stops calling a
// node that keeps failing, and lets a probe through after a while.
type node struct {
	s       *Store
	client  *redis.Client
	calls   chan *call
	breaker *gobreaker.CircuitBreaker[struct{}]
}

// queueFor returns the queue of the primary serving key.
func (s *Store) queueFor(ctx context.Context, key string) (*node, error) {
	client, ok := s.client.(*redis.Client)
	if !ok {
		var err error
		if client, err = s.client.(*redis.ClusterClient).MasterForKey(ctx, key); err != nil {
			return nil, err
		}
	}
	addr := client.Options().Addr
	s.nodesMu.RLock()
	n := s.nodes[addr]
	s.nodesMu.RUnlock()
	if n != nil {
		return n, nil
	}
	s.nodesMu.Lock()
	defer s.nodesMu.Unlock()
	if n = s.nodes[addr]; n != nil {
		return n, nil
	}
	n = &node{s: s, client: client, calls: make(chan *call, 4*s.maxBatch)}
	n.breaker = gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{
		Name:        addr,
		MaxRequests: 1,
		Timeout:     s.breakerOpen,
		ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= breakerFailures },
		OnStateChange: func(_ string, from, to gobreaker.State) {
			s.m.breakerTransitions.WithLabelValues(to.String()).Inc()
			switch {
			case to == gobreaker.StateOpen:
				s.m.breakersOpen.Inc()
			case from == gobreaker.StateOpen:
				s.m.breakersOpen.Dec()
			}
		},
	})
	s.nodes[addr] = n
	for range s.pipelines {
		s.workers.Go(func() { n.work(s.life) })
	}
	return n, nil
}

// takeCoalesced queues one check on its node and waits for the answer.
func (s *Store) takeCoalesced(ctx context.Context, i int, key string, a [3]string, capacity float64) (bucket.Decision, error) {
	n, err := s.queueFor(ctx, key)
	if err != nil {
		return bucket.Decision{}, err
	}
	c := callPool.Get().(*call)
	c.ctx, c.key, c.script, c.args, c.limit = ctx, key, i, a, capacity
	select {
	case n.calls <- c:
	case <-ctx.Done():
		callPool.Put(c)
		return bucket.Decision{}, ctx.Err()
	}
	// The worker always answers: with the result, or with the context's
	// error if it finds the context done.
	r := <-c.done
	c.ctx = nil
	callPool.Put(c)
	return r.d, r.err
}

// work sends the node's queued checks, a pipeline at a time.
func (n *node) work(life context.Context) {
	batch := make([]*call, 0, n.s.maxBatch)
	for {
		select {
		case c := <-n.calls:
			batch = append(batch[:0], c)
		case <-life.Done():
			return
		}
	more:
		for len(batch) < n.s.maxBatch {
			select {
			case c := <-n.calls:
				batch = append(batch, c)
			default:
				break more
			}
		}
		n.run(batch)
	}
}

// run sends one pipeline and answers every call in it.
func (n *node) run(batch []*call) {
	live := batch[:0]
	var deadline time.Time
	for _, c := range batch {
		if err := c.ctx.Err(); err != nil {
			c.done <- result{err: err}
			continue
		}
		dl, ok := c.ctx.Deadline()
		if !ok {
			dl = time.Now().Add(n.s.timeout)
		}
		if deadline.IsZero() || dl.After(deadline) {
			deadline = dl
		}
		live = append(live, c)
	}
	if len(live) == 0 {
		return
	}
	n.s.m.batchSize.Observe(float64(len(live)))
	// The pipeline lives until the last deadline of its calls; a call whose
	// own deadline passes first is answered as failed by its context.
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	start := time.Now()
	cmds := make([]*redis.Cmd, len(live))
	_, err := n.breaker.Execute(func() (struct{}, error) {
		pipe := n.client.Pipeline()
		for i, c := range live {
			cmds[i] = n.s.scripts[c.script].EvalSha(ctx, pipe, []string{c.key}, c.args[0], c.args[1], c.args[2])
		}
		_, _ = pipe.Exec(ctx)
		var retry []int
		for i, cmd := range cmds {
			if e := cmd.Err(); e != nil && strings.HasPrefix(e.Error(), "NOSCRIPT") {
				retry = append(retry, i)
			}
		}
		if len(retry) > 0 {
			// The node lost the scripts (restart, failover): nothing ran for
			// these calls, so sending the text is safe.
			pipe = n.client.Pipeline()
			for _, i := range retry {
				c := live[i]
				cmds[i] = n.s.scripts[c.script].Eval(ctx, pipe, []string{c.key}, c.args[0], c.args[1], c.args[2])
			}
			_, _ = pipe.Exec(ctx)
		}
		return struct{}{}, nodeError(cmds)
	})
	elapsed := time.Since(start).Seconds()
	for i, c := range live {
		n.s.m.scriptDuration[c.script].Observe(elapsed)
		if err != nil && cmds[i] == nil {
			// The breaker refused the pipeline.
			n.s.m.errors.Inc()
			c.done <- result{err: fmt.Errorf("%w: %s", ErrBreakerOpen, n.client.Options().Addr)}
			continue
		}
		res, cerr := cmds[i].Slice()
		if cerr != nil && isRedirect(cerr) {
			// A failover or a resharding moved the slot: this once, let
			// the cluster client follow the redirect.
			n.s.reroute()
			res, cerr = n.s.scripts[c.script].Run(c.ctx, n.s.client, []string{c.key}, c.args[0], c.args[1], c.args[2]).Slice()
		}
		if cerr != nil {
			n.s.m.errors.Inc()
			c.done <- result{err: fmt.Errorf("eval %s: %w", scriptAlgorithms[c.script], cerr)}
			continue
		}
		d, perr := parseDecision(res, c.limit)
		if perr != nil {
			n.s.m.errors.Inc()
		}
		c.done <- result{d: d, err: perr}
	}
}

// nodeError is the first failure of the node itself (connection, timeout),
// not of a script, among a pipeline's commands: what the breaker counts.
func nodeError(cmds []*redis.Cmd) error {
	for _, cmd := range cmds {
		err := cmd.Err()
		if err == nil || errors.Is(err, redis.Nil) {
			continue
		}
		var rerr redis.Error
		if errors.As(err, &rerr) {
			continue
		}
		return err
	}
	return nil
}

func isRedirect(err error) bool {
	msg := err.Error()
	return strings.HasPrefix(msg, "MOVED ") || strings.HasPrefix(msg, "ASK ") || strings.HasPrefix(msg, "TRYAGAIN") ||
		strings.HasPrefix(msg, "CLUSTERDOWN")
}

// reroute refreshes the cluster's slot map, at most once a second.
func (s *Store) reroute() {
	cc, ok := s.client.(*redis.ClusterClient)
	if !ok {
		return
	}
	now := time.Now().UnixNano()
	last := s.lastReload.Load()
	if now-last < int64(time.Second) || !s.lastReload.CompareAndSwap(last, now) {
		return
	}
	go cc.ReloadState(context.Background())
}

type coalesceMetrics struct {
	batchSize          prometheus.Observer
	breakersOpen       prometheus.Gauge
	breakerTransitions *prometheus.CounterVec
}

func newCoalesceMetrics(reg prometheus.Registerer) (coalesceMetrics, error) {
	batch := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "limiter_store_pipeline_checks",
		Help:    "Checks sent together in one pipeline to one Redis node.",
		Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128},
	})
	open := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "limiter_store_breakers_open",
		Help: "Redis nodes whose circuit breaker is open (not called until a probe succeeds).",
	})
	trans := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "limiter_store_breaker_transitions_total",
		Help: "Circuit breaker state changes, by the state entered.",
	}, []string{"state"})
	for _, c := range []prometheus.Collector{batch, open, trans} {
		if err := reg.Register(c); err != nil {
			return coalesceMetrics{}, err
		}
	}
	for _, st := range []gobreaker.State{gobreaker.StateClosed, gobreaker.StateHalfOpen, gobreaker.StateOpen} {
		trans.WithLabelValues(st.String())
	}
	return coalesceMetrics{batchSize: batch, breakersOpen: open, breakerTransitions: trans}, nil
}
