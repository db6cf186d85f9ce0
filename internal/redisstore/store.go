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
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// Options configure a Store: the addresses, authentication and TLS of its
// Redis nodes, and how its checks are sent to them.
type Options = pipeline.Options

var _ bucket.Backend = (*Store)(nil)

// Store is a bucket.Backend on Redis. It is safe for concurrent use. It
// serves from New on, whether or not Redis answers: it connects in the
// background (see Health), and a check it cannot send fails at once with
// an error that says it was not applied.
type Store struct {
	nodes      *pipeline.Nodes
	m          *metrics
	beforeUndo func() // a test's hook, nil otherwise
	// A test's hooks of ApplyDebits, nil otherwise: debitNode names the
	// node a client's marker is grouped on instead of the slot map;
	// beforeDebitBatch runs between the grouping and the batched calls;
	// beforeDebitRound before each round of the one-client calls.
	debitNode        func(marker string) string
	beforeDebitBatch func()
	beforeDebitRound func(round int)
	args             argsCache
}

// New returns a Store for opts, with its metrics registered on reg. It
// tries Redis once within ctx (learning the mode and the slot map, loading
// the scripts), but a Redis that does not answer is not an error: the store
// serves anyway and connects when it can. New fails only on invalid options
// or metrics.
func New(ctx context.Context, opts Options, reg prometheus.Registerer) (*Store, error) {
	if err := opts.Check(); err != nil {
		return nil, err
	}
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	nodes, err := pipeline.New(ctx, opts, reg, allScripts())
	if err != nil {
		return nil, err
	}
	return &Store{nodes: nodes, m: m}, nil
}

// Close stops the background probe and the pipelines and closes every
// connection. Checks made after Close fail with redis.ErrClosed.
func (s *Store) Close() error { return s.nodes.Close() }

// eval runs c on the node of key, and counts a failure as what it means
// for a call of kind o.
func (s *Store) eval(ctx context.Context, o op, key string, c pipeline.Call, dur prometheus.Observer) ([]any, error) {
	res, err := s.nodes.Eval(ctx, key, c, dur)
	if err != nil {
		s.m.failed(o, err)
		return nil, err
	}
	return res, nil
}

// Health reports the store's reachability as the background probe last
// found it (every ProbeInterval; no I/O here), for a readiness detail or a
// log line. It is nil when every primary answered; otherwise its error
// names the nodes that did not, and wraps ErrNotConnected while the store
// is not connected (see Connected). A store that is not healthy still
// serves: checks bound for a node that is down fail at once (not applied),
// so a caller's on_failure policy decides them.
func (s *Store) Health() error { return s.nodes.Health() }

// Connected reports whether the store sends checks: it knows the mode and,
// for a cluster, the slot map, learnt from a node that answered (with
// ModeStandalone, from New on). Until then every check fails at once with
// ErrNotConnected. It stays true through a later outage, when the nodes'
// breakers fail the checks instead.
func (s *Store) Connected() bool { return s.nodes.Connected() }

// NodeStates lists the primaries as the background probe last found them.
func (s *Store) NodeStates() []pipeline.NodeState { return s.nodes.NodeStates() }

// Load loads every script on every primary that answers, so checks run by
// hash. A node that lost them (a restart, a failover) is served by EVAL
// until the background probe loads them again. Its error names the nodes
// that could not load them.
func (s *Store) Load(ctx context.Context) error { return s.nodes.Load(ctx) }

// Client returns the admin client, for health checks and admin reads; it is
// nil until the store has connected (see Connected) when the mode was left
// to ModeAuto with one address. Its commands take their deadline from their
// context.
func (s *Store) Client() redis.UniversalClient { return s.nodes.Client() }

// ForEachPrimary calls fn with a client of each primary, at once, and
// joins their errors.
func (s *Store) ForEachPrimary(ctx context.Context, fn func(ctx context.Context, c *redis.Client) error) error {
	return s.nodes.ForEachPrimary(ctx, fn)
}

// Refuse makes the checks of node addr fail, unsent, with an error wrapping
// reason (their rules' on_failure decides them); a nil reason sends them
// again.
func (s *Store) Refuse(addr string, reason error) { s.nodes.Refuse(addr, reason) }

// Ping reports whether every primary answers now.
func (s *Store) Ping(ctx context.Context) error { return s.nodes.Ping(ctx) }

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
	if req.Keep > 0 {
		// The single scripts keep nothing: the multi script keeps.
		ds, err := s.TakeAll(ctx, []bucket.Request{req})
		if me, ok := errors.AsType[*bucket.MultiError](err); ok {
			err = me.Errs[0]
		}
		if err != nil {
			return bucket.Decision{}, err
		}
		return ds[0], nil
	}
	key := Key(req.Rule, req.Key)
	res, err := s.eval(ctx, opScript, key, pipeline.Call{Script: singleScripts[i], Keys: []string{key}, Args: s.args.get(req.Limit, req.Cost)}, s.m.scriptDuration[i])
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
// reset_us}, and the single script's instant after them, for a bucket of
// lim. The remaining of a token bucket or GCRA
// comes as the time (ns, an integer) until the bucket is full again, of
// which bucket.Limit.Remaining makes the tokens or requests left; a
// sliding log's as an integer; a window's as a string.
func parseDecision(res []any, lim bucket.Limit) (bucket.Decision, error) {
	var at int64
	if len(res) == 5 {
		// The single script's instant.
		var ok bool
		if at, ok = res[4].(int64); !ok {
			return bucket.Decision{}, fmt.Errorf("unexpected instant %v", res[4])
		}
		res = res[:4]
	}
	if len(res) != 4 {
		return bucket.Decision{}, fmt.Errorf("reply has %d elements, want 4 or 5", len(res))
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
		At:         at,
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
