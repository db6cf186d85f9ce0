// Package limiterd is the limiterd daemon's wiring: it connects the store,
// NATS and the other regions, builds the decision engine, and serves the
// front doors (gRPC Check, Envoy RLS, the Peer service, the admin API,
// forward-auth) and the operational endpoints. Tests run it in-process
// with New, Start and Stop.
package limiterd

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/redis/go-redis/v9"
	"golang.org/x/net/netutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"

	"github.com/limiterd/limiterd/internal/admin"
	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/topkeys"
	"github.com/limiterd/limiterd/internal/fleet"
	"github.com/limiterd/limiterd/internal/frontdoor/checkapi"
	"github.com/limiterd/limiterd/internal/frontdoor/envoyrls"
	"github.com/limiterd/limiterd/internal/frontdoor/forwardauth"
	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/opshttp"
	"github.com/limiterd/limiterd/internal/peer"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/redisstore/evictguard"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/rulesource"
	"github.com/limiterd/limiterd/internal/secretfile"
	"github.com/limiterd/limiterd/internal/spendpub"
	"github.com/limiterd/limiterd/internal/statuspage"
	"github.com/limiterd/limiterd/internal/tlsconf"
	"github.com/limiterd/limiterd/internal/topowatch"
	"github.com/limiterd/limiterd/internal/topshare"
	"github.com/limiterd/limiterd/internal/tracing"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// Daemon is one limiterd. Make it with New, then Start and Stop it once.
type Daemon struct {
	opts Options
	log  *slog.Logger
	// tracer traces the gRPC calls served and sent; nil: tracing off.
	tracer   *tracing.Tracer
	registry *prometheus.Registry
	rules    *rulesource.Source
	// classes are the priority classes of checks (--priority.classes).
	classes *rules.Classes
	// topo watches --region.topology-file; nil without one.
	topo  *topowatch.Watcher
	admin *admin.Admin
	// top merges the keys refused most over the region; nil until Start.
	top atomic.Pointer[topshare.Share]
	// peersMu guards peers, the connections to the other regions' limiterd.
	peersMu sync.Mutex
	peers   map[string]*peerConn

	mu     sync.Mutex // guards engine against the rules source's callback
	engine *engine.Engine
	redis  *redisstore.Store
	fleet  *fleet.Fleet
	nc     *nats.Conn
	check  *checkapi.Service
	// peerSecret is the content of --region.peer-secret-file.
	peerSecret []byte
	// started names this start of this instance where instances are
	// counted or told apart (the fleet, the shared top keys, spend
	// message ids): --instance and the start time, so that two processes
	// of one name, or a process restarted under its name (same host, same
	// pid, as in a container), are never taken for one.
	started string

	grpcServer *grpc.Server
	health     *health.Server
	httpServer *http.Server
	grpcLis    net.Listener
	httpLis    net.Listener
	// faServer and faLis serve forward-auth on its own listener, when
	// --forward-auth.listen-address is set.
	faServer *http.Server
	faLis    net.Listener
	ready    atomic.Bool
	served   chan error

	// undo are Start's steps' undos, run in reverse by Stop or by a Start
	// that fails; background holds the goroutines they stop.
	undo       []func()
	background sync.WaitGroup
}

// New validates opts and loads the rules; it starts nothing.
func New(opts Options) (*Daemon, error) {
	opts = opts.derived()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	d := &Daemon{opts: opts, log: opts.Logger.With("region", opts.Region.Name), registry: reg, served: make(chan error, 3)}
	var err error
	if d.classes, err = rules.NewClasses(opts.Rules.PriorityClasses); err != nil {
		return nil, fmt.Errorf("--priority.classes: %w", err)
	}
	validate := d.classes.CheckRule
	if opts.Region.TopologyFile != "" {
		if d.topo, err = topowatch.New(topowatch.Options{File: opts.Region.TopologyFile, Region: opts.Region.Name, Poll: opts.Region.TopologyPoll,
			Validate: d.validateTopology, OnSwitch: d.switchTopology, Logger: d.log}, reg); err != nil {
			if errors.Is(err, topowatch.ErrOwnRegionMissing) {
				return nil, fmt.Errorf("--region: %q is not in --region.topology-file %s", opts.Region.Name, opts.Region.TopologyFile)
			}
			return nil, fmt.Errorf("--region.topology-file: %w", err)
		}
		validate = func(r *rules.Rule) error {
			if err := d.classes.CheckRule(r); err != nil {
				return err
			}
			return d.homesValid(r)
		}
	}
	src, err := rulesource.New(rulesource.Options{
		File: opts.Rules.File, Logger: opts.Logger.With("component", "rules"),
		MaxRules: opts.Rules.MaxRules, ValidateRule: validate, OnChange: d.setRules,
		// With an identity of its own and none for the admin API, this
		// limiterd reads rules only: its admin API says so at once.
		ReadOnly: opts.NATS.Auth.Set() && !opts.Admin.NATSAuth.Set(),
	}, reg)
	if err != nil {
		return nil, fmt.Errorf("--rules.file: %w", err)
	}
	d.rules = src
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if d.admin, err = admin.New(src, admin.Options{TokenFile: opts.Admin.TokenFile,
		ClientIdentities: opts.Admin.ClientIdentities, Top: admin.TopFunc(d.topLimited), Resetter: resetter{d},
		Logger: d.log.With("component", "admin")}, reg); err != nil {
		return nil, err
	}
	return d, nil
}

// topLimited answers the admin API's TopLimited once the engine runs.
func (d *Daemon) topLimited(ctx context.Context, ruleID string, k int) ([]topkeys.Entry, int, error) {
	top := d.top.Load()
	if top == nil {
		return nil, 0, errors.New("not started")
	}
	return top.Top(ctx, ruleID, k)
}

// resetTimeout bounds a key's reset in the store when its caller set no
// deadline.
const resetTimeout = 5 * time.Second

// resetter answers the admin API's ResetKey once the engine runs, with
// the engine's errors as the admin API's.
type resetter struct{ d *Daemon }

func (r resetter) ResetKey(ctx context.Context, ruleID, key string) (bool, error) {
	r.d.mu.Lock()
	e := r.d.engine
	r.d.mu.Unlock()
	if e == nil {
		return false, errors.New("not started")
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, resetTimeout)
		defer cancel()
	}
	propagated, err := e.ResetKey(ctx, ruleID, key)
	var invalid *request.InvalidError
	switch {
	case errors.Is(err, request.ErrUnknownRule):
		return false, fmt.Errorf("%w: %w", rulesource.ErrNotFound, err)
	case errors.As(err, &invalid):
		return false, fmt.Errorf("%w: %w", rules.ErrInvalid, err)
	case errors.Is(err, engine.ErrNotHome):
		return false, fmt.Errorf("%w: %w", admin.ErrNotHome, err)
	}
	return propagated, err
}

// homesValid checks a rule's home_keys against the topology in force and
// the one pending, if any: a rule is not put in force that the next switch
// would refuse.
func (d *Daemon) homesValid(r *rules.Rule) error {
	if err := rules.HomesIn(d.topo.Active())(r); err != nil {
		return err
	}
	if p := d.topo.Pending(); p != nil {
		return rules.HomesIn(p)(r)
	}
	return nil
}

// validateTopology checks the rules in force against a new topology.
func (d *Daemon) validateTopology(next *region.Topology) error {
	check := rules.HomesIn(next)
	for _, r := range d.rules.Current().Rules() {
		if err := check(r); err != nil {
			return err
		}
	}
	return nil
}

// peerConn is a connection to another region's limiterd.
type peerConn struct {
	addr string
	cc   *grpc.ClientConn
}

// switchTopology puts next in force: Peer clients are dialed for the regions
// it adds (or whose address changed), the engine routes the checks that
// start from now on with it, and the connections only the old topology
// used are closed once the checks and refunds that started under it are
// over.
func (d *Daemon) switchTopology(old, next *region.Topology) error {
	d.mu.Lock()
	e := d.engine
	d.mu.Unlock()
	if e == nil {
		return errors.New("limiterd not started")
	}
	clients, dialed, retired, err := d.dialHomes(next)
	if err != nil {
		return err
	}
	if err := e.SetTopology(next, clients, func() { closePeers(retired) }); err != nil {
		d.peersMu.Lock()
		for name, pc := range dialed {
			if d.peers[name] == pc {
				delete(d.peers, name)
			}
		}
		for key, pc := range retired {
			name, _, _ := strings.Cut(key, " ")
			d.peers[name] = pc
		}
		d.peersMu.Unlock()
		closePeers(dialed)
		return err
	}
	return nil
}

func closePeers(m map[string]*peerConn) {
	for _, pc := range m {
		pc.cc.Close()
	}
}

// setRules puts a new rule set in force. The rules source validated it
// against the topology; an error here (the engine refusing it anyway)
// makes the source keep the rules in force and count the failure.
func (d *Daemon) setRules(set *rules.Set) error {
	d.mu.Lock()
	e := d.engine
	d.mu.Unlock()
	if e == nil {
		return nil // Start builds the engine with the rules current then.
	}
	return e.SetRules(set)
}

// Registry is the daemon's metrics registry.
func (d *Daemon) Registry() *prometheus.Registry { return d.registry }

// onStop registers the undo of a step of Start.
func (d *Daemon) onStop(f func()) { d.undo = append(d.undo, f) }

// stopAll runs the undos in reverse and waits for the background work.
func (d *Daemon) stopAll() {
	for i := len(d.undo) - 1; i >= 0; i-- {
		d.undo[i]()
	}
	d.undo = nil
	d.background.Wait()
}

// goBackground runs f until the context stopped by Stop (or a failed
// Start) ends.
func (d *Daemon) goBackground(f func(ctx context.Context)) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	d.background.Add(1)
	go func() {
		defer d.background.Done()
		defer close(done)
		f(ctx)
	}()
	d.onStop(func() {
		cancel()
		<-done
	})
}

// Start connects the store and NATS and starts serving; it returns once
// every listener accepts connections. The store and NATS need not be
// reachable: checks are then decided by each rule's on_failure, and the
// connections are made when they come back. When Start fails, whatever it
// had started is stopped again.
func (d *Daemon) Start(ctx context.Context) (err error) {
	defer func() {
		if err != nil {
			d.stopAll()
		}
	}()
	d.started = d.opts.Region.Instance + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	if d.tracer, err = tracing.Start(d.opts.Tracing, "limiterd", d.opts.Region.Name, d.opts.Region.Instance); err != nil {
		return err
	}
	// Last of all at a stop: the spans of the last calls go out.
	d.onStop(func() {
		if err := d.tracer.Shutdown(2 * time.Second); err != nil {
			d.log.Warn("spans not sent at shutdown", "err", err)
		}
	})
	store, err := d.startStore(ctx)
	if err != nil {
		return err
	}
	var fleetClient = d.redisClient()
	if d.fleet, err = fleet.New(fleetClient, fleet.Options{Region: d.opts.Region.Name, Instance: d.started,
		Fixed: d.opts.Region.FleetSize, Logger: d.log.With("component", "fleet")}, d.registry); err != nil {
		return err
	}
	if fleetClient != nil {
		d.goBackground(d.fleet.Run)
	}

	eopts := engine.Options{
		Store: store, Region: d.opts.Region.Name, ForwardTimeout: d.opts.Region.ForwardTimeout, HandoffMaxWindow: d.opts.Region.HandoffMaxWindow,
		DenyCacheSize: cmp.Or(d.opts.Memory.DenyCacheSize, -1), FallbackMaxBytes: d.opts.Memory.FallbackMaxBytes, MaxLeaseKeys: d.opts.Memory.MaxLeaseKeys,
		FleetSize: d.fleet.Size, KeyAffinity: d.opts.NATS.GossipKeyAffinity, TopLimitedSize: cmp.Or(d.opts.Memory.TopLimitedSize, -1), Logger: d.log,
		Classes: d.classes,
	}
	var spends interface {
		Run(context.Context)
	}
	if d.opts.NATS.URL != "" {
		natsconn.WarnURLSecrets("--nats.url", d.opts.NATS.URL, d.log)
		if d.opts.NATS.GossipInterval > bucket.DebtHorizon/2 {
			// A key's debt is bounded by capacity + rate x DebtHorizon: with
			// flushes this far apart, a fast rule's remote spending beyond
			// that bound is dropped by the debit.
			d.log.Warn("--gossip.interval is over half the debt horizon: other regions may debit a fast rule's key less than it spent here",
				"interval", d.opts.NATS.GossipInterval, "debt_horizon", bucket.DebtHorizon)
		}
		auth, err := d.opts.NATS.Auth.Options(d.log)
		if err != nil {
			return err
		}
		auth = append(auth, natsconn.Inbox(natsconn.IdentityName("limiterd", d.opts.Region.Name)))
		nc, err := natsconn.Connect(d.opts.NATS.URL, "limiterd "+d.opts.Region.Instance, d.log, auth...)
		if err != nil {
			return fmt.Errorf("--nats.url: %w", err)
		}
		d.nc = nc
		d.onStop(nc.Close)
		d.rules.UseNATS(nc)
		if d.opts.Admin.NATSAuth.Set() {
			// The admin API's own identity, the only one allowed to write
			// the rules bucket; the main one only reads it.
			admin := d.opts.Admin.NATSAuth
			admin.TLSCAFile, admin.TLSCertFile, admin.TLSKeyFile = d.opts.NATS.Auth.TLSCAFile, d.opts.NATS.Auth.TLSCertFile, d.opts.NATS.Auth.TLSKeyFile
			wopts, err := admin.Options(d.log)
			if err != nil {
				return err
			}
			wopts = append(wopts, natsconn.Inbox(natsconn.IdentityName("admin", "")))
			wc, err := natsconn.Connect(d.opts.NATS.URL, "limiterd admin "+d.opts.Region.Instance, d.log.With("component", "admin"), wopts...)
			if err != nil {
				return fmt.Errorf("--nats.url: %w", err)
			}
			d.onStop(wc.Close)
			d.rules.UseWriter(wc)
		}
		// The flush counter starts again at every start: d.started keeps
		// a restarted process from reusing message ids the streams would
		// drop.
		p, err := newPublisher(nc, d.opts, d.started, d.log, d.registry)
		if err != nil {
			return err
		}
		eopts.Spends, eopts.Resets = p.Accumulator(), p.Accumulator()
		if d.tracer != nil {
			// A sampled check's flush carries its span context.
			eopts.SpendSpans = p
		}
		spends = p
	}
	if d.opts.Region.PeerSecretFile != "" {
		// Read once: sent by the Peer clients, required by the Peer service.
		if d.peerSecret, err = peer.ReadSecret(d.opts.Region.PeerSecretFile, d.log); err != nil {
			return err
		}
		// The fleet's processes give back each other's reservations and
		// settle each other's settlements.
		eopts.ReservationSecret = d.peerSecret
	}
	if d.topo != nil {
		eopts.Topology = d.topo.Active()
		if eopts.Homes, _, _, err = d.dialHomes(eopts.Topology); err != nil {
			return err
		}
		d.onStop(func() {
			d.peersMu.Lock()
			closePeers(d.peers)
			d.peers = nil
			d.peersMu.Unlock()
		})
		eopts.ReloadTopology = func() { d.topo.Reload() }
	}
	e, err := engine.New(eopts, d.rules.Current(), d.registry)
	if err != nil {
		return err
	}
	// A removed region's connection, kept for the handoff window of the
	// keys it homed, is closed at once on Stop.
	d.onStop(e.StopHandoffs)
	d.mu.Lock()
	d.engine = e
	d.mu.Unlock()
	top, err := topshare.New(e, d.redisClient(), d.started, d.log.With("component", "top-limited"), d.registry)
	if err != nil {
		return err
	}
	d.top.Store(top)
	d.goBackground(top.Run)
	if d.topo != nil {
		d.goBackground(d.topo.Run)
	}
	d.check = checkapi.New(e)
	// The last flush runs after the last check (Stop stops the servers
	// first): it is registered before them, so it is undone after.
	if spends != nil {
		d.goBackground(spends.Run)
	}
	d.onStop(d.refundLeases)
	d.goBackground(func(ctx context.Context) { d.rules.Run(ctx) })

	if err := d.startServers(); err != nil {
		return err
	}
	d.goBackground(d.watchDependencies)
	d.ready.Store(true)
	d.log.Info("limiterd serving", "grpc", d.grpcLis.Addr().String(), "http", d.httpLis.Addr().String(),
		"rules", len(d.rules.Current().Rules()))
	return nil
}

// startStore connects the Redis store (or makes the embedded one) and its
// eviction guard.
func (d *Daemon) startStore(ctx context.Context) (bucket.Backend, error) {
	if len(d.opts.Redis.Addrs) == 0 {
		d.log.Info("no --redis.addrs: running on the embedded in-memory store; limits are not shared with other instances",
			"store", "memory", "max_bytes", d.opts.Memory.MaxBytes)
		m := bucket.NewMemory(bucket.WithMaxBytes(d.opts.Memory.MaxBytes))
		for _, c := range metrics.MemoryCollectors(m, "embedded") {
			if err := d.registry.Register(c); err != nil {
				return nil, err
			}
		}
		return m, nil
	}
	d.log.Info("starting limiterd", "store", "redis", "redis_addrs", strings.Join(d.opts.Redis.Addrs, ","))
	ro, err := d.opts.Redis.Options(d.log)
	if err != nil {
		return nil, err
	}
	d.opts.RedisTuning.Apply(&ro)
	connectCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	s, err := redisstore.New(connectCtx, ro, d.registry)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("--redis.addrs: %w", err)
	}
	d.redis = s
	d.onStop(func() {
		if err := s.Close(); err != nil {
			d.log.Warn("store closed with an error", "err", err)
		}
	})
	gctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	guard, err := evictguard.New(gctx, s, d.opts.RedisAllowUnsafeEviction, d.registry)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("--redis.addrs: %w (--redis.allow-unsafe-eviction overrides)", err)
	}
	for _, r := range guard.Readings() {
		if r.Unsafe() {
			d.log.Warn("a Redis node may evict live counters: limits are then silently lost", "node", r.Node, "policy", r.Policy)
		}
	}
	d.goBackground(func(ctx context.Context) {
		guard.Run(ctx, evictguard.Interval, func(r evictguard.MemoryReading) {
			d.log.Warn("a Redis node may evict live counters: limits are then silently lost", "node", r.Node, "policy", r.Policy)
		})
	})
	return s, nil
}

func (d *Daemon) redisClient() redis.UniversalClient {
	if d.redis == nil {
		return nil
	}
	return d.redis.Client()
}

// newPublisher makes the spend publisher of this instance.
func newPublisher(nc *nats.Conn, o Options, instance string, log *slog.Logger, reg prometheus.Registerer) (*spendpub.Publisher, error) {
	return spendpub.New(nc, o.Region.Name, instance, o.NATS.GossipInterval, o.NATS.GossipMaxDefer, o.NATS.GossipSpoolDir, log.With("component", "spends"), reg)
}

// dialHomes prepares a Peer client to every other region's limiterd of
// topo, for checks of pinned rules, reusing the connections to regions
// whose address did not change. It returns the clients, the connections
// dialed for topo, and those topo no longer uses (removed from d.peers, to
// close when the old topology is retired). Each connection is set up at
// once and kept however long it idles, so the first check forwarded to a
// region, at start or after a quiet hour, takes one round trip and not
// the handshake's delay on top: behind 100 ms of distance that is the
// difference between an answer and a fail-closed refusal at the default
// forward timeout.
func (d *Daemon) dialHomes(topo *region.Topology) (clients map[string]homes.Home, dialed, retired map[string]*peerConn, err error) {
	creds := insecure.NewCredentials()
	if d.opts.Region.ForwardTLSCAFile != "" {
		tc, err := clientTLS(d.opts.Region.ForwardTLSCAFile, d.opts.Server.TLSCertFile, d.opts.Server.TLSKeyFile)
		if err != nil {
			return nil, nil, nil, err
		}
		creds = credentials.NewTLS(tc)
	}
	d.peersMu.Lock()
	defer d.peersMu.Unlock()
	if d.peers == nil {
		d.peers = make(map[string]*peerConn)
	}
	clients, dialed, retired = make(map[string]homes.Home), make(map[string]*peerConn), make(map[string]*peerConn)
	for _, r := range topo.Regions() {
		if r.Name == d.opts.Region.Name {
			continue
		}
		pc := d.peers[r.Name]
		if pc == nil || pc.addr != r.LimiterAddress {
			cc, err := grpc.NewClient(r.LimiterAddress, append(d.tracer.DialOptions(), grpc.WithTransportCredentials(creds), grpc.WithIdleTimeout(0),
				grpc.WithConnectParams(grpc.ConnectParams{Backoff: peerBackoff, MinConnectTimeout: peerConnectTimeout}))...)
			if err != nil {
				for name, pc := range dialed {
					delete(d.peers, name)
					pc.cc.Close()
				}
				return nil, nil, nil, fmt.Errorf("--region.topology-file: region %s: %w", r.Name, err)
			}
			if pc != nil {
				retired[r.Name+" "+pc.addr] = pc
			}
			cc.Connect()
			pc = &peerConn{addr: r.LimiterAddress, cc: cc}
			d.peers[r.Name] = pc
			dialed[r.Name] = pc
		}
		clients[r.Name] = peer.NewClient(pc.cc, d.opts.Region.Name, d.peerSecret).WithGeneration(topo.Generation())
	}
	for name, pc := range d.peers {
		if name != d.opts.Region.Name && !topo.Has(name) {
			retired[name] = pc
			delete(d.peers, name)
		}
	}
	return clients, dialed, retired, nil
}

// peerBackoff paces the reconnects to another region's limiterd. A
// forwarded check fails at once while its link is down (the rule's
// on_failure decides), so the wait between attempts is how long a region
// that came back, or started after this one, stays unused: at most
// MaxDelay, not gRPC's default two minutes.
var peerBackoff = backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second}

// peerConnectTimeout bounds one connection attempt to another region,
// handshake included: ten round trips at the longest distance served.
const peerConnectTimeout = 3 * time.Second

// startServers makes the gRPC and HTTP servers and starts serving.
func (d *Daemon) startServers() error {
	var gopts []grpc.ServerOption
	if d.opts.Server.TLSCertFile != "" {
		tc, err := serverTLS(d.opts.Server.TLSCertFile, d.opts.Server.TLSKeyFile, d.opts.Server.TLSClientCAFile)
		if err != nil {
			return err
		}
		gopts = append(gopts, grpc.Creds(credentials.NewTLS(tc)))
	}
	auth := peer.Auth{Identities: d.opts.Region.PeerIdentities, Secret: d.peerSecret}
	var topos peer.Topologies
	if d.topo != nil {
		topos = d.topo
	}
	peers, err := peer.NewService(d.engine, d.opts.Region.Name, topos, auth, d.registry)
	if err != nil {
		return err
	}
	// One interceptor, and no chain of them: a chain allocates a handler
	// per call and level.
	intercept := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if err := d.admin.Authorize(ctx, info.FullMethod); err != nil {
			return nil, err
		}
		return h(ctx, req)
	}
	gopts = append(gopts, grpc.UnaryInterceptor(intercept),
		grpc.MaxConcurrentStreams(uint32(d.opts.Server.GRPCMaxStreams)),
		grpc.MaxRecvMsgSize(grpcMaxRecvBytes),
		grpc.MaxHeaderListSize(grpcMaxHeaderBytes),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: grpcKeepaliveMinTime, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: grpcMaxConnectionIdle,
			MaxConnectionAge: grpcMaxConnectionAge, MaxConnectionAgeGrace: grpcMaxConnectionGrace}))
	if h := d.tracer.ServerHandler(); h != nil {
		gopts = append(gopts, grpc.StatsHandler(h))
	}
	d.grpcServer = grpc.NewServer(gopts...)
	limiterv1.RegisterLimiterServer(d.grpcServer, d.check)
	envoy, err := envoyrls.New(d.engine, envoyrls.Options{QuotaHeaders: d.opts.Server.EnvoyQuotaHeaders}, d.registry)
	if err != nil {
		return err
	}
	rlsv3.RegisterRateLimitServiceServer(d.grpcServer, envoy)
	limiterv1.RegisterAdminServer(d.grpcServer, d.admin)
	limiterv1.RegisterPeerServer(d.grpcServer, peers)
	d.health = health.NewServer()
	healthpb.RegisterHealthServer(d.grpcServer, d.health)
	reflection.Register(d.grpcServer)

	if d.grpcLis, err = net.Listen("tcp", d.opts.Server.GRPCAddress); err != nil {
		return fmt.Errorf("--grpc.listen-address: %w", err)
	}
	d.onStop(func() { d.grpcLis.Close() })
	d.grpcLis = netutil.LimitListener(d.grpcLis, d.opts.Server.MaxConnections)
	var httpTLS *tls.Config
	if d.opts.Server.HTTPTLSCertFile != "" {
		if httpTLS, err = tlsconf.Server(tlsconf.Files{Cert: d.opts.Server.HTTPTLSCertFile, Key: d.opts.Server.HTTPTLSKeyFile, CA: d.opts.Server.HTTPTLSClientCAFile,
			CertFlag: "--http.tls-cert-file", KeyFlag: "--http.tls-key-file", CAFlag: "--http.tls-client-ca-file"}); err != nil {
			return err
		}
	} else if d.opts.Admin.TokenFile != "" && !loopbackOnly(d.opts.Server.HTTPAddress) {
		d.log.Warn("the admin token travels in clear: the HTTP listener is plaintext on a non-loopback address; set --http.tls-cert-file and --http.tls-key-file",
			"http", d.opts.Server.HTTPAddress)
	}
	var fa, usage http.Handler
	if d.opts.ForwardAuth.Serving() {
		if fa, usage, err = d.forwardAuthHandlers(); err != nil {
			return err
		}
	}
	// Readiness does not follow the store: a limiterd whose store is down
	// still answers (by each rule's on_failure), and taking every instance
	// out of service would turn a store outage into an API outage. /readyz
	// says which dependency is missing.
	mux := opshttp.NewMuxDetail(d.registry, &d.ready, "not ready", d.dependencies)
	d.admin.Routes(mux)
	if d.opts.Server.Profiling {
		opshttp.Profiling(mux)
		if !loopbackOnly(d.opts.Server.HTTPAddress) {
			d.log.Warn("profiles are served to anyone who reaches the HTTP listener (--http.pprof on a non-loopback address)", "http", d.opts.Server.HTTPAddress)
		}
	}
	if fa != nil && d.opts.ForwardAuth.Address == "" {
		mux.Handle(forwardauth.Path, fa)
	}
	if usage != nil {
		// On the HTTP listener, wherever forward-auth is.
		mux.Handle(forwardauth.UsagePath, usage)
	}
	// The status page: "/{$}" is "/" alone, so an unknown path is still 404.
	mux.Handle("/{$}", d.admin.Page(statuspage.Handler(*d.statusPage())))
	if d.httpLis, d.httpServer, err = d.serveHTTP("--http.listen-address", d.opts.Server.HTTPAddress, mux, httpTLS); err != nil {
		return err
	}
	if fa != nil && d.opts.ForwardAuth.Address != "" {
		faMux := http.NewServeMux()
		faMux.Handle(forwardauth.Path, fa)
		if d.faLis, d.faServer, err = d.serveHTTP("--forward-auth.listen-address", d.opts.ForwardAuth.Address, faMux, httpTLS); err != nil {
			return err
		}
	}

	grpcDone := make(chan struct{})
	go func() {
		defer close(grpcDone)
		d.served <- d.grpcServer.Serve(d.grpcLis)
	}()
	// Undone before the listeners: the servers stop first.
	d.onStop(func() {
		d.grpcServer.Stop()
		<-grpcDone
	})
	d.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	d.health.SetServingStatus(limiterv1.Limiter_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	return nil
}

// serveHTTP listens on addr (flag names it in errors) and serves h there,
// over TLS when tc is set, with the connection limit and the deadlines of
// every HTTP listener; Stop, or a failed Start, closes it.
func (d *Daemon) serveHTTP(flag, addr string, h http.Handler, tc *tls.Config) (net.Listener, *http.Server, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", flag, err)
	}
	d.onStop(func() { lis.Close() })
	lis = netutil.LimitListener(lis, d.opts.Server.MaxConnections)
	// Every phase of an HTTP connection has a deadline: a body trickled in
	// or an idle keep-alive cannot hold a connection (and a descriptor).
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: httpTimeouts.read,
		WriteTimeout: httpTimeouts.write, IdleTimeout: httpTimeouts.idle, MaxHeaderBytes: httpMaxHeaderBytes, TLSConfig: tc}
	done := make(chan struct{})
	go func() {
		defer close(done)
		var err error
		if tc != nil {
			err = srv.ServeTLS(lis, "", "")
		} else {
			err = srv.Serve(lis)
		}
		if !errors.Is(err, http.ErrServerClosed) {
			d.served <- err
		}
	}()
	d.onStop(func() {
		srv.Close()
		<-done
	})
	return lis, srv, nil
}

// forwardAuthHandlers are /forward-auth and /v1/usage, both behind the
// shared secret when --forward-auth.secret-file is set; refusals are
// counted.
func (d *Daemon) forwardAuthHandlers() (fa, usage http.Handler, err error) {
	fa = forwardauth.Handler(d.opts.ForwardAuth.Headers, d.check, d.log)
	usage = forwardauth.UsageHandler(d.check, d.log)
	if d.opts.ForwardAuth.SecretFile == "" {
		return fa, usage, nil
	}
	secret, err := secretfile.Read("--forward-auth.secret-file", d.opts.ForwardAuth.SecretFile, forwardauth.MinSecretLen, d.log)
	if err != nil {
		return nil, nil, err
	}
	refused := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "limiter_forward_auth_unauthenticated_total",
		Help: "Forward-auth requests refused (401) for lacking the secret of --forward-auth.secret-file.",
	})
	if err := d.registry.Register(refused); err != nil {
		return nil, nil, err
	}
	return forwardauth.RequireSecret(secret, refused.Inc, fa), forwardauth.RequireSecret(secret, refused.Inc, usage), nil
}

// loopbackOnly reports whether a listen address binds loopback only.
func loopbackOnly(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// watchDependencies logs the store's and NATS's state at start and each
// time it changes, so the log says which dependency is missing.
func (d *Daemon) watchDependencies(ctx context.Context) {
	last := map[string]string{}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		for _, line := range strings.Split(d.dependencies(), "\n") {
			name, state, _ := strings.Cut(line, ": ")
			ok := strings.HasPrefix(state, "ok") || strings.HasPrefix(state, "embedded") || strings.HasPrefix(state, "not configured")
			if last[name] == state || (last[name] == "" && ok) {
				last[name] = state
				continue
			}
			if ok {
				d.log.Info("dependency back", "dependency", name, "state", state)
			} else {
				d.log.Warn("dependency missing: checks it cannot serve follow each rule's on_failure", "dependency", name, "state", state)
			}
			last[name] = state
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// dependencies lists the state of the store and NATS for /readyz.
func (d *Daemon) dependencies() string {
	var lines []string
	// Health is read once: the store may heal between two reads.
	var health error
	if d.redis != nil {
		health = d.redis.Health()
	}
	switch {
	case d.redis == nil:
		lines = append(lines, "store: embedded memory")
	case health != nil:
		lines = append(lines, "store: redis not healthy, checks it cannot decide follow each rule's on_failure: "+health.Error())
	default:
		lines = append(lines, "store: redis ok")
	}
	switch {
	case d.opts.NATS.URL == "":
		lines = append(lines, "nats: not configured (no reconciliation, rules from the file only)")
	case d.nc == nil || !d.nc.IsConnected():
		lines = append(lines, "nats: unreachable, spends wait in the backlog: "+natsconn.Redact(d.opts.NATS.URL))
	default:
		lines = append(lines, "nats: ok")
	}
	return strings.Join(lines, "\n")
}

// GRPCAddr is the gRPC listener's address, once started.
func (d *Daemon) GRPCAddr() string { return d.grpcLis.Addr().String() }

// HTTPAddr is the HTTP listener's address, once started.
func (d *Daemon) HTTPAddr() string { return d.httpLis.Addr().String() }

// ForwardAuthAddr is forward-auth's own listener's address, once started
// with --forward-auth.listen-address; "" without it.
func (d *Daemon) ForwardAuthAddr() string {
	if d.faLis == nil {
		return ""
	}
	return d.faLis.Addr().String()
}

// Stop drains the daemon: readiness turns false first, then after the
// shutdown delay the gRPC and HTTP servers stop taking checks and the
// in-flight ones finish, for at most the grace period; then the refunds to
// home regions finish, leased tokens go back, the last spends are flushed,
// and the connections close.
func (d *Daemon) Stop(ctx context.Context) error {
	if d.grpcServer == nil {
		return nil
	}
	d.ready.Store(false)
	d.health.Shutdown()
	d.log.Info("draining", "delay", d.opts.Server.ShutdownDelay, "grace_period", d.opts.Server.GracePeriod)
	select {
	case <-time.After(d.opts.Server.ShutdownDelay):
	case <-ctx.Done():
	}
	grace, cancel := context.WithTimeout(context.Background(), d.opts.Server.GracePeriod)
	defer cancel()
	stopped := make(chan struct{})
	go func() {
		d.grpcServer.GracefulStop()
		close(stopped)
	}()
	httpErr := d.httpServer.Shutdown(grace)
	if d.faServer != nil {
		httpErr = errors.Join(httpErr, d.faServer.Shutdown(grace))
	}
	select {
	case <-stopped:
	case <-grace.Done():
		d.log.Warn("grace period over, cancelling the remaining checks")
		d.grpcServer.Stop()
		<-stopped
	}
	if errors.Is(httpErr, context.DeadlineExceeded) {
		httpErr = nil // closed by the undo below
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 2*time.Second)
	if err := d.engine.Wait(wctx); err != nil {
		d.log.Warn("refunds to home regions still under way at shutdown", "err", err)
	}
	wcancel()
	d.stopAll()
	d.log.Info("stopped")
	return httpErr
}

// refundLeases gives the tokens leased and not handed out back to the
// shared buckets, where the algorithm allows.
func (d *Daemon) refundLeases() {
	if d.engine == nil {
		return
	}
	left := d.engine.DrainLeases()
	if d.redis == nil || len(left) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	refunded := 0
	for _, l := range left {
		if err := d.redis.Refund(ctx, l.Rule, l.Key, l.Limit, l.Tokens); err != nil {
			d.log.Warn("leased tokens not given back", "rule", l.Rule, "err", err)
			return
		}
		refunded++
	}
	d.log.Info("leased tokens given back", "leases", refunded)
}

// Run starts a daemon and serves until ctx ends or a server fails, then
// drains it.
func Run(ctx context.Context, opts Options) error {
	d, err := New(opts)
	if err != nil {
		return err
	}
	if err := d.Start(ctx); err != nil {
		return err
	}
	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-d.served:
	}
	return errors.Join(serveErr, d.Stop(context.Background()))
}

func clientTLS(caFile, certFile, keyFile string) (*tls.Config, error) {
	return tlsconf.Client(tlsconf.Files{CA: caFile, Cert: certFile, Key: keyFile,
		CAFlag: "--region.forward-tls-ca-file", CertFlag: "--grpc.tls-cert-file", KeyFlag: "--grpc.tls-key-file"})
}

func serverTLS(certFile, keyFile, clientCAFile string) (*tls.Config, error) {
	return tlsconf.Server(tlsconf.Files{Cert: certFile, Key: keyFile, CA: clientCAFile,
		CertFlag: "--grpc.tls-cert-file", KeyFlag: "--grpc.tls-key-file", CAFlag: "--grpc.tls-client-ca-file"})
}
