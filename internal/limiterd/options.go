package limiterd

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"time"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/engine/lease"
	"github.com/limiterd/limiterd/internal/engine/topkeys"
	"github.com/limiterd/limiterd/internal/frontdoor/forwardauth"
	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/rulesource"
	"github.com/limiterd/limiterd/internal/spendpub"
	"github.com/limiterd/limiterd/internal/topowatch"
	"github.com/limiterd/limiterd/internal/tracing"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// Defaults of the flags.
const (
	DefaultGRPCAddress   = "127.0.0.1:8081"
	DefaultHTTPAddress   = "127.0.0.1:9091"
	DefaultRegion        = "local"
	DefaultGracePeriod   = 10 * time.Second
	DefaultShutdownDelay = 0
	// DefaultFleetSize 0: the live count of the region's instances.
	DefaultFleetSize = 0
	// maxSizeFlag bounds every count flag, maxBytesFlag every memory flag.
	maxSizeFlag  = 100_000_000
	maxBytesFlag = 1 << 40
	// DefaultGRPCMaxStreams bounds the concurrent streams (checks in
	// flight) of one gRPC connection.
	DefaultGRPCMaxStreams = 1024
	// DefaultMaxConnections bounds the open connections of each listener.
	DefaultMaxConnections = 4096
)

// Bounds of the servers that are not flags.
const (
	// grpcKeepaliveMinTime is the shortest interval between a client's
	// keepalive pings; a client pinging faster is disconnected.
	grpcKeepaliveMinTime = 10 * time.Second
	// grpcMaxConnectionIdle closes a connection idle this long;
	// grpcMaxConnectionAge closes any connection this old (with a grace
	// period for its checks), so load balancers see new instances.
	grpcMaxConnectionIdle  = 5 * time.Minute
	grpcMaxConnectionAge   = 30 * time.Minute
	grpcMaxConnectionGrace = 10 * time.Second
	// grpcMaxRecvBytes bounds one gRPC request message.
	grpcMaxRecvBytes = 1 << 20
	// grpcMaxHeaderBytes bounds one gRPC request's metadata (advertised as
	// HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE; grpc-go's default is 16 MiB).
	grpcMaxHeaderBytes = 64 << 10
	// httpMaxHeaderBytes bounds an HTTP request's headers.
	httpMaxHeaderBytes = 64 << 10
)

// httpTimeouts bound the phases of an HTTP connection: reading a whole
// request, body included; writing the answer; a keep-alive connection idle
// between requests. A variable only so that a test can shorten them.
var httpTimeouts = struct{ read, write, idle time.Duration }{10 * time.Second, 15 * time.Second, 60 * time.Second}

// Options configure a Daemon, grouped by component. Start from
// DefaultOptions.
type Options struct {
	Server ServerOptions
	Memory MemoryOptions
	Rules  RulesOptions
	Region RegionOptions
	NATS   NATSOptions
	Admin  AdminOptions

	// Redis is where this region's Redis is and how to reach it; no
	// address: the embedded in-memory store.
	Redis redisstore.Conn
	// RedisTuning is how checks are sent to Redis. DefaultOptions holds
	// its defaults; each field is what it says, a zero included.
	RedisTuning redisstore.Tuning
	// RedisAllowUnsafeEviction starts even when a node's maxmemory-policy
	// is not noeviction (with a warning): every other policy evicts live
	// counters, since every bucket has an expiry.
	RedisAllowUnsafeEviction bool
	// ForwardAuth serves GET /forward-auth for nginx auth_request and
	// Traefik forwardAuth (package forwardauth).
	ForwardAuth forwardauth.Config
	// Tracing sends spans to an OpenTelemetry collector; off by default.
	Tracing tracing.Options
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// DefaultOptions are the daemon's defaults, and its flags' defaults: the
// one place they are written. Start from them; every field is what it
// says, a zero included (--deny-cache.size 0 turns the deny cache off).
// Region.Instance, when empty, is the host name and pid; Logger, when nil,
// slog.Default().
func DefaultOptions() Options {
	return Options{
		Server: ServerOptions{GRPCAddress: DefaultGRPCAddress, HTTPAddress: DefaultHTTPAddress,
			GRPCMaxStreams: DefaultGRPCMaxStreams, MaxConnections: DefaultMaxConnections,
			ShutdownDelay: DefaultShutdownDelay, GracePeriod: DefaultGracePeriod},
		RedisTuning: redisstore.DefaultTuning(),
		Memory: MemoryOptions{DenyCacheSize: engine.DefaultDenyCacheSize, MaxBytes: bucket.DefaultMaxBytes,
			FallbackMaxBytes: engine.DefaultFallbackMaxBytes, MaxLeaseKeys: lease.DefaultMaxKeys, TopLimitedSize: topkeys.DefaultSize},
		Rules:  RulesOptions{MaxRules: rulesource.DefaultMaxRules, PriorityClasses: rules.DefaultClasses},
		Region: RegionOptions{Name: DefaultRegion, FleetSize: DefaultFleetSize, TopologyPoll: topowatch.DefaultPoll, ForwardTimeout: engine.DefaultForwardTimeout},
		NATS: NATSOptions{Auth: natsconn.Auth{Prefix: natsconn.FlagPrefix},
			GossipInterval: gossip.DefaultInterval, GossipMaxDefer: spendpub.DefaultMaxDefer},
		Admin:       AdminOptions{NATSAuth: natsconn.Auth{Prefix: natsconn.AdminFlagPrefix}},
		ForwardAuth: forwardauth.DefaultConfig(),
		Tracing:     tracing.Default(),
	}
}

// RegisterFlags defines the daemon's flags on fs, writing into o.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	o.Server.RegisterFlags(fs)
	o.Redis.RegisterFlags(fs, "comma-separated Redis Cluster seed addresses (empty: embedded in-memory store)")
	o.RedisTuning.RegisterFlags(fs)
	fs.BoolVar(&o.RedisAllowUnsafeEviction, "redis.allow-unsafe-eviction", false, "start even when a Redis node's maxmemory-policy is not noeviction (live counters may be evicted)")
	o.Memory.RegisterFlags(fs)
	o.Rules.RegisterFlags(fs)
	o.Region.RegisterFlags(fs)
	o.NATS.RegisterFlags(fs)
	o.Admin.RegisterFlags(fs)
	o.ForwardAuth.RegisterFlags(fs)
	o.Tracing.RegisterFlags(fs)
}

// derived is o with the defaults that depend on the process (Instance,
// Logger) and the credentials' flag prefixes.
func (o Options) derived() Options {
	if o.Region.Instance == "" {
		host, _ := os.Hostname()
		o.Region.Instance = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	// The errors of the credentials name these flags.
	o.NATS.Auth.Prefix, o.Admin.NATSAuth.Prefix = natsconn.FlagPrefix, natsconn.AdminFlagPrefix
	return o
}

// validate reports every bad option, each naming its flag: each group's,
// then those of one group that need another's (identities need a client
// CA, NATS credentials a URL). It changes nothing.
func (o *Options) validate() error {
	e := flagErrs{o.Server.Validate(), o.Memory.Validate(), o.Rules.Validate(), o.Region.Validate(),
		o.NATS.Validate(), o.Admin.Validate(), o.Redis.Validate(), o.ForwardAuth.Validate(), o.Tracing.Validate()}
	if len(o.Redis.Addrs) > 0 {
		e = append(e, o.RedisTuning.Validate())
	}
	e.add(len(o.Region.PeerIdentities) > 0 && o.Server.TLSClientCAFile == "", "--region.peer-identities: needs --grpc.tls-client-ca-file to verify the peers' certificates")
	e.add(len(o.Admin.ClientIdentities) > 0 && o.Server.TLSClientCAFile == "" && o.Server.HTTPTLSClientCAFile == "", "--admin.client-identities: needs --grpc.tls-client-ca-file or --http.tls-client-ca-file to verify the clients' certificates")
	nats := o.NATS.Auth
	nats.Prefix = natsconn.FlagPrefix // whatever the field says
	e.add(o.NATS.URL == "" && (nats != natsconn.Auth{Prefix: natsconn.FlagPrefix} || o.Admin.NATSAuth.Set()), "--nats.creds-file, --nats.nkey-seed-file, --nats.tls-*, --admin.nats-*: need --nats.url")
	return errors.Join(e...)
}

// flagErrs gathers the errors of bad options, each naming its flag.
type flagErrs []error

// add adds the error of format and args when bad.
func (e *flagErrs) add(bad bool, format string, args ...any) {
	if bad {
		*e = append(*e, fmt.Errorf(format, args...))
	}
}

// MemoryOptions bound what the daemon keeps in memory.
type MemoryOptions struct {
	// DenyCacheSize bounds the deny cache; 0 turns it off.
	DenyCacheSize int
	// MaxBytes bounds the memory of the embedded store's buckets (no
	// --redis.addrs), FallbackMaxBytes the local fallback's; MaxLeaseKeys
	// the keys holding a lease.
	MaxBytes, FallbackMaxBytes int64
	MaxLeaseKeys               int
	// TopLimitedSize is the counters per rule of the keys it refuses most
	// (Admin/TopLimited); 0 turns them off.
	TopLimitedSize int
}

// RegisterFlags defines m's flags on fs, with DefaultOptions' defaults.
func (m *MemoryOptions) RegisterFlags(fs *flag.FlagSet) {
	d := DefaultOptions().Memory
	fs.IntVar(&m.DenyCacheSize, "deny-cache.size", d.DenyCacheSize, "rejections remembered until their retry time, sparing the store; 0: off")
	fs.Int64Var(&m.MaxBytes, "memory.max-bytes", d.MaxBytes, "memory of the embedded store's buckets (no --redis.addrs); at the cap a new bucket replaces one nearest its expiry")
	fs.Int64Var(&m.FallbackMaxBytes, "fallback.max-bytes", d.FallbackMaxBytes, "memory of the buckets of the local fallback that decides fail-open rules while the store is down")
	fs.IntVar(&m.MaxLeaseKeys, "lease.max-keys", d.MaxLeaseKeys, "most keys holding a lease; past it a check of a lease rule goes to the store alone")
	fs.IntVar(&m.TopLimitedSize, "top-limited.size", d.TopLimitedSize, "counters per rule of the keys it refuses most (Admin/TopLimited, GET /admin/rules/{id}/top): a key refused more than 1/size of a rule's refusals is always listed; 0: off")
}

// Validate reports every bad field, each naming its flag.
func (m MemoryOptions) Validate() error {
	var e flagErrs
	e.add(m.DenyCacheSize < 0 || m.DenyCacheSize > 100_000_000, "--deny-cache.size: must be 0 to 1e8, got %d", m.DenyCacheSize)
	e.add(m.MaxBytes < bucket.MinMaxBytes || m.MaxBytes > maxBytesFlag, "--memory.max-bytes: must be %d to %d bytes, got %d", bucket.MinMaxBytes, int64(maxBytesFlag), m.MaxBytes)
	e.add(m.FallbackMaxBytes < bucket.MinMaxBytes || m.FallbackMaxBytes > maxBytesFlag, "--fallback.max-bytes: must be %d to %d bytes, got %d", bucket.MinMaxBytes, int64(maxBytesFlag), m.FallbackMaxBytes)
	e.add(m.TopLimitedSize < 0 || m.TopLimitedSize > topkeys.MaxSize, "--top-limited.size: must be 0 (off) to %d, got %d", topkeys.MaxSize, m.TopLimitedSize)
	e.add(m.MaxLeaseKeys < 1 || m.MaxLeaseKeys > maxSizeFlag, "--lease.max-keys: must be 1 to %d, got %d", maxSizeFlag, m.MaxLeaseKeys)
	return errors.Join(e...)
}

// RulesOptions are where the rules come from and how many may be in force.
type RulesOptions struct {
	// File is the YAML rules file.
	File string
	// MaxRules caps the rules in force, file and admin rules together (0:
	// rulesource.DefaultMaxRules).
	MaxRules int
	// PriorityClasses are the priority classes of checks, most important
	// first; a rule's reserve may name only these.
	PriorityClasses []string
}

// RegisterFlags defines r's flags on fs, with DefaultOptions' defaults.
func (r *RulesOptions) RegisterFlags(fs *flag.FlagSet) {
	d := DefaultOptions().Rules
	fs.StringVar(&r.File, "rules.file", d.File, "YAML rules file (required)")
	fs.IntVar(&r.MaxRules, "rules.max-rules", d.MaxRules, "most rules in force, those of the file and the admin API together; more are refused")
	r.PriorityClasses = slices.Clone(d.PriorityClasses)
	fs.Var(redisstore.AddrsFlag{Addrs: &r.PriorityClasses}, "priority.classes",
		"comma-separated priority classes of checks, most important first, default among them: a check naming none or another is default; a rule's reserve keeps capacity for the classes above a check's")
}

// Validate reports every bad field, each naming its flag.
func (r RulesOptions) Validate() error {
	var e flagErrs
	e.add(r.File == "", "--rules.file: required")
	e.add(r.MaxRules < 0 || r.MaxRules > rulesource.MaxMaxRules, "--rules.max-rules: must be 1 to %d, got %d", rulesource.MaxMaxRules, r.MaxRules)
	if _, err := rules.NewClasses(r.PriorityClasses); err != nil {
		e.add(true, "--priority.classes: %v", err)
	}
	return errors.Join(e...)
}

// NATSOptions are the region's NATS server and the spends published there.
type NATSOptions struct {
	// URL is the region's NATS server: spends of reconciled rules are
	// published there every GossipInterval. Empty: no reconciliation.
	URL string
	// Auth authenticates to NATS (--nats.creds-file, --nats.nkey-seed-file)
	// and verifies it (--nats.tls-*).
	Auth natsconn.Auth
	// GossipInterval is how often spends are flushed.
	GossipInterval time.Duration
	// GossipMaxDefer is the longest a key whose spend stays under its
	// rule's budget waits past its interval before it is published. 0: it
	// waits for none.
	GossipMaxDefer time.Duration
	// GossipKeyAffinity says the gateways send each key to one limiterd of
	// the region (a hash of the key): each instance then holds a key's
	// whole spend budget before publishing it, not the budget / the fleet
	// size. Claimed falsely, a region may hold a budget per instance.
	GossipKeyAffinity bool
	// GossipSpoolDir, when set, keeps the spends not yet published on disk
	// while NATS is unreachable, so a crash loses at most one interval.
	GossipSpoolDir string
}

// RegisterFlags defines n's flags on fs, with DefaultOptions' defaults.
func (n *NATSOptions) RegisterFlags(fs *flag.FlagSet) {
	d := DefaultOptions().NATS
	fs.StringVar(&n.URL, "nats.url", d.URL, "NATS server of this region; spends of reconciled rules are published there (empty: no reconciliation)")
	n.Auth.RegisterFlags(fs, natsconn.FlagPrefix, true)
	fs.DurationVar(&n.GossipInterval, "gossip.interval", d.GossipInterval, "how often admitted spends are flushed to the reconcilers")
	fs.DurationVar(&n.GossipMaxDefer, "gossip.max-defer", d.GossipMaxDefer, "longest a key whose unpublished spend stays under its rule's budget (max_overshoot × capacity) waits past its interval before it is published, in whole intervals; 0: off, every key at its interval")
	fs.BoolVar(&n.GossipKeyAffinity, "gossip.key-affinity", d.GossipKeyAffinity, "the gateways send each key to one limiterd of the region (by a hash of the key): each instance holds a key's whole spend budget before publishing it, not its share (budget / fleet size)")
	fs.StringVar(&n.GossipSpoolDir, "gossip.spool-dir", d.GossipSpoolDir, "directory keeping unpublished spends on disk while NATS is unreachable (a crash then loses at most one interval)")
}

// Validate reports every bad field, each naming its flag.
func (n NATSOptions) Validate() error {
	n.Auth.Prefix = natsconn.FlagPrefix // the errors name its flags
	e := flagErrs{n.Auth.Validate()}
	e.add(n.GossipInterval < gossip.MinInterval || n.GossipInterval > time.Minute, "--gossip.interval: must be in [%v, 1m], got %v", gossip.MinInterval, n.GossipInterval)
	e.add(n.GossipMaxDefer != 0 && (n.GossipMaxDefer < n.GossipInterval || n.GossipMaxDefer > time.Minute), "--gossip.max-defer: must be 0 (off) or in [--gossip.interval (%v), 1m], got %v", n.GossipInterval, n.GossipMaxDefer)
	return errors.Join(e...)
}

// AdminOptions are who may call the admin API (gRPC Admin, HTTP
// /admin/rules) and the NATS identity it writes the rules bucket with.
type AdminOptions struct {
	// TokenFile holds the bearer token of the admin API.
	TokenFile string
	// ClientIdentities are the client certificate identities (DNS or URI
	// SAN, or common name) admitted to the admin API without the token,
	// verified by a listener's client CA. Empty: the token is always
	// required; a certificate of the client CA alone admits nobody.
	ClientIdentities []string
	// NATSAuth, when it holds a credential, is the identity of a second
	// connection that the admin API alone uses to write the rules bucket
	// (--admin.nats-creds-file, --admin.nats-nkey-seed-file), over the same
	// TLS as NATS.Auth; without it the admin API writes through the main one.
	NATSAuth natsconn.Auth
}

// RegisterFlags defines a's flags on fs, with DefaultOptions' defaults.
func (a *AdminOptions) RegisterFlags(fs *flag.FlagSet) {
	d := DefaultOptions().Admin
	fs.StringVar(&a.TokenFile, "admin.token-file", d.TokenFile, "file holding the admin API's bearer token (at least 16 characters)")
	fs.Var(redisstore.AddrsFlag{Addrs: &a.ClientIdentities}, "admin.client-identities", "comma-separated client certificate identities (DNS/URI SAN or CN) admitted to the admin API without the token (needs --grpc.tls-client-ca-file or --http.tls-client-ca-file)")
	a.NATSAuth.RegisterFlags(fs, natsconn.AdminFlagPrefix, false)
}

// Validate reports every bad field, each naming its flag.
func (a AdminOptions) Validate() error {
	a.NATSAuth.Prefix = natsconn.AdminFlagPrefix // the errors name its flags
	return a.NATSAuth.Validate()
}
