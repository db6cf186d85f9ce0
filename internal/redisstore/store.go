// Package redisstore decides checks on a Redis Cluster (or one Redis node)
// with one atomic Lua script per check.
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
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// DefaultTimeout bounds one store call when the caller's context has no
// earlier deadline.
const DefaultTimeout = 5 * time.Millisecond

// Options configure a Store.
type Options struct {
	// Addrs are the seed nodes; one address may be a cluster node or a
	// standalone server, which New tells apart.
	Addrs []string
	// Username and Password authenticate (Redis ACL), when set.
	Username, Password string
	// TLS, when set, is used for every connection.
	TLS *tls.Config
	// Timeout bounds each call; 0 means DefaultTimeout.
	Timeout time.Duration
	// PoolSize is the connection pool size per node; 0 lets go-redis choose.
	PoolSize int
	// NoCoalesce sends every check on its own instead of batching the
	// checks bound for one node into one pipeline.
	NoCoalesce bool
	// MaxBatch bounds the checks in one pipeline (0: DefaultMaxBatch).
	MaxBatch int
	// PipelinesPerNode is how many pipelines may be in flight to one node
	// (0: DefaultPipelinesPerNode).
	PipelinesPerNode int
	// BreakerOpen is how long a node's open breaker refuses calls before
	// it lets a probe through (0: DefaultBreakerOpen).
	BreakerOpen time.Duration
}

// Store is a bucket.Store on Redis. It is safe for concurrent use.
type Store struct {
	client  redis.UniversalClient
	cluster bool
	timeout time.Duration
	scripts [len(scriptAlgorithms)]*redis.Script
	m       *metrics

	coalesce    bool
	maxBatch    int
	pipelines   int
	breakerOpen time.Duration
	nodesMu     sync.RWMutex
	nodes       map[string]*node
	life        context.Context
	stop        context.CancelFunc
	workers     sync.WaitGroup
	lastReload  atomic.Int64
}

var scriptAlgorithms = [...]bucket.Algorithm{bucket.TokenBucket, bucket.GCRA, bucket.SlidingWindow, bucket.SlidingLog, bucket.FixedWindow}

func scriptIndex(a bucket.Algorithm) int {
	for i, s := range scriptAlgorithms {
		if s == a {
			return i
		}
	}
	return -1
}

// New connects to Redis, tells a cluster from a standalone server, and loads
// the scripts on every primary. Its metrics are registered on reg.
func New(ctx context.Context, opts Options, reg prometheus.Registerer) (*Store, error) {
	if len(opts.Addrs) == 0 {
		return nil, errors.New("redis: no addresses")
	}
	cluster := len(opts.Addrs) > 1
	if !cluster {
		c := redis.NewClient(&redis.Options{Addr: opts.Addrs[0], Username: opts.Username, Password: opts.Password,
			TLSConfig: opts.TLS, MaxRetries: -1})
		info, err := c.Do(ctx, "CLUSTER", "INFO").Text()
		c.Close()
		switch {
		case err == nil:
			cluster = strings.Contains(info, "cluster_state:")
		case strings.Contains(err.Error(), "cluster support disabled"):
		default:
			return nil, fmt.Errorf("redis %s: %w", opts.Addrs[0], err)
		}
	}
	var client redis.UniversalClient
	if cluster {
		client = redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: opts.Addrs, Username: opts.Username, Password: opts.Password, TLSConfig: opts.TLS,
			PoolSize: opts.PoolSize, ContextTimeoutEnabled: true,
			// go-redis refreshes its slot map on MOVED, not when a primary
			// stops answering: reload often, so a failover costs seconds.
			ClusterStateReloadInterval: time.Second,
			// A check is retried by its caller, not here: a retry spends
			// the latency budget and can double-spend a script that ran.
			MaxRetries: -1,
		})
	} else {
		client = redis.NewClient(&redis.Options{
			Addr: opts.Addrs[0], Username: opts.Username, Password: opts.Password, TLSConfig: opts.TLS,
			PoolSize: opts.PoolSize, ContextTimeoutEnabled: true, MaxRetries: -1,
		})
	}
	s, err := newStore(client, cluster, opts, reg)
	if err != nil {
		client.Close()
		return nil, err
	}
	if err := s.Load(ctx); err != nil {
		client.Close()
		return nil, err
	}
	return s, nil
}

func newStore(client redis.UniversalClient, cluster bool, opts Options, reg prometheus.Registerer) (*Store, error) {
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	s := &Store{
		client: client, cluster: cluster, m: m, timeout: opts.Timeout,
		coalesce: !opts.NoCoalesce, maxBatch: opts.MaxBatch, pipelines: opts.PipelinesPerNode,
		breakerOpen: opts.BreakerOpen, nodes: make(map[string]*node),
	}
	if s.timeout <= 0 {
		s.timeout = DefaultTimeout
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
	s.life, s.stop = context.WithCancel(context.Background())
	for i, a := range scriptAlgorithms {
		src, err := lua.Single(string(a), lua.StoreClock)
		if err != nil {
			return nil, err
		}
		s.scripts[i] = redis.NewScript(src)
	}
	return s, nil
}

// Load loads every script on every primary, so checks run by hash. A node
// that lost them (a restart, a failover) is served by EVAL until the next Load.
func (s *Store) Load(ctx context.Context) error {
	all := append(s.scripts[:len(s.scripts):len(s.scripts)], multiScript, undoScript, debitScript, refundScript)
	load := func(ctx context.Context, c *redis.Client) error {
		for _, sc := range all {
			if err := sc.Load(ctx, c).Err(); err != nil {
				return fmt.Errorf("load scripts on %s: %w", c.Options().Addr, err)
			}
		}
		return nil
	}
	if cc, ok := s.client.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, load)
	}
	return load(ctx, s.client.(*redis.Client))
}

// Client returns the underlying client, for health checks and admin reads.
func (s *Store) Client() redis.UniversalClient { return s.client }

// Close stops the pipelines and closes every connection.
func (s *Store) Close() error {
	s.stop()
	s.workers.Wait()
	return s.client.Close()
}

// Ping reports whether every primary answers.
func (s *Store) Ping(ctx context.Context) error {
	if cc, ok := s.client.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			return c.Ping(ctx).Err()
		})
	}
	return s.client.Ping(ctx).Err()
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

// Take runs the rule's script on the client's shard.
func (s *Store) Take(ctx context.Context, req bucket.Request) (bucket.Decision, error) {
	i := scriptIndex(req.Limit.Algorithm)
	if i < 0 {
		return bucket.Decision{}, fmt.Errorf("%w: no script for algorithm %q", bucket.ErrInvalidLimit, req.Limit.Algorithm)
	}
	ctx, cancel := s.withTimeout(ctx)
	defer cancel()
	a := scriptArgs(req.Limit, req.Cost)
	if s.coalesce {
		return s.takeCoalesced(ctx, i, Key(req.Rule, req.Key), a, req.Limit.Capacity)
	}
	start := time.Now()
	res, err := s.scripts[i].Run(ctx, s.client, []string{Key(req.Rule, req.Key)}, a[0], a[1], a[2]).Slice()
	s.m.scriptDuration[i].Observe(time.Since(start).Seconds())
	if err != nil {
		s.m.errors.Inc()
		return bucket.Decision{}, fmt.Errorf("eval %s: %w", req.Limit.Algorithm, err)
	}
	d, err := parseDecision(res, req.Limit.Capacity)
	if err != nil {
		s.m.errors.Inc()
		return bucket.Decision{}, fmt.Errorf("eval %s: %w", req.Limit.Algorithm, err)
	}
	return d, nil
}

func (s *Store) withTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= s.timeout {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.timeout)
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

// parseDecision reads the scripts' reply {allowed, remaining, retry_us, reset_us}.
func parseDecision(res []any, capacity float64) (bucket.Decision, error) {
	if len(res) != 4 {
		return bucket.Decision{}, fmt.Errorf("reply has %d elements, want 4", len(res))
	}
	allowed, ok1 := res[0].(int64)
	remS, ok2 := res[1].(string)
	retry, ok3 := res[2].(int64)
	reset, ok4 := res[3].(int64)
	if !ok1 || !ok2 || !ok3 || !ok4 {
		return bucket.Decision{}, fmt.Errorf("unexpected reply %v", res)
	}
	rem, err := strconv.ParseFloat(remS, 64)
	if err != nil {
		return bucket.Decision{}, fmt.Errorf("remaining %q: %w", remS, err)
	}
	return bucket.Decision{
		Allowed:    allowed == 1,
		Remaining:  rem,
		Limit:      capacity,
		RetryAfter: time.Duration(retry) * time.Microsecond,
		ResetAfter: time.Duration(reset) * time.Microsecond,
	}, nil
}

type metrics struct {
	coalesceMetrics
	scriptDuration [len(scriptAlgorithms)]prometheus.Observer
	errors         prometheus.Counter
	debitDuration  prometheus.Observer
	multiDuration  prometheus.Observer
	debitErrors    prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	dur := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "limiter_store_script_duration_seconds",
		Help:    "Time of one store script call, round trip included; for debits, one pipeline.",
		Buckets: []float64{.0001, .00025, .0005, .001, .002, .005, .01, .025, .1},
	}, []string{"script"})
	errs := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "limiter_store_errors_total",
		Help: "Store calls that failed, by operation.",
	}, []string{"op"})
	for _, c := range []prometheus.Collector{dur, errs} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register store metrics: %w", err)
		}
	}
	cm, err := newCoalesceMetrics(reg)
	if err != nil {
		return nil, fmt.Errorf("register store metrics: %w", err)
	}
	m := &metrics{
		coalesceMetrics: cm,
		errors:          errs.WithLabelValues("script"),
		debitErrors:     errs.WithLabelValues("debit"),
		debitDuration:   dur.WithLabelValues("debit"),
		multiDuration:   dur.WithLabelValues("multi"),
	}
	for i, a := range scriptAlgorithms {
		m.scriptDuration[i] = dur.WithLabelValues(string(a))
	}
	return m, nil
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
