// Package redisstore decides checks on a Redis Cluster (or one Redis node)
// with one atomic Lua script per check.
//
// A store error says what happened to the request: bucket.ErrOverloaded
// (never sent: it waited in limiterd's own queue past its deadline or
// Options.MaxQueueWait), bucket.ErrOutcomeUnknown (sent, and no reply came
// within Options.Timeout: it may have run), and any other error (a node
// refused the connection, its breaker is open, the store is not connected,
// Redis answered an error) means nothing was applied.
package redisstore

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/pkg/bucket"
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

// Options configure a Store.
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

// Store is a bucket.Store and bucket.MultiStore on Redis. It is safe for
// concurrent use. It serves from New on, whether or not Redis answers: it
// connects in the background (see Health), and a check it cannot send
// fails at once with an error that says it was not applied.
type Store struct {
	opts                     Options
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
	unsafe                   map[string]bool // under nodesMu
	beforeUndo               func()          // a test's hook, nil otherwise
	args                     argsCache
}

// New returns a Store for opts, with its metrics registered on reg. It
// tries Redis once within ctx (learning the mode and the slot map, loading
// the scripts), but a Redis that does not answer is not an error: the store
// serves anyway and connects when it can. New fails only on invalid options
// or metrics.
func New(ctx context.Context, opts Options, reg prometheus.Registerer) (*Store, error) {
	if len(opts.Addrs) == 0 {
		return nil, errors.New("redis: no addresses")
	}
	if opts.Mode == ModeStandalone && len(opts.Addrs) > 1 {
		return nil, fmt.Errorf("redis: %d addresses for a standalone server", len(opts.Addrs))
	}
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	s := &Store{
		opts: opts, m: m, timeout: opts.Timeout, maxQueueWait: opts.MaxQueueWait, dialTimeout: opts.DialTimeout,
		coalesce: !opts.NoCoalesce, maxBatch: opts.MaxBatch, pipelines: opts.PipelinesPerNode, linger: opts.Linger,
		breakerOpen: opts.BreakerOpen, nodes: make(map[string]*node), unsafe: make(map[string]bool),
		up: make(map[string]bool),
	}
	if s.timeout <= 0 {
		s.timeout = DefaultTimeout
	}
	if s.maxQueueWait <= 0 {
		s.maxQueueWait = DefaultMaxQueueWait
	}
	if s.replyDeadline = opts.ReplyDeadline; s.replyDeadline <= 0 {
		s.replyDeadline = DefaultReplyDeadline
	}
	s.replyDeadline = max(s.replyDeadline, s.timeout)
	if s.dialTimeout <= 0 {
		s.dialTimeout = DefaultDialTimeout
	}
	if s.maxBatch <= 0 {
		s.maxBatch = DefaultMaxBatch
	}
	if s.pipelines <= 0 {
		s.pipelines = DefaultPipelinesPerNode
	}
	if s.breakerOpen <= 0 {
		s.breakerOpen = DefaultBreakerOpen
	}
	if s.linger < 0 || s.linger >= s.maxQueueWait {
		return nil, fmt.Errorf("redis: linger %v: must be 0 or more and less than the queue wait (%v)", s.linger, s.maxQueueWait)
	}
	s.life, s.stop = context.WithCancel(context.Background())
	pctx, cancel := context.WithTimeout(ctx, probeTimeout)
	s.probe(pctx)
	cancel()
	s.workers.Go(func() { s.run(s.life) })
	return s, nil
}

// Close stops the background probe and the pipelines and closes every
// connection. Checks made after Close fail with redis.ErrClosed.
func (s *Store) Close() error {
	// Under both locks, so that no backend or node (with its workers) is
	// made once Close waits for the workers.
	s.beMu.Lock()
	s.nodesMu.Lock()
	s.closed.Store(true)
	s.nodesMu.Unlock()
	s.beMu.Unlock()
	s.stop()
	s.workers.Wait()
	var errs []error
	s.nodesMu.Lock()
	for _, n := range s.nodes {
		errs = append(errs, n.close())
	}
	s.nodesMu.Unlock()
	if be := s.be.Load(); be != nil {
		errs = append(errs, be.admin.Close())
	}
	return errors.Join(errs...)
}

// Key is the Redis key of the bucket of key under rule: rl:{key}:rule. The
// hash tag puts every bucket of one client in one slot, so one script can
// check several rules of a client at once. Braces and '%' in the key are
// escaped so that the tag is always the whole key.
func Key(rule, key string) string {
	if strings.ContainsAny(key, "{}%") {
		key = keyEscaper.Replace(key)
	}
	var b strings.Builder
	b.Grow(len(key) + len(rule) + 6)
	b.WriteString("rl:{")
	b.WriteString(key)
	b.WriteString("}:")
	b.WriteString(rule)
	return b.String()
}

var keyEscaper = strings.NewReplacer("%", "%25", "{", "%7B", "}", "%7D")

// Take runs the rule's script on the client's shard. Its errors wrap
// bucket.ErrOverloaded when the check waited too long to be sent and
// bucket.ErrOutcomeUnknown when it was sent and no reply came in time;
// any other error means the check was not applied.
func (s *Store) Take(ctx context.Context, req bucket.Request) (bucket.Decision, error) {
	i := scriptIndex(req.Limit.Algorithm)
	if i < 0 {
		return bucket.Decision{}, fmt.Errorf("%w: no script for algorithm %q", bucket.ErrInvalidLimit, req.Limit.Algorithm)
	}
	if req.MaxWait != 0 {
		ds, err := s.reserve(ctx, []bucket.Request{req})
		if err != nil {
			return bucket.Decision{}, err
		}
		return ds[0], nil
	}
	key := Key(req.Rule, req.Key)
	res, err := s.eval(ctx, opScript, key, scriptCall{script: singleScripts[i], keys: []string{key}, args: s.args.get(req.Limit, req.Cost)}, s.m.scriptDuration[i])
	if err == nil {
		var d bucket.Decision
		if d, err = parseDecision(res, req.Limit); err == nil {
			return d, nil
		}
		s.m.errors[opScript].Inc()
	}
	return bucket.Decision{}, fmt.Errorf("eval %s: %w", req.Limit.Algorithm, err)
}

// argsCache keeps the ARGV of a check (scriptArgs, as the []any a pipeline
// takes) by limit and cost: a rule's checks share a handful, and formatting
// three floats on every check costs more than the lookup. It holds at most
// maxCachedArgs; past that the args are made on each call.
type argsCache struct {
	mu sync.RWMutex
	m  map[argsKey][]any
}

type argsKey struct {
	limit bucket.Limit
	cost  float64
}

const maxCachedArgs = 4096

func (c *argsCache) get(l bucket.Limit, cost float64) []any {
	k := argsKey{l, cost}
	c.mu.RLock()
	a, ok := c.m[k]
	c.mu.RUnlock()
	if ok {
		return a
	}
	s := scriptArgs(l, cost)
	a = []any{s[0], s[1], s[2]}
	c.mu.Lock()
	if c.m == nil {
		c.m = make(map[argsKey][]any)
	}
	if len(c.m) < maxCachedArgs {
		c.m[k] = a
	}
	c.mu.Unlock()
	return a
}

// scriptArgs are a script's ARGV for one bucket: capacity, rate (tokens/s)
// or window (µs), cost or amount.
func scriptArgs(l bucket.Limit, cost float64) [3]string {
	p := strconv.FormatInt(l.Window.Microseconds(), 10)
	if l.Algorithm == bucket.TokenBucket || l.Algorithm == bucket.GCRA {
		p = strconv.FormatFloat(l.RefillPerSecond, 'g', -1, 64)
	}
	return [3]string{strconv.FormatFloat(l.Capacity, 'g', -1, 64), p, strconv.FormatFloat(cost, 'g', -1, 64)}
}

// parseDecision reads the scripts' reply {allowed, remaining, retry_us,
// reset_us} for a bucket of lim. The remaining of a token bucket or GCRA
// comes as the time (ns, an integer) until the bucket is full again, of
// which bucket.Limit.Remaining makes the tokens or requests left; a
// sliding log's as an integer; a window's as a string.
func parseDecision(res []any, lim bucket.Limit) (bucket.Decision, error) {
	if len(res) != 4 {
		return bucket.Decision{}, fmt.Errorf("reply has %d elements, want 4", len(res))
	}
	allowed, ok1 := res[0].(int64)
	retry, ok3 := res[2].(int64)
	reset, ok4 := res[3].(int64)
	if !ok1 || !ok3 || !ok4 {
		return bucket.Decision{}, fmt.Errorf("unexpected reply %v", res)
	}
	var rem float64
	switch v := res[1].(type) {
	case int64:
		rem = float64(v)
		if lim.Algorithm == bucket.TokenBucket || lim.Algorithm == bucket.GCRA {
			rem = lim.Remaining(time.Duration(v))
		}
	case string:
		var err error
		if rem, err = strconv.ParseFloat(v, 64); err != nil {
			return bucket.Decision{}, fmt.Errorf("remaining %q: %w", v, err)
		}
	default:
		return bucket.Decision{}, fmt.Errorf("unexpected reply %v", res)
	}
	return bucket.Decision{
		Allowed:    allowed == 1,
		Remaining:  rem,
		Limit:      lim.Capacity,
		RetryAfter: time.Duration(retry) * time.Microsecond,
		ResetAfter: time.Duration(reset) * time.Microsecond,
	}, nil
}

// AddrsFlag is a flag.Value for a comma-separated list of addresses.
type AddrsFlag struct{ Addrs *[]string }

func (f AddrsFlag) String() string {
	if f.Addrs == nil {
		return ""
	}
	return strings.Join(*f.Addrs, ",")
}

// Set parses a comma-separated list, dropping empty entries.
func (f AddrsFlag) Set(s string) error {
	*f.Addrs = nil
	for _, a := range strings.Split(s, ",") {
		if a = strings.TrimSpace(a); a != "" {
			*f.Addrs = append(*f.Addrs, a)
		}
	}
	return nil
}
