// Package pipeline carries script calls to the primaries of a Redis Cluster
// (or to one Redis server): a queue per node whose workers send the calls
// as pipelines, a circuit breaker per node, the slot map and its redirects,
// and the background probe that connects and keeps the scripts loaded.
//
// A call's error says what happened to it: bucket.ErrOverloaded (never
// sent: it waited in the node's queue past its deadline or
// Options.MaxQueueWait), bucket.ErrOutcomeUnknown (sent, and no reply came
// within Options.Timeout: it may have run), and any other error (a node
// refused the connection, its breaker is open, the nodes are not connected,
// Redis answered an error) means nothing ran.
package pipeline

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// Defaults of Options.
const (
	// DefaultTimeout bounds the wait for a store reply, from the moment the
	// command is written to Redis.
	DefaultTimeout = 5 * time.Millisecond
	// DefaultMaxQueueWait bounds the time a check waits in limiterd's own
	// queue (or for a pooled connection) before it is sent.
	DefaultMaxQueueWait = 50 * time.Millisecond
	// DefaultReplyDeadline bounds the wait for a reply that is late (past
	// the timeout): until then it is still used, since the store decided.
	DefaultReplyDeadline = 100 * time.Millisecond
	// DefaultDialTimeout bounds opening a connection to a node, its
	// handshake included.
	DefaultDialTimeout = 250 * time.Millisecond
)

// Options configure the connections to Redis and the sending of calls.
type Options struct {
	// Addrs are the seed nodes of a cluster, or one standalone server.
	Addrs []string
	// Mode tells a cluster from a standalone server; the zero value,
	// ModeAuto, takes more than one address for a cluster and asks one
	// address when it first answers.
	Mode Mode
	// Username and Password authenticate (Redis ACL), when set.
	Username, Password string
	// TLS, when set, is used for every connection.
	TLS *tls.Config
	// Timeout bounds the wait for the reply of a check, from the moment it
	// is written to Redis; time in limiterd's queue does not count (see
	// MaxQueueWait). A check that was written and got no reply in time
	// fails with an error wrapping bucket.ErrOutcomeUnknown. 0 means
	// DefaultTimeout.
	Timeout time.Duration
	// MaxQueueWait bounds the time a check waits before it is sent: in its
	// node's queue, or for a connection of the pool with NoCoalesce. The
	// caller's deadline bounds it too. Past it the check fails, unsent,
	// with an error wrapping bucket.ErrOverloaded. 0 means
	// DefaultMaxQueueWait.
	MaxQueueWait time.Duration
	// ReplyDeadline bounds the wait for a reply past Timeout: a reply that
	// comes after Timeout and before ReplyDeadline is used (the store
	// decided, and the outcome is known) but counts as a slow reply, which
	// the node's breaker takes as a failure; one that has not come by then
	// fails with an error wrapping bucket.ErrOutcomeUnknown. A loaded host
	// delays replies past a tight Timeout (the store, or this process,
	// waits for a core) without anything being wrong. 0 means
	// DefaultReplyDeadline; less than Timeout means Timeout.
	ReplyDeadline time.Duration
	// DialTimeout bounds opening a connection to a node (0:
	// DefaultDialTimeout).
	DialTimeout time.Duration
	// PoolSize is the pool size per node; 0 lets go-redis choose.
	PoolSize int
	// NoCoalesce sends every check on its own instead of batching the
	// checks bound for one node into one pipeline.
	NoCoalesce bool
	// MaxBatch bounds the checks in one pipeline (0: DefaultMaxBatch).
	MaxBatch int
	// PipelinesPerNode is how many pipelines may be in flight to one node
	// (0: DefaultPipelinesPerNode).
	PipelinesPerNode int
	// Linger is how long a batch that is not full waits for more checks
	// while another pipeline to its node is in flight (0: none; see
	// DefaultLinger). It must be less than MaxQueueWait.
	Linger time.Duration
	// BreakerOpen is how long a node's open breaker refuses calls before
	// it lets a probe through (0: DefaultBreakerOpen).
	BreakerOpen time.Duration
}

// Check reports options that New refuses whatever the other fields say: no
// address, or several for a standalone server.
func (o Options) Check() error {
	if len(o.Addrs) == 0 {
		return errors.New("redis: no addresses")
	}
	if o.Mode == ModeStandalone && len(o.Addrs) > 1 {
		return fmt.Errorf("redis: %d addresses for a standalone server", len(o.Addrs))
	}
	return nil
}

// Call is one script to run on one slot: its KEYS and ARGV.
type Call struct {
	Script *redis.Script
	Keys   []string
	Args   []any
}

// Nodes sends calls to the primaries of Options.Addrs, each to the node
// that serves its key. It is safe for concurrent use. It serves from New
// on, whether or not Redis answers: it connects in the background (see
// Health), and a call it cannot send fails at once with an error that says
// it did not run. The zero value is not usable; make one with New.
type Nodes struct {
	opts                     Options
	scripts                  []*redis.Script
	timeout, maxQueueWait    time.Duration
	replyDeadline            time.Duration
	dialTimeout, breakerOpen time.Duration
	coalesce                 bool
	maxBatch, pipelines      int
	linger                   time.Duration
	m                        *metrics
	life                     context.Context
	stop                     context.CancelFunc
	workers                  sync.WaitGroup
	closed                   atomic.Bool
	lastReload               atomic.Int64
	beMu                     sync.Mutex // guards the creation of be against Close
	be                       atomic.Pointer[backend]
	ready                    atomic.Bool
	health                   atomic.Pointer[health]
	upMu                     sync.Mutex
	up                       map[string]bool
	nodesMu                  sync.RWMutex
	nodes                    map[string]*node
	refused                  map[string]error // under nodesMu
	sched                    *schedWatch
}

// New returns the Nodes of opts, with their metrics registered on reg,
// which keep scripts loaded on every primary. It tries Redis once within
// ctx (learning the mode and the slot map, loading the scripts), but a
// Redis that does not answer is not an error: the nodes serve anyway and
// connect when they can. New fails only on invalid options or metrics.
func New(ctx context.Context, opts Options, reg prometheus.Registerer, scripts []*redis.Script) (*Nodes, error) {
	if err := opts.Check(); err != nil {
		return nil, err
	}
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	ns := &Nodes{
		opts: opts, scripts: scripts, m: m, timeout: opts.Timeout, maxQueueWait: opts.MaxQueueWait, dialTimeout: opts.DialTimeout,
		coalesce: !opts.NoCoalesce, maxBatch: opts.MaxBatch, pipelines: opts.PipelinesPerNode, linger: opts.Linger,
		breakerOpen: opts.BreakerOpen, nodes: make(map[string]*node), refused: make(map[string]error),
		up: make(map[string]bool), sched: newSchedWatch(time.Now(), m.lateWakes),
	}
	if ns.timeout <= 0 {
		ns.timeout = DefaultTimeout
	}
	if ns.maxQueueWait <= 0 {
		ns.maxQueueWait = DefaultMaxQueueWait
	}
	if ns.replyDeadline = opts.ReplyDeadline; ns.replyDeadline <= 0 {
		ns.replyDeadline = DefaultReplyDeadline
	}
	ns.replyDeadline = max(ns.replyDeadline, ns.timeout)
	if ns.dialTimeout <= 0 {
		ns.dialTimeout = DefaultDialTimeout
	}
	if ns.maxBatch <= 0 {
		ns.maxBatch = DefaultMaxBatch
	}
	if ns.pipelines <= 0 {
		ns.pipelines = DefaultPipelinesPerNode
	}
	if ns.breakerOpen <= 0 {
		ns.breakerOpen = DefaultBreakerOpen
	}
	if ns.linger < 0 || ns.linger >= ns.maxQueueWait {
		return nil, fmt.Errorf("redis: linger %v: must be 0 or more and less than the queue wait (%v)", ns.linger, ns.maxQueueWait)
	}
	ns.life, ns.stop = context.WithCancel(context.Background())
	pctx, cancel := context.WithTimeout(ctx, probeTimeout)
	ns.probe(pctx)
	cancel()
	ns.workers.Go(func() { ns.run(ns.life) })
	ns.workers.Go(func() { ns.sched.run(ns.life) })
	return ns, nil
}

// Close stops the background probe and the pipelines and closes every
// connection. Calls made after Close fail with redis.ErrClosed.
func (ns *Nodes) Close() error {
	// Under both locks, so that no backend or node (with its workers) is
	// made once Close waits for the workers.
	ns.beMu.Lock()
	ns.nodesMu.Lock()
	ns.closed.Store(true)
	ns.nodesMu.Unlock()
	ns.beMu.Unlock()
	ns.stop()
	ns.workers.Wait()
	var errs []error
	ns.nodesMu.Lock()
	for _, n := range ns.nodes {
		errs = append(errs, n.close())
	}
	ns.nodesMu.Unlock()
	if be := ns.be.Load(); be != nil {
		errs = append(errs, be.admin.Close())
	}
	return errors.Join(errs...)
}

// Refuse makes the calls bound for the primary addr fail, unsent, with an
// error wrapping reason, until Refuse is called for addr again with a nil
// reason. A node not met yet is refused once it is.
func (ns *Nodes) Refuse(addr string, reason error) {
	ns.nodesMu.Lock()
	defer ns.nodesMu.Unlock()
	var r *refusal
	if reason != nil {
		ns.refused[addr] = reason
		r = &refusal{reason}
	} else {
		delete(ns.refused, addr)
	}
	if n := ns.nodes[addr]; n != nil {
		n.refused.Store(r)
	}
}
