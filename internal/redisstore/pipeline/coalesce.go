package pipeline

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// Defaults of Options: coalescing and the breaker.
const (
	DefaultMaxBatch         = 128
	DefaultPipelinesPerNode = 2
	DefaultBreakerOpen      = 2 * time.Second
	// DefaultLinger is how long a worker holds a pipeline that is not full
	// while another pipeline to its node is in flight: its checks go when
	// that one is answered, the batch is full, or this has passed.
	DefaultLinger = 200 * time.Microsecond
)

// A node's circuit breaker opens on evidence that the node is unhealthy,
// never on a few slow answers (a slow answer is as likely a busy limiterd as
// a busy Redis, and an open breaker hands the node's checks to the
// fallback):
//   - breakerConnFailures connection errors in a row open it: dials that
//     fail (refused, unreachable, timed out) or connections the node closed
//     or reset. A dial to a stopped node fails at once, so this is quick.
//   - over a rolling window of breakerWindow (in steps of breakerBucket),
//     at least breakerMinCalls calls of which at least breakerFailureRatio
//     failed (replies that timed out count here) open it: a node that
//     answers but mostly too late.
//
// A call is one pipeline (or, with NoCoalesce, one check). Checks refused
// as overloaded are not counted: they never reached the node. Once open, it
// refuses calls (ErrBreakerOpen, nothing sent) for Options.BreakerOpen,
// then lets one call through, and closes when that call gets its replies.
const (
	breakerConnFailures = 3
	breakerWindow       = 10 * time.Second
	breakerBucket       = time.Second
	breakerMinCalls     = 20
	breakerFailureRatio = 0.5
)

// staleAfter is how long a worker's connection may stay idle before it is
// pinged again before carrying checks: a node that restarted meanwhile is
// then found by the ping (nothing sent) instead of by a pipeline of checks
// whose outcome would be unknown.
const staleAfter = time.Second

// errNothingSent ends a breaker call that sent nothing; it is not counted.
var errNothingSent = errors.New("nothing sent")

// node is one primary: its queue of checks, the workers that send them as
// pipelines, its clients and its breaker.
type node struct {
	ns   *Nodes
	addr string
	// base carries the workers' connections: the context of each pipeline
	// has the store timeout as its deadline, set when it is written.
	base *redis.Client
	// pooled carries the checks sent one by one (NoCoalesce, redirects):
	// its sockets take no deadline from the context (which bounds the wait
	// for a connection and the dial) and the store timeout from the write.
	pooled       *redis.Client
	calls        chan *call
	breaker      *gobreaker.CircuitBreaker[struct{}]
	connFailures atomic.Int32
	// refused, when set, is why the node's checks are not sent (see
	// Nodes.Refuse).
	refused atomic.Pointer[refusal]
	// inFlight counts the pipelines being sent (their connection made, or
	// their replies awaited); answered is when one last got its replies
	// (ns since the Unix epoch). A check that waited its whole queue wait
	// while pipelines were in flight and none was answered waited for the
	// node, not for limiterd: see stalled.
	inFlight atomic.Int32
	answered atomic.Int64
	// idle is signalled (without blocking) each time a pipeline to the
	// node gets its replies, for a worker lingering on its batch.
	idle chan struct{}
}

// refusal is the reason given to Nodes.Refuse.
type refusal struct{ reason error }

// refusedError returns the error of a check the node does not send, or nil
// when it sends them.
func (n *node) refusedError() error {
	if r := n.refused.Load(); r != nil {
		return fmt.Errorf("redis %s: %w: its checks are not sent", n.addr, r.reason)
	}
	return nil
}

// stalled reports that the node answered no pipeline since queued (ns since
// the Unix epoch) while some are in flight, and this process was scheduled
// on time meanwhile (see schedWatch): a check queued then waited for the
// node.
func (n *node) stalled(queued int64) bool {
	return n.inFlight.Load() > 0 && n.answered.Load() < queued && !n.ns.sched.starvedSince(queued, time.Now())
}

// nodeFor returns the node of the primary serving key.
func (ns *Nodes) nodeFor(ctx context.Context, key string) (*node, error) {
	if ns.closed.Load() {
		return nil, redis.ErrClosed
	}
	be := ns.be.Load()
	if be == nil || !ns.ready.Load() {
		return nil, ErrNotConnected
	}
	addr := ns.opts.Addrs[0]
	if cc, ok := be.admin.(*redis.ClusterClient); ok {
		c, err := cc.MasterForKey(ctx, key)
		if err != nil {
			return nil, fmt.Errorf("slot of key: %w", err)
		}
		addr = c.Options().Addr
	}
	n := ns.node(addr)
	if err := n.refusedError(); err != nil {
		return nil, err
	}
	return n, nil
}

// node returns the node of addr, making it on first use.
func (ns *Nodes) node(addr string) *node {
	ns.nodesMu.RLock()
	n := ns.nodes[addr]
	ns.nodesMu.RUnlock()
	if n != nil {
		return n
	}
	ns.nodesMu.Lock()
	defer ns.nodesMu.Unlock()
	if n = ns.nodes[addr]; n != nil {
		return n
	}
	pooled := ns.nodeOptions(addr)
	pooled.ContextTimeoutEnabled = false
	pooled.ReadTimeout, pooled.WriteTimeout = ns.replyDeadline, ns.replyDeadline
	pooled.PoolTimeout = ns.maxQueueWait
	n = &node{ns: ns, addr: addr, base: redis.NewClient(ns.nodeOptions(addr)), pooled: redis.NewClient(pooled),
		calls: make(chan *call, 4*ns.maxBatch), idle: make(chan struct{}, 1)}
	if reason := ns.refused[addr]; reason != nil {
		n.refused.Store(&refusal{reason})
	}
	n.breaker = gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{
		Name:         addr,
		MaxRequests:  1,
		Interval:     breakerWindow,
		BucketPeriod: breakerBucket,
		Timeout:      ns.breakerOpen,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			if n.connFailures.Load() >= breakerConnFailures {
				return true
			}
			done := c.TotalSuccesses + c.TotalFailures
			return done >= breakerMinCalls && float64(c.TotalFailures) >= breakerFailureRatio*float64(done)
		},
		IsExcluded: func(err error) bool { return errors.Is(err, errNothingSent) },
		OnStateChange: func(_ string, from, to gobreaker.State) {
			ns.m.breakerTransitions.WithLabelValues(to.String()).Inc()
			switch {
			case to == gobreaker.StateOpen:
				ns.m.breakersOpen.Inc()
			case from == gobreaker.StateOpen:
				ns.m.breakersOpen.Dec()
			}
		},
	})
	ns.nodes[addr] = n
	if ns.coalesce && !ns.closed.Load() {
		for range ns.pipelines {
			ns.workers.Go(func() { n.work(ns.life) })
		}
	}
	return n
}

func (n *node) close() error {
	return errors.Join(n.base.Close(), n.pooled.Close())
}

// noteFailure counts a failed call toward the breaker's connection errors
// in a row. It runs inside the breaker's call, before ReadyToTrip.
func (n *node) noteFailure(err error) {
	if isConnectionError(err) {
		n.connFailures.Add(1)
	}
}

// errSlowReply marks, for the breaker, a pipeline whose replies came after
// the store timeout: they are used, and the breaker counts a failure.
var errSlowReply = errors.New("redis replies later than the store timeout")

func breakerRefused(err error) bool {
	return errors.Is(err, gobreaker.ErrOpenState) || errors.Is(err, gobreaker.ErrTooManyRequests)
}

// result is the outcome of one store call: the script's reply, or an error
// and what it means (f). A coalesced call that was sent also says when its
// pipeline was written and how many calls it carried, for its span.
type result struct {
	res   []any
	f     failure
	err   error
	sent  time.Time
	batch int
}

// Eval runs sc on the primary that serves key (coalesced into that node's
// next pipeline, unless Options.NoCoalesce) and returns the script's reply.
// dur observes the time of its round trip (for a coalesced call, of its
// pipeline). Replies that say nothing ran and where to go are followed
// (see follow). The error wraps bucket.ErrOverloaded when sc was never
// sent because it waited too long, bucket.ErrOutcomeUnknown when it was
// sent and no reply came in time; any other error means it did not run.
func (ns *Nodes) Eval(ctx context.Context, key string, sc Call, dur prometheus.Observer) ([]any, error) {
	return ns.evalOn(ctx, key, sc, func(n *node) result { return n.eval(ctx, sc, dur) })
}

// EvalOnce runs sc on the primary that serves key, on its own (never
// coalesced, never re-sent) under that node's breaker, and returns the
// script's reply: for scripts that must not run twice, such as an undo or
// a refund, which a cluster client's pipeline would send again after a
// retryable error of another command of its batch. Replies that say
// nothing ran are followed as Eval follows them. It takes its deadline
// from ctx. The errors are Eval's.
func (ns *Nodes) EvalOnce(ctx context.Context, key string, sc Call) ([]any, error) {
	return ns.evalOn(ctx, key, sc, func(n *node) result { return n.direct(ctx, sc, nil) })
}

// evalOn sends sc with send on the node of key and follows its redirects.
func (ns *Nodes) evalOn(ctx context.Context, key string, sc Call, send func(*node) result) ([]any, error) {
	n, err := ns.nodeFor(ctx, key)
	if err != nil {
		return nil, err
	}
	r := send(n)
	if r.err != nil && isRedirect(r.err) {
		r = ns.follow(ctx, n, r, sc)
	}
	if r.err != nil {
		return nil, r.err
	}
	return r.res, nil
}

// eval sends sc: coalesced into the node's next pipeline, or on its own.
// The call of a sampled check (a recording span in ctx, see
// internal/tracing) is a child span of it; the others pay for one context
// lookup.
func (n *node) eval(ctx context.Context, sc Call, dur prometheus.Observer) result {
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		return n.evalTraced(ctx, span, sc, dur)
	}
	return n.evalUntraced(ctx, sc, dur)
}

func (n *node) evalUntraced(ctx context.Context, sc Call, dur prometheus.Observer) result {
	if !n.ns.coalesce {
		start := time.Now()
		r := n.direct(ctx, sc, nil)
		dur.Observe(time.Since(start).Seconds())
		return r
	}
	c := n.start(sc, dur)
	return n.wait(ctx, c)
}

// tracerName names the tracer of the store calls' spans.
const tracerName = "github.com/limiterd/limiterd/internal/redisstore/pipeline"

// evalTraced is eval of a sampled check, whose span is parent: a client
// span from the moment the call is queued to its reply, with the node, the
// time it waited in limiterd's queue until its pipeline was written
// (limiter.redis.queue_wait_us), the calls of that pipeline, and the error.
func (n *node) evalTraced(ctx context.Context, parent trace.Span, sc Call, dur prometheus.Observer) result {
	queued := time.Now()
	host, port, _ := net.SplitHostPort(n.addr)
	portN, _ := strconv.Atoi(port)
	_, span := parent.TracerProvider().Tracer(tracerName).Start(ctx, "EVALSHA",
		trace.WithSpanKind(trace.SpanKindClient), trace.WithTimestamp(queued),
		trace.WithAttributes(attribute.String("db.system.name", "redis"), attribute.String("db.operation.name", "EVALSHA"),
			attribute.String("server.address", host), attribute.Int("server.port", portN),
			attribute.Bool("limiter.redis.coalesced", n.ns.coalesce)))
	r := n.evalUntraced(ctx, sc, dur)
	if !r.sent.IsZero() {
		span.SetAttributes(attribute.Int64("limiter.redis.queue_wait_us", r.sent.Sub(queued).Microseconds()),
			attribute.Int("limiter.redis.pipeline_calls", r.batch))
	}
	if r.err != nil {
		span.SetStatus(codes.Error, r.err.Error())
	}
	span.End()
	return r
}

// isRedirect reports a reply that the key's slot is served elsewhere, or
// not served right now; the slot map is then reloaded.
func isRedirect(err error) bool {
	if _, ok := redis.IsMovedError(err); ok {
		return true
	}
	if _, ok := redis.IsAskError(err); ok {
		return true
	}
	return redis.IsTryAgainError(err) || redis.IsClusterDownError(err)
}

// TryAgainPauses are the pauses before sending a call again that a node
// answered TRYAGAIN (a script of several keys of a slot being migrated,
// some already moved): the migration of a slot's few keys takes
// milliseconds, so a short wait usually finds them in one place. Past
// them, the call is not applied and the rule's on_failure decides.
var TryAgainPauses = []time.Duration{time.Millisecond, 2 * time.Millisecond, 4 * time.Millisecond}

// follow sends sc again after n's reply r said that nothing ran and where
// to go: a MOVED or ASK on the node it names, once; a TRYAGAIN on the same
// node after each of TryAgainPauses, while ctx allows. A CLUSTERDOWN, or
// a reply still saying so, is returned (not applied).
func (ns *Nodes) follow(ctx context.Context, n *node, r result, sc Call) result {
	ns.reroute()
	redirected := false
	pauses := TryAgainPauses
	for r.err != nil {
		if addr, ok := redis.IsMovedError(r.err); ok && !redirected {
			redirected, n = true, ns.node(addr)
			r = n.direct(ctx, sc, nil)
			continue
		}
		if addr, ok := redis.IsAskError(r.err); ok && !redirected {
			redirected = true
			r = ns.node(addr).direct(ctx, sc, func(p redis.Pipeliner) { p.Do(ctx, "asking") })
			continue
		}
		if !redis.IsTryAgainError(r.err) || len(pauses) == 0 {
			break
		}
		t := time.NewTimer(pauses[0])
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return result{f: notApplied, err: r.err}
		}
		pauses = pauses[1:]
		ns.m.tryAgain.Inc()
		r = n.direct(ctx, sc, nil)
	}
	if r.err != nil && isRedirect(r.err) {
		r.f = notApplied
	}
	return r
}

// reroute refreshes the cluster's slot map, at most once a second.
func (ns *Nodes) reroute() {
	be := ns.be.Load()
	if be == nil {
		return
	}
	cc, ok := be.admin.(*redis.ClusterClient)
	if !ok {
		return
	}
	now := time.Now().UnixNano()
	last := ns.lastReload.Load()
	if now-last < int64(time.Second) || !ns.lastReload.CompareAndSwap(last, now) {
		return
	}
	cc.ReloadState(ns.life) // in the background
}

// direct sends sc on its own through the pooled client, under the breaker.
func (n *node) direct(ctx context.Context, sc Call, before func(redis.Pipeliner)) result {
	if err := n.refusedError(); err != nil {
		return result{f: notApplied, err: err}
	}
	var p connPhase
	pctx := withConnPhase(ctx, &p)
	var r result
	_, err := n.breaker.Execute(func() (struct{}, error) {
		cmds, _ := runScripts(pctx, n.pooled, []Call{sc}, before)
		res, err := replySlice(cmds[0])
		if err == nil || isReply(err) {
			n.connFailures.Store(0)
			r = result{res: res, f: notApplied, err: err}
			return struct{}{}, nil
		}
		r = result{f: classifyPooled(err, &p), err: err}
		if r.f == overloaded {
			return struct{}{}, errNothingSent
		}
		n.noteFailure(err)
		return struct{}{}, err
	})
	if breakerRefused(err) {
		return result{f: notApplied, err: fmt.Errorf("%w: %s", ErrBreakerOpen, n.addr)}
	}
	if r.err != nil {
		r.err = r.f.wrap(n.addr, r.err)
	}
	return r
}

// replySlice is a script's reply as a slice: a table's elements, or a lone
// value (an undo's 1, or nothing) as its one element.
func replySlice(cmd *redis.Cmd) ([]any, error) {
	v, err := cmd.Result()
	if errors.Is(err, redis.Nil) {
		return []any{nil}, nil
	}
	if err != nil {
		return nil, err
	}
	if res, ok := v.([]any); ok {
		return res, nil
	}
	return []any{v}, nil
}

// The states of a call. A call is owned by its caller until it is queued;
// then by whichever side moves it to callAbandoned, or by the caller again
// once it received the reply.
const (
	callQueued    int32 = iota // in the node's queue
	callTaken                  // a worker took it; not written yet
	callSent                   // in a pipeline being written or awaiting replies
	callAbandoned              // its caller left; the worker recycles it
)

// call is one check waiting for its node's next pipeline.
type call struct {
	state atomic.Int32
	sc    Call
	dur   prometheus.Observer
	done  chan result
}

var callPool = sync.Pool{New: func() any { return &call{done: make(chan result, 1)} }}

func putCall(c *call) {
	c.sc, c.dur = Call{}, nil
	callPool.Put(c)
}

var timerPool = sync.Pool{New: func() any {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return t
}}

// start makes the call of sc.
func (n *node) start(sc Call, dur prometheus.Observer) *call {
	c := callPool.Get().(*call)
	c.sc, c.dur = sc, dur
	c.state.Store(callQueued)
	return c
}

// wait queues c and waits for its result. The time before a worker sends it
// is bounded by ctx and the queue cap: past either, it is taken back unsent
// and the result is an error wrapping bucket.ErrOverloaded. Once sent, the
// wait for the reply is bounded by the store timeout, which the worker
// applies from the write, and by ctx: a caller that gives up then gets an
// error wrapping bucket.ErrOutcomeUnknown.
func (n *node) wait(ctx context.Context, c *call) result {
	queued := time.Now().UnixNano()
	t := timerPool.Get().(*time.Timer)
	t.Reset(n.ns.maxQueueWait)
	defer func() {
		t.Stop()
		timerPool.Put(t)
	}()
	select {
	case n.calls <- c:
	case <-t.C:
		putCall(c)
		return n.overloaded(nil, queued)
	case <-ctx.Done():
		putCall(c)
		return n.overloaded(ctx.Err(), queued)
	}
	var cause error
	select {
	case r := <-c.done:
		putCall(c)
		return r
	case <-t.C:
	case <-ctx.Done():
		cause = ctx.Err()
	}
	if c.state.CompareAndSwap(callQueued, callAbandoned) {
		return n.overloaded(cause, queued)
	}
	// A worker has it: it is being sent, or its connection is being made.
	select {
	case r := <-c.done:
		putCall(c)
		return r
	case <-ctx.Done():
	}
	select {
	case r := <-c.done:
		putCall(c)
		return r
	default:
	}
	if c.state.CompareAndSwap(callTaken, callAbandoned) {
		return result{f: notApplied, err: fmt.Errorf("redis %s: connecting: %w", n.addr, ctx.Err())}
	}
	// Sent: the worker answers into c.done, which nobody reads; c is left
	// to the garbage collector.
	c.state.CompareAndSwap(callSent, callAbandoned)
	return result{f: unknown, err: unknown.wrap(n.addr, ctx.Err())}
}

// overloaded is the result of a check taken back unsent from the queue,
// which it joined at queued (ns since the Unix epoch): limiterd's overload,
// unless the node answered nothing meanwhile while pipelines to it were in
// flight and limiterd was scheduled on time; then the node is stalled, a
// store failure like a node down.
func (n *node) overloaded(cause error, queued int64) result {
	if n.stalled(queued) {
		err := fmt.Errorf("redis %s: %w: waited %v in its queue and no pipeline to it was answered meanwhile; nothing sent",
			n.addr, ErrNodeStalled, time.Duration(time.Now().UnixNano()-queued).Round(time.Millisecond))
		if cause != nil {
			err = fmt.Errorf("%w: %w", err, cause)
		}
		return result{f: notApplied, err: err}
	}
	err := fmt.Errorf("%w: waited %v in the queue of %s", bucket.ErrOverloaded, n.ns.maxQueueWait, n.addr)
	if cause != nil {
		err = fmt.Errorf("%w: in the queue of %s: %w", bucket.ErrOverloaded, n.addr, cause)
	}
	return result{f: overloaded, err: err}
}

// answer hands r to c's caller, unless the caller left.
func answer(c *call, r result) {
	if c.state.Load() == callAbandoned {
		putCall(c)
		return
	}
	c.done <- r
}

// workerConn is a worker's own connection to its node.
type workerConn struct {
	n    *node
	conn *redis.Conn
	used time.Time
}

// ready makes sure the worker has a connection that answers: it opens one
// (dial, handshake and a PING, within the dial timeout) when it has none,
// and pings one idle for staleAfter. An error means nothing was sent.
func (w *workerConn) ready(life context.Context) error {
	if w.conn != nil && time.Since(w.used) < staleAfter {
		return nil
	}
	ping := func() error {
		ctx, cancel := context.WithTimeout(life, w.n.ns.dialTimeout)
		defer cancel()
		return w.conn.Ping(ctx).Err()
	}
	if w.conn != nil {
		if ping() == nil {
			w.used = time.Now()
			return nil
		}
		w.close()
	}
	w.conn = w.n.base.Conn()
	if err := ping(); err != nil {
		w.close()
		return err
	}
	w.used = time.Now()
	return nil
}

func (w *workerConn) close() {
	if w.conn != nil {
		_ = w.conn.Close() // a connection that failed is dropped, not pooled
		w.conn = nil
	}
}

// work sends the node's queued checks, a pipeline at a time: those that
// queued while the previous pipelines were in flight go out together (no
// timer: a lone check goes out at once when no other pipeline to the node
// is in flight). While one is, a batch that is not full lingers (see
// linger), so that under load the node gets fewer, fuller pipelines: its
// CPU per check is mostly the reading and writing of each pipeline.
func (n *node) work(life context.Context) {
	w := &workerConn{n: n}
	defer w.close()
	batch := make([]*call, 0, n.ns.maxBatch)
	var timer *time.Timer
	if n.ns.linger > 0 {
		timer = time.NewTimer(time.Hour)
		timer.Stop()
		defer timer.Stop()
	}
	for {
		batch = batch[:0]
		select {
		case c := <-n.calls:
			batch = take(batch, c)
		case <-life.Done():
			return
		}
		batch = n.drain(batch)
		if timer != nil && len(batch) > 0 && len(batch) < n.ns.maxBatch {
			batch = n.linger(life, batch, timer)
		}
		if len(batch) > 0 {
			n.run(life, w, batch)
		}
	}
}

// drain adds the calls already queued to batch, up to its bound.
func (n *node) drain(batch []*call) []*call {
	for len(batch) < n.ns.maxBatch {
		select {
		case c := <-n.calls:
			batch = take(batch, c)
		default:
			return batch
		}
	}
	return batch
}

// linger keeps adding calls to batch while another pipeline to the node is
// in flight: until that one is answered, the batch is full, or the linger
// (Options.Linger) has passed. With no pipeline in flight it returns at
// once, so a lone check never waits.
func (n *node) linger(life context.Context, batch []*call, timer *time.Timer) []*call {
	select {
	case <-n.idle: // a signal from before this batch
	default:
	}
	if n.inFlight.Load() == 0 {
		return batch
	}
	timer.Reset(n.ns.linger)
	defer timer.Stop()
	for len(batch) < n.ns.maxBatch {
		select {
		case c := <-n.calls:
			batch = n.drain(take(batch, c))
		case <-n.idle:
			return batch
		case <-timer.C:
			n.ns.m.lingerExpired.Inc()
			return batch
		case <-life.Done():
			return batch
		}
	}
	return batch
}

// take adds c to batch, unless its caller left.
func take(batch []*call, c *call) []*call {
	if c.state.CompareAndSwap(callQueued, callTaken) {
		return append(batch, c)
	}
	putCall(c)
	return batch
}

// run sends one pipeline and answers every call in it.
func (n *node) run(life context.Context, w *workerConn, batch []*call) {
	if err := n.refusedError(); err != nil {
		for _, c := range batch {
			answer(c, result{f: notApplied, err: err})
		}
		return
	}
	var (
		connectErr error
		live       []*call
		cmds       []*redis.Cmd
		start      time.Time
	)
	n.inFlight.Add(1)
	inFlight := true
	done := func() {
		if inFlight {
			inFlight = false
			n.inFlight.Add(-1)
			select {
			case n.idle <- struct{}{}:
			default:
			}
		}
	}
	defer done()
	_, err := n.breaker.Execute(func() (struct{}, error) {
		if connectErr = w.ready(life); connectErr != nil {
			n.noteFailure(connectErr)
			return struct{}{}, connectErr
		}
		live = batch[:0]
		for _, c := range batch {
			if c.state.CompareAndSwap(callTaken, callSent) {
				live = append(live, c)
			} else {
				putCall(c) // its caller left while the connection was made
			}
		}
		if len(live) == 0 {
			return struct{}{}, errNothingSent
		}
		n.ns.m.batchSize.Observe(float64(len(live)))
		calls := make([]Call, len(live))
		for i, c := range live {
			calls[i] = c.sc
		}
		// The store timeout starts here, when the pipeline is written; a
		// late reply is still waited for, up to the reply deadline.
		start = time.Now()
		ctx, cancel := context.WithDeadline(context.Background(), start.Add(n.ns.replyDeadline))
		cmds, _ = runScripts(ctx, w.conn, calls, nil)
		cancel()
		w.used = time.Now()
		done() // a lingering worker may send now
		for _, cmd := range cmds {
			if err := cmd.Err(); err != nil && !isReply(err) {
				// A timeout or a broken connection: replies may still
				// come, so the connection is not used again.
				w.close()
				n.noteFailure(err)
				return struct{}{}, err
			}
		}
		n.connFailures.Store(0)
		n.answered.Store(w.used.UnixNano())
		if w.used.Sub(start) > n.ns.timeout {
			// Decided, but late: evidence against the node.
			return struct{}{}, errSlowReply
		}
		return struct{}{}, nil
	})
	if errors.Is(err, errSlowReply) {
		n.ns.m.slowReplies.Add(float64(len(live)))
		err = nil
	}
	switch {
	case breakerRefused(err):
		err = fmt.Errorf("%w: %s", ErrBreakerOpen, n.addr)
		for _, c := range batch {
			answer(c, result{f: notApplied, err: err})
		}
		return
	case connectErr != nil:
		err := notApplied.wrap(n.addr, fmt.Errorf("connect: %w", connectErr))
		for _, c := range batch {
			answer(c, result{f: notApplied, err: err})
		}
		return
	case len(live) == 0:
		return
	}
	elapsed := time.Since(start).Seconds()
	for i, c := range live {
		c.dur.Observe(elapsed)
		res, err := cmds[i].Slice()
		switch {
		case err == nil:
			answer(c, result{res: res, sent: start, batch: len(live)})
		case isReply(err):
			answer(c, result{f: notApplied, err: err, sent: start, batch: len(live)})
		default:
			answer(c, result{f: unknown, err: unknown.wrap(n.addr, err), sent: start, batch: len(live)})
		}
	}
}
