package limiterd

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"time"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/engine/lease"
	"github.com/limiterd/limiterd/internal/frontdoor/forwardauth"
	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/rulesource"
	"github.com/limiterd/limiterd/internal/spendpub"
	"github.com/limiterd/limiterd/internal/topowatch"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/gossip"
	"github.com/limiterd/limiterd/pkg/region"
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

var instancePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)

// Options configure a Daemon. Fields left zero take the defaults above.
type Options struct {
	// GRPCAddress is the check API's listen address; port 0 picks one.
	GRPCAddress string
	// HTTPAddress serves /metrics, /healthz and /readyz.
	HTTPAddress string
	// Profiling serves Go's profiles (net/http/pprof) under /debug/pprof/
	// on the HTTP listener.
	Profiling bool
	// TLSCertFile and TLSKeyFile enable TLS on the gRPC listener;
	// TLSClientCAFile also requires client certificates signed by it (mTLS).
	TLSCertFile, TLSKeyFile, TLSClientCAFile string
	// HTTPTLSCertFile and HTTPTLSKeyFile enable TLS on the HTTP listener
	// (and the forward-auth one); HTTPTLSClientCAFile also requires client
	// certificates signed by it.
	HTTPTLSCertFile, HTTPTLSKeyFile, HTTPTLSClientCAFile string

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

	// DenyCacheSize bounds the deny cache; 0 turns it off.
	DenyCacheSize int
	// MemoryMaxBytes bounds the memory of the embedded store's buckets
	// (no --redis.addrs), FallbackMaxBytes the local fallback's; MaxLeaseKeys
	// the keys holding a lease. 0: the defaults below.
	MemoryMaxBytes, FallbackMaxBytes int64
	MaxLeaseKeys                     int

	// RulesFile is the YAML rules file.
	RulesFile string
	// MaxRules caps the rules in force, file and admin rules together (0:
	// rulesource.DefaultMaxRules).
	MaxRules int
	// Region is this instance's region name.
	Region string
	// FleetSize, when > 0, is the number of limiterd instances sharing a
	// region's limits: a fail-open rule whose store is down decides here
	// with limit / FleetSize. 0: the live count, from a heartbeat in the
	// region's Redis (the last count seen holds through an outage).
	FleetSize int

	// NATSURL is the region's NATS server: spends of reconciled rules are
	// published there every GossipInterval. Empty: no reconciliation.
	NATSURL string
	// NATSAuth authenticates to NATS (--nats.creds-file, --nats.nkey-seed-file)
	// and verifies it (--nats.tls-*).
	NATSAuth natsconn.Auth
	// AdminNATSAuth, when it holds a credential, is the identity of a second
	// connection that the admin API alone uses to write the rules bucket
	// (--admin.nats-creds-file, --admin.nats-nkey-seed-file), over the same
	// TLS as NATSAuth; without it the admin API writes through the main one.
	AdminNATSAuth natsconn.Auth
	// GossipInterval is how often spends are flushed.
	GossipInterval time.Duration
	// GossipMaxDefer is the longest a key whose spend stays under its
	// rule's budget waits past its interval before it is published. 0: it
	// waits for none.
	GossipMaxDefer time.Duration
	// Instance names this limiterd in spend messages; default host-pid.
	Instance string
	// TopologyFile lists the regions and their limiterd addresses, for
	// forwarding checks of pinned rules to a key's home region.
	TopologyFile string
	// TopologyPoll is how often TopologyFile is read again (0:
	// topowatch.DefaultPoll).
	TopologyPoll time.Duration
	// ForwardTimeout bounds a check forwarded to the home region.
	ForwardTimeout time.Duration
	// HandoffMaxWindow caps the handoff window of moved pinned keys (0:
	// each rule's own).
	HandoffMaxWindow time.Duration
	// ForwardTLSCAFile enables TLS to other regions' limiterd, trusting
	// this CA; the gRPC listener's certificate, if any, is the client's.
	ForwardTLSCAFile string
	// PeerSecretFile holds the secret that peer regions share: sent with
	// every check forwarded to a home region, required of every call to
	// the Peer service (unless the caller's certificate is allowed by
	// PeerIdentities). One of the two is required with TopologyFile.
	PeerSecretFile string
	// PeerIdentities are the client certificate identities (DNS or URI
	// SAN, or common name) of peer regions' limiterd, verified by the
	// listener's --grpc.tls-client-ca-file.
	PeerIdentities []string
	// GossipSpoolDir, when set, keeps the spends not yet published on disk
	// while NATS is unreachable, so a crash loses at most one interval.
	GossipSpoolDir string

	// AdminTokenFile holds the bearer token of the admin API (gRPC Admin,
	// HTTP /admin/rules).
	AdminTokenFile string
	// AdminClientIdentities are the client certificate identities (DNS or
	// URI SAN, or common name) admitted to the admin API without the token,
	// verified by a listener's client CA. Empty: the token is always
	// required; a certificate of the client CA alone admits nobody.
	AdminClientIdentities []string

	// GRPCMaxStreams bounds the concurrent streams of one gRPC connection
	// (0: DefaultGRPCMaxStreams).
	GRPCMaxStreams int
	// MaxConnections bounds the open connections of each listener, gRPC
	// and HTTP (0: DefaultMaxConnections).
	MaxConnections int

	// ShutdownDelay is how long the daemon stays up, not ready, before it
	// stops accepting checks, so load balancers see it leave.
	ShutdownDelay time.Duration
	// GracePeriod bounds how long in-flight checks may take to finish.
	GracePeriod time.Duration

	// EnvoyQuotaHeaders adds the quota headers of pkg/httplimit to the
	// answers of Envoy's rate limit service (response_headers_to_add). Off
	// by default, as in Envoy's reference service: Envoy's filter can make
	// its own from the statuses (enable_x_ratelimit_headers).
	EnvoyQuotaHeaders bool

	// ForwardAuth serves GET /forward-auth for nginx auth_request and
	// Traefik forwardAuth (package forwardauth).
	ForwardAuth forwardauth.Config

	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// DefaultOptions are the daemon's defaults, and its flags' defaults: the
// one place they are written. Start from them; every field is what it
// says, a zero included (--deny-cache.size 0 turns the deny cache off).
// Instance, when empty, is the host name and pid; Logger, when nil,
// slog.Default().
func DefaultOptions() Options {
	return Options{
		GRPCAddress: DefaultGRPCAddress, HTTPAddress: DefaultHTTPAddress,
		GRPCMaxStreams: DefaultGRPCMaxStreams, MaxConnections: DefaultMaxConnections,
		RedisTuning:   redisstore.DefaultTuning(),
		DenyCacheSize: engine.DefaultDenyCacheSize, MemoryMaxBytes: bucket.DefaultMaxBytes,
		FallbackMaxBytes: engine.DefaultFallbackMaxBytes, MaxLeaseKeys: lease.DefaultMaxKeys,
		MaxRules: rulesource.DefaultMaxRules, Region: DefaultRegion, FleetSize: DefaultFleetSize,
		NATSAuth: natsconn.Auth{Prefix: natsconn.FlagPrefix}, AdminNATSAuth: natsconn.Auth{Prefix: natsconn.AdminFlagPrefix},
		GossipInterval: gossip.DefaultInterval, GossipMaxDefer: spendpub.DefaultMaxDefer, TopologyPoll: topowatch.DefaultPoll, ForwardTimeout: engine.DefaultForwardTimeout,
		ShutdownDelay: DefaultShutdownDelay, GracePeriod: DefaultGracePeriod,
		ForwardAuth: forwardauth.DefaultConfig(),
	}
}

// RegisterFlags defines the daemon's flags on fs, writing into o.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	d := DefaultOptions()
	fs.StringVar(&o.GRPCAddress, "grpc.listen-address", d.GRPCAddress, "address of the gRPC check API")
	fs.StringVar(&o.HTTPAddress, "http.listen-address", d.HTTPAddress, "address serving /metrics, /healthz and /readyz")
	fs.BoolVar(&o.Profiling, "http.pprof", false, "serve Go's CPU, heap and goroutine profiles under /debug/pprof/ on the HTTP listener")
	fs.StringVar(&o.TLSCertFile, "grpc.tls-cert-file", "", "TLS certificate of the gRPC listener (PEM)")
	fs.StringVar(&o.TLSKeyFile, "grpc.tls-key-file", "", "TLS private key of the gRPC listener (PEM)")
	fs.IntVar(&o.GRPCMaxStreams, "grpc.max-concurrent-streams", d.GRPCMaxStreams, "most checks in flight on one gRPC connection (more wait for a free stream)")
	fs.IntVar(&o.MaxConnections, "server.max-connections", d.MaxConnections, "most open connections of each listener, gRPC and HTTP (more wait to be accepted)")
	fs.StringVar(&o.TLSClientCAFile, "grpc.tls-client-ca-file", "", "CA bundle that client certificates must chain to (enables mTLS)")
	fs.StringVar(&o.HTTPTLSCertFile, "http.tls-cert-file", "", "TLS certificate of the HTTP listener, and of the forward-auth one (PEM)")
	fs.StringVar(&o.HTTPTLSKeyFile, "http.tls-key-file", "", "TLS private key of the HTTP listener (PEM)")
	fs.StringVar(&o.HTTPTLSClientCAFile, "http.tls-client-ca-file", "", "CA bundle that HTTP clients' certificates must chain to (enables mTLS on the HTTP and forward-auth listeners)")
	o.Redis.RegisterFlags(fs, "comma-separated Redis Cluster seed addresses (empty: embedded in-memory store)")
	o.RedisTuning.RegisterFlags(fs)
	fs.BoolVar(&o.RedisAllowUnsafeEviction, "redis.allow-unsafe-eviction", false, "start even when a Redis node's maxmemory-policy is not noeviction (live counters may be evicted)")
	fs.IntVar(&o.DenyCacheSize, "deny-cache.size", d.DenyCacheSize, "rejections remembered until their retry time, sparing the store; 0: off")
	fs.Int64Var(&o.MemoryMaxBytes, "memory.max-bytes", d.MemoryMaxBytes, "memory of the embedded store's buckets (no --redis.addrs); at the cap a new bucket replaces one nearest its expiry")
	fs.Int64Var(&o.FallbackMaxBytes, "fallback.max-bytes", d.FallbackMaxBytes, "memory of the buckets of the local fallback that decides fail-open rules while the store is down")
	fs.IntVar(&o.MaxLeaseKeys, "lease.max-keys", d.MaxLeaseKeys, "most keys holding a lease; past it a check of a lease rule goes to the store alone")
	fs.StringVar(&o.RulesFile, "rules.file", "", "YAML rules file (required)")
	fs.IntVar(&o.MaxRules, "rules.max-rules", d.MaxRules, "most rules in force, those of the file and the admin API together; more are refused")
	fs.StringVar(&o.Region, "region", d.Region, "name of this region")
	fs.IntVar(&o.FleetSize, "fleet.size", d.FleetSize, "limiterd instances in this region: fail-open rules whose store is down decide with limit / fleet.size (0: the live count, by a heartbeat in Redis)")
	fs.StringVar(&o.NATSURL, "nats.url", "", "NATS server of this region; spends of reconciled rules are published there (empty: no reconciliation)")
	o.NATSAuth.RegisterFlags(fs, natsconn.FlagPrefix, true)
	o.AdminNATSAuth.RegisterFlags(fs, natsconn.AdminFlagPrefix, false)
	fs.DurationVar(&o.GossipInterval, "gossip.interval", d.GossipInterval, "how often admitted spends are flushed to the reconcilers")
	fs.DurationVar(&o.GossipMaxDefer, "gossip.max-defer", d.GossipMaxDefer, "longest a key whose unpublished spend stays under its rule's budget (max_overshoot × capacity) waits past its interval before it is published, in whole intervals; 0: off, every key at its interval")
	fs.StringVar(&o.Instance, "instance", "", "name of this instance in spend messages (default: host name and pid)")
	fs.StringVar(&o.TopologyFile, "region.topology-file", "", "YAML list of regions and their limiterd addresses, for pinned rules")
	fs.DurationVar(&o.TopologyPoll, "region.topology-poll", d.TopologyPoll, "how often --region.topology-file is read again; a changed file is checked and put in force at its effective_at")
	fs.DurationVar(&o.ForwardTimeout, "region.forward-timeout", d.ForwardTimeout, "deadline of a check forwarded to a key's home region")
	fs.DurationVar(&o.HandoffMaxWindow, "region.handoff-max-window", 0, "the longest a pinned key moved here by a topology switch or a home_keys change takes its old home's bucket (0: each rule's own handoff window); past it the key starts from a full bucket")
	fs.StringVar(&o.ForwardTLSCAFile, "region.forward-tls-ca-file", "", "CA bundle of other regions' limiterd: forward pinned checks over TLS")
	fs.StringVar(&o.PeerSecretFile, "region.peer-secret-file", "", "file holding the secret peer regions share (mode 0600, at least 16 characters): sent with forwarded checks, required of Peer calls")
	fs.Var(redisstore.AddrsFlag{Addrs: &o.PeerIdentities}, "region.peer-identities", "comma-separated client certificate identities (DNS/URI SAN or CN) of peer regions' limiterd, allowed to call the Peer service (needs --grpc.tls-client-ca-file)")
	fs.StringVar(&o.GossipSpoolDir, "gossip.spool-dir", "", "directory keeping unpublished spends on disk while NATS is unreachable (a crash then loses at most one interval)")
	fs.StringVar(&o.AdminTokenFile, "admin.token-file", "", "file holding the admin API's bearer token (at least 16 characters)")
	fs.Var(redisstore.AddrsFlag{Addrs: &o.AdminClientIdentities}, "admin.client-identities", "comma-separated client certificate identities (DNS/URI SAN or CN) admitted to the admin API without the token (needs --grpc.tls-client-ca-file or --http.tls-client-ca-file)")
	fs.DurationVar(&o.ShutdownDelay, "shutdown.delay", d.ShutdownDelay, "time not ready before the listeners close, on SIGTERM")
	fs.DurationVar(&o.GracePeriod, "shutdown.grace-period", d.GracePeriod, "longest wait for in-flight checks on shutdown")
	fs.BoolVar(&o.EnvoyQuotaHeaders, "envoy.quota-headers", false, "add the quota headers (RateLimit-*, X-RateLimit-*, Retry-After) to Envoy rate limit answers; off: Envoy's filter can make its own from the statuses (enable_x_ratelimit_headers)")
	o.ForwardAuth.RegisterFlags(fs)
}

// derived is o with the defaults that depend on the process (Instance,
// Logger) and the credentials' flag prefixes.
func (o Options) derived() Options {
	if o.Instance == "" {
		host, _ := os.Hostname()
		o.Instance = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	// The errors of the credentials name these flags.
	o.NATSAuth.Prefix, o.AdminNATSAuth.Prefix = natsconn.FlagPrefix, natsconn.AdminFlagPrefix
	return o
}

// validate reports every bad option, each naming its flag. It changes
// nothing.
func (o *Options) validate() error {
	var errs []error
	if o.RulesFile == "" {
		errs = append(errs, errors.New("--rules.file: required"))
	}
	if err := region.ValidateName(o.Region); err != nil {
		errs = append(errs, fmt.Errorf("--region: %w", err))
	}
	if o.FleetSize < 0 || o.FleetSize > 100_000 {
		errs = append(errs, fmt.Errorf("--fleet.size: must be 0 (the live count) to 100000, got %d", o.FleetSize))
	}
	if o.TopologyFile != "" && o.PeerSecretFile == "" && len(o.PeerIdentities) == 0 {
		errs = append(errs, errors.New("--region.peer-secret-file or --region.peer-identities: one is required with --region.topology-file, so that only peer regions may decide pinned rules' checks"))
	}
	if len(o.PeerIdentities) > 0 && o.TLSClientCAFile == "" {
		errs = append(errs, errors.New("--region.peer-identities: needs --grpc.tls-client-ca-file to verify the peers' certificates"))
	}
	if len(o.AdminClientIdentities) > 0 && o.TLSClientCAFile == "" && o.HTTPTLSClientCAFile == "" {
		errs = append(errs, errors.New("--admin.client-identities: needs --grpc.tls-client-ca-file or --http.tls-client-ca-file to verify the clients' certificates"))
	}
	if (o.HTTPTLSCertFile == "") != (o.HTTPTLSKeyFile == "") {
		errs = append(errs, errors.New("--http.tls-cert-file and --http.tls-key-file: give both or neither"))
	}
	if o.HTTPTLSClientCAFile != "" && o.HTTPTLSCertFile == "" {
		errs = append(errs, errors.New("--http.tls-client-ca-file: needs --http.tls-cert-file and --http.tls-key-file"))
	}
	if o.MaxRules < 0 || o.MaxRules > rulesource.MaxMaxRules {
		errs = append(errs, fmt.Errorf("--rules.max-rules: must be 1 to %d, got %d", rulesource.MaxMaxRules, o.MaxRules))
	}
	if len(o.Redis.Addrs) > 0 {
		if err := o.RedisTuning.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	if o.DenyCacheSize < 0 || o.DenyCacheSize > 100_000_000 {
		errs = append(errs, fmt.Errorf("--deny-cache.size: must be 0 to 1e8, got %d", o.DenyCacheSize))
	}
	for _, f := range []struct {
		flag     string
		n, least int64
	}{{"memory.max-bytes", o.MemoryMaxBytes, bucket.MinMaxBytes}, {"fallback.max-bytes", o.FallbackMaxBytes, bucket.MinMaxBytes}} {
		if f.n < f.least || f.n > maxBytesFlag {
			errs = append(errs, fmt.Errorf("--%s: must be %d to %d bytes, got %d", f.flag, f.least, int64(maxBytesFlag), f.n))
		}
	}
	if o.MaxLeaseKeys < 1 || o.MaxLeaseKeys > maxSizeFlag {
		errs = append(errs, fmt.Errorf("--lease.max-keys: must be 1 to %d, got %d", maxSizeFlag, o.MaxLeaseKeys))
	}
	if o.GRPCMaxStreams < 1 || o.GRPCMaxStreams > 1<<20 {
		errs = append(errs, fmt.Errorf("--grpc.max-concurrent-streams: must be 1 to %d, got %d", 1<<20, o.GRPCMaxStreams))
	}
	if o.MaxConnections < 1 || o.MaxConnections > 1<<20 {
		errs = append(errs, fmt.Errorf("--server.max-connections: must be 1 to %d, got %d", 1<<20, o.MaxConnections))
	}
	if o.GracePeriod < 0 {
		errs = append(errs, fmt.Errorf("--shutdown.grace-period: must be >= 0, got %v", o.GracePeriod))
	}
	if o.ShutdownDelay < 0 {
		errs = append(errs, fmt.Errorf("--shutdown.delay: must be >= 0, got %v", o.ShutdownDelay))
	}
	if o.GossipInterval < gossip.MinInterval || o.GossipInterval > time.Minute {
		errs = append(errs, fmt.Errorf("--gossip.interval: must be in [%v, 1m], got %v", gossip.MinInterval, o.GossipInterval))
	}
	if o.GossipMaxDefer != 0 && (o.GossipMaxDefer < o.GossipInterval || o.GossipMaxDefer > time.Minute) {
		errs = append(errs, fmt.Errorf("--gossip.max-defer: must be 0 (off) or in [--gossip.interval (%v), 1m], got %v", o.GossipInterval, o.GossipMaxDefer))
	}
	if o.TopologyPoll < topowatch.MinPoll || o.TopologyPoll > topowatch.MaxPoll {
		errs = append(errs, fmt.Errorf("--region.topology-poll: must be in [%v, %v], got %v", topowatch.MinPoll, topowatch.MaxPoll, o.TopologyPoll))
	}
	if o.ForwardTimeout < 0 || o.ForwardTimeout > time.Minute {
		errs = append(errs, fmt.Errorf("--region.forward-timeout: must be in (0, 1m], got %v", o.ForwardTimeout))
	}
	if o.HandoffMaxWindow != 0 && (o.HandoffMaxWindow < time.Second || o.HandoffMaxWindow > 30*24*time.Hour) {
		errs = append(errs, fmt.Errorf("--region.handoff-max-window: must be 0 (each rule's own window) or in [1s, 720h], got %v", o.HandoffMaxWindow))
	}
	if !instancePattern.MatchString(o.Instance) || len(o.Instance) > 100 {
		errs = append(errs, fmt.Errorf("--instance: %q must match %s", o.Instance, instancePattern))
	}
	if (o.TLSCertFile == "") != (o.TLSKeyFile == "") {
		errs = append(errs, errors.New("--grpc.tls-cert-file and --grpc.tls-key-file: give both or neither"))
	}
	if o.TLSClientCAFile != "" && o.TLSCertFile == "" {
		errs = append(errs, errors.New("--grpc.tls-client-ca-file: needs --grpc.tls-cert-file and --grpc.tls-key-file"))
	}
	if err := o.Redis.Validate(); err != nil {
		errs = append(errs, err)
	}
	// The flags' prefixes, whatever the fields say: the errors name them.
	nats, admin := o.NATSAuth, o.AdminNATSAuth
	nats.Prefix, admin.Prefix = natsconn.FlagPrefix, natsconn.AdminFlagPrefix
	if err := nats.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := admin.Validate(); err != nil {
		errs = append(errs, err)
	}
	if o.NATSURL == "" && (nats != natsconn.Auth{Prefix: natsconn.FlagPrefix} || admin.Set()) {
		errs = append(errs, errors.New("--nats.creds-file, --nats.nkey-seed-file, --nats.tls-*, --admin.nats-*: need --nats.url"))
	}
	if err := o.ForwardAuth.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
