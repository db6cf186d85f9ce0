package redisstore

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"time"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/internal/secretfile"
	"github.com/limiterd/limiterd/internal/tlsconf"
)

// Conn is where a region's Redis is and how to reach it, as both daemons'
// --redis.addrs, --redis.username, --redis.password-file, --redis.tls and
// --redis.tls-{ca,cert,key}-file flags give it.
type Conn struct {
	// Addrs are the Redis Cluster seed nodes (or one standalone server).
	Addrs []string
	// Username and PasswordFile authenticate to Redis (ACL).
	Username, PasswordFile string
	// TLS connects over TLS, verifying the servers against the system's
	// roots, or TLSCAFile when set; TLSCertFile and TLSKeyFile are the
	// client certificate (for tls-auth-clients). Any file implies TLS.
	TLS                                bool
	TLSCAFile, TLSCertFile, TLSKeyFile string
}

// RegisterFlags defines the --redis.* connection flags on fs, writing into
// c; addrsUsage is --redis.addrs's usage, which differs by daemon.
func (c *Conn) RegisterFlags(fs *flag.FlagSet, addrsUsage string) {
	fs.Var(AddrsFlag{Addrs: &c.Addrs}, "redis.addrs", addrsUsage)
	fs.StringVar(&c.Username, "redis.username", "", "Redis ACL user name")
	fs.StringVar(&c.PasswordFile, "redis.password-file", "", "file holding the Redis password")
	fs.BoolVar(&c.TLS, "redis.tls", false, "connect to Redis over TLS")
	fs.StringVar(&c.TLSCAFile, "redis.tls-ca-file", "", "CA bundle the Redis servers' certificates must chain to (implies --redis.tls; default: the system's roots)")
	fs.StringVar(&c.TLSCertFile, "redis.tls-cert-file", "", "client certificate for Redis (PEM; implies --redis.tls)")
	fs.StringVar(&c.TLSKeyFile, "redis.tls-key-file", "", "private key of --redis.tls-cert-file (PEM)")
}

// Validate reports credentials given without addresses. (No address is
// valid here: limiterd then runs on its embedded store.)
func (c Conn) Validate() error {
	if len(c.Addrs) == 0 && (c.Username != "" || c.PasswordFile != "" || c.tls()) {
		return errors.New("--redis.username, --redis.password-file, --redis.tls, --redis.tls-*-file: need --redis.addrs")
	}
	return nil
}

func (c Conn) tls() bool {
	return c.TLS || c.TLSCAFile != "" || c.TLSCertFile != "" || c.TLSKeyFile != ""
}

// Options are the store's options of c: its addresses, username, password
// (read from PasswordFile, surrounding blanks trimmed; log gets the warning
// about a group-readable file) and TLS. Errors name the flag.
func (c Conn) Options(log *slog.Logger) (Options, error) {
	o := Options{Addrs: c.Addrs, Username: c.Username}
	if c.PasswordFile != "" {
		b, err := secretfile.Read("--redis.password-file", c.PasswordFile, 1, log)
		if err != nil {
			return Options{}, err
		}
		o.Password = string(b)
	}
	if c.tls() {
		tc, err := tlsconf.Client(tlsconf.Files{CA: c.TLSCAFile, Cert: c.TLSCertFile, Key: c.TLSKeyFile,
			CAFlag: "--redis.tls-ca-file", CertFlag: "--redis.tls-cert-file", KeyFlag: "--redis.tls-key-file"})
		if err != nil {
			return Options{}, err
		}
		o.TLS = tc
	}
	return o, nil
}

// Tuning is how limiterd sends checks to Redis: its --redis.timeout,
// --redis.max-queue-wait, ... flags. Start from DefaultTuning: every field
// is what it says, a zero included (Linger 0 never waits).
type Tuning struct {
	// Timeout: a reply is late past it, from the moment the command is
	// written; ReplyDeadline: a late reply is still used until then.
	Timeout, ReplyDeadline time.Duration
	// MaxQueueWait bounds a check's wait in limiterd before it is sent.
	MaxQueueWait time.Duration
	// DialTimeout bounds opening a connection to a node.
	DialTimeout time.Duration
	// PoolSize is the connections per node (0: go-redis's default).
	PoolSize int
	// NoCoalesce sends each check on its own instead of pipelining the
	// checks bound for one node together.
	NoCoalesce bool
	// MaxBatch bounds one pipeline; PipelinesPerNode is how many may be in
	// flight to one node.
	MaxBatch, PipelinesPerNode int
	// Linger is how long a pipeline that is not full waits for more checks
	// while another pipeline to its node is in flight (0: never).
	Linger time.Duration
	// BreakerOpen is how long a failing node is not called before a probe.
	BreakerOpen time.Duration
}

// DefaultTuning is the flags' defaults.
func DefaultTuning() Tuning {
	return Tuning{
		Timeout: pipeline.DefaultTimeout, ReplyDeadline: pipeline.DefaultReplyDeadline,
		MaxQueueWait: pipeline.DefaultMaxQueueWait, DialTimeout: pipeline.DefaultDialTimeout,
		MaxBatch: pipeline.DefaultMaxBatch, PipelinesPerNode: pipeline.DefaultPipelinesPerNode,
		Linger: pipeline.DefaultLinger, BreakerOpen: pipeline.DefaultBreakerOpen,
	}
}

// RegisterFlags defines the tuning flags on fs, writing into t, with
// DefaultTuning's values as their defaults.
func (t *Tuning) RegisterFlags(fs *flag.FlagSet) {
	d := DefaultTuning()
	fs.DurationVar(&t.Timeout, "redis.timeout", d.Timeout, "a check's reply from Redis is late past this, counted from the moment it is written (see --redis.reply-deadline)")
	fs.DurationVar(&t.MaxQueueWait, "redis.max-queue-wait", d.MaxQueueWait, "longest a check waits in limiterd before it is sent to Redis; past it: RESOURCE_EXHAUSTED, or the rule's on_failure when its node answered nothing meanwhile")
	fs.DurationVar(&t.ReplyDeadline, "redis.reply-deadline", d.ReplyDeadline, "longest wait for a reply later than --redis.timeout: still used (Redis decided), counted against the node; after it the outcome is unknown")
	fs.DurationVar(&t.DialTimeout, "redis.dial-timeout", d.DialTimeout, "longest wait to open a connection to a Redis node")
	fs.IntVar(&t.PoolSize, "redis.pool-size", d.PoolSize, "connections per Redis node (0: default)")
	fs.BoolVar(&t.NoCoalesce, "redis.no-coalesce", d.NoCoalesce, "send each check on its own instead of pipelining the checks bound for one node")
	fs.IntVar(&t.MaxBatch, "redis.max-batch", d.MaxBatch, "most checks in one pipeline to one node")
	fs.IntVar(&t.PipelinesPerNode, "redis.pipelines-per-node", d.PipelinesPerNode, "pipelines in flight to one node at once")
	fs.DurationVar(&t.Linger, "redis.linger", d.Linger, "while a pipeline to a node is in flight, how long the next one waits for more checks before it is sent (it goes as soon as that one is answered or it is full); 0: never waits")
	fs.DurationVar(&t.BreakerOpen, "redis.breaker-open", d.BreakerOpen, "how long a failing node is not called before a probe")
}

// Validate reports every field out of its range, each naming its flag.
func (t Tuning) Validate() error {
	var errs []error
	for _, d := range []struct {
		flag string
		v    time.Duration
	}{{"redis.timeout", t.Timeout}, {"redis.max-queue-wait", t.MaxQueueWait}, {"redis.reply-deadline", t.ReplyDeadline}, {"redis.dial-timeout", t.DialTimeout}} {
		if d.v <= 0 || d.v > time.Minute {
			errs = append(errs, fmt.Errorf("--%s: must be in (0, 1m], got %v", d.flag, d.v))
		}
	}
	if t.MaxBatch < 1 || t.MaxBatch > 10000 {
		errs = append(errs, fmt.Errorf("--redis.max-batch: must be 1 to 10000, got %d", t.MaxBatch))
	}
	if t.PipelinesPerNode < 1 || t.PipelinesPerNode > 64 {
		errs = append(errs, fmt.Errorf("--redis.pipelines-per-node: must be 1 to 64, got %d", t.PipelinesPerNode))
	}
	if t.Linger < 0 || (t.MaxQueueWait > 0 && t.Linger >= t.MaxQueueWait) {
		errs = append(errs, fmt.Errorf("--redis.linger: must be 0 or more and less than --redis.max-queue-wait (%v), got %v", t.MaxQueueWait, t.Linger))
	}
	if t.BreakerOpen <= 0 || t.BreakerOpen > 5*time.Minute {
		errs = append(errs, fmt.Errorf("--redis.breaker-open: must be in (0, 5m], got %v", t.BreakerOpen))
	}
	if t.PoolSize < 0 || t.PoolSize > 10000 {
		errs = append(errs, fmt.Errorf("--redis.pool-size: must be 0 (the default) to 10000, got %d", t.PoolSize))
	}
	return errors.Join(errs...)
}

// Apply sets o's sending options to t's.
func (t Tuning) Apply(o *Options) {
	o.Timeout, o.ReplyDeadline, o.MaxQueueWait, o.DialTimeout = t.Timeout, t.ReplyDeadline, t.MaxQueueWait, t.DialTimeout
	o.PoolSize, o.NoCoalesce, o.MaxBatch, o.PipelinesPerNode = t.PoolSize, t.NoCoalesce, t.MaxBatch, t.PipelinesPerNode
	o.Linger, o.BreakerOpen = t.Linger, t.BreakerOpen
}
