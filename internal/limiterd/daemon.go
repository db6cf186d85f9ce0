// Package limiterd is the limiterd daemon: the gRPC check API over a Redis
// Cluster store (or the embedded in-memory one), its HTTP endpoints and its
// life cycle. Tests run it in-process with New, Start and Stop.
package limiterd

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"

	"github.com/limiterd/limiterd/internal/opshttp"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/rulesource"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// Daemon is one limiterd. Make it with New, then Start and Stop it once.
type Daemon struct {
	opts     Options
	log      *slog.Logger
	registry *prometheus.Registry
	checker  *checker
	redis    *redisstore.Store
	// service is the Check service, also called in-process by forward-auth.
	service *limiterService

	grpcServer *grpc.Server
	health     *health.Server
	httpServer *http.Server
	grpcLis    net.Listener
	httpLis    net.Listener
	ready      atomic.Bool
	served     chan error

	stopGuard  context.CancelFunc
	rules      *rulesource.Source
	regions    int
	admin      *admin
	nc         *nats.Conn
	stopRules  context.CancelFunc
	rulesDone  chan struct{}
	spends     *spendPublisher
	stopSpends context.CancelFunc
	spendsDone chan struct{}
	homeConns  []*grpc.ClientConn
}

// dialHomes prepares a client to every other region's limiterd, for checks
// of pinned rules. Connections are made lazily by gRPC.
func (d *Daemon) dialHomes() error {
	creds := insecure.NewCredentials()
	if d.opts.ForwardTLSCAFile != "" {
		tc, err := clientTLS(d.opts.ForwardTLSCAFile, d.opts.TLSCertFile, d.opts.TLSKeyFile)
		if err != nil {
			return err
		}
		creds = credentials.NewTLS(tc)
	}
	d.checker.homes = make(map[string]limiterv1.LimiterClient)
	for _, r := range d.checker.topo.Regions() {
		if r.Name == d.opts.Region {
			continue
		}
		cc, err := grpc.NewClient(r.LimiterAddress, grpc.WithTransportCredentials(creds))
		if err != nil {
			return fmt.Errorf("--region.topology-file: region %s: %w", r.Name, err)
		}
		d.homeConns = append(d.homeConns, cc)
		d.checker.homes[r.Name] = limiterv1.NewLimiterClient(cc)
	}
	return nil
}

func clientTLS(caFile, certFile, keyFile string) (*tls.Config, error) {
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("--region.forward-tls-ca-file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("--region.forward-tls-ca-file: %s holds no PEM certificate", caFile)
	}
	tc := &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("--grpc.tls-cert-file, --grpc.tls-key-file: %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// New validates opts and loads the rules; it starts nothing.
func New(opts Options) (*Daemon, error) {
	opts.setDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	var d *Daemon
	src, err := rulesource.New(rulesource.Options{
		File: opts.RulesFile, Logger: opts.Logger.With("component", "rules"),
		OnChange: func(set *rules.Set) { d.setRules(set) },
	}, reg)
	if err != nil {
		return nil, fmt.Errorf("--rules.file: %w", err)
	}
	set := src.Current()
	var topo *region.Topology
	regions := 1
	if opts.TopologyFile != "" {
		if topo, err = region.Load(opts.TopologyFile); err != nil {
			return nil, fmt.Errorf("--region.topology-file: %w", err)
		}
		if !topo.Has(opts.Region) {
			return nil, fmt.Errorf("--region: %q is not in --region.topology-file %s", opts.Region, opts.TopologyFile)
		}
		for _, r := range set.Rules() {
			if err := topo.ValidateHomes(r.HomeKeys); err != nil {
				return nil, fmt.Errorf("--rules.file: rule %q: home_keys: %w", r.ID, err)
			}
		}
		regions = len(topo.Names())
	}
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	d = &Daemon{
		opts:     opts,
		log:      opts.Logger.With("region", opts.Region),
		registry: reg,
		rules:    src,
		regions:  regions,
		checker: &checker{fallback: bucket.NewMemory(), m: m, region: opts.Region, topo: topo,
			forwardTimeout: opts.ForwardTimeout, deny: newDenyCache(opts.DenyCacheSize), leases: newLeases()},
		served: make(chan error, 2),
	}
	d.checker.log = d.log
	if dc := d.checker.deny; dc != nil {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "limiter_deny_cache_entries",
			Help: "Denials held by the deny cache.",
		}, func() float64 { return float64(dc.len()) }))
	}
	d.checker.rules.Store(newTable(set, opts.FleetSize, regions, m))
	if d.admin, err = newAdmin(src, opts.AdminTokenFile, opts.TLSClientCAFile != ""); err != nil {
		return nil, err
	}
	return d, nil
}

// setRules puts a new rule set in force; a set whose pinned rules name
// regions the topology lacks is refused, and the rules in force stay.
func (d *Daemon) setRules(set *rules.Set) {
	if d.checker.topo != nil {
		for _, r := range set.Rules() {
			if err := d.checker.topo.ValidateHomes(r.HomeKeys); err != nil {
				d.log.Error("rules refused, the rules in force stay", "rule", r.ID, "err", err)
				return
			}
		}
	}
	d.checker.rules.Store(newTable(set, d.opts.FleetSize, d.regions, d.checker.m))
	if d.checker.deny != nil {
		// Limits may have grown: a remembered denial may no longer hold.
		d.checker.deny.clear()
	}
}

// Registry is the daemon's metrics registry.
func (d *Daemon) Registry() *prometheus.Registry { return d.registry }

// Start connects the store and starts serving. It returns once both
// listeners accept connections.
func (d *Daemon) Start(ctx context.Context) error {
	if len(d.opts.RedisAddrs) == 0 {
		d.log.Info("no --redis.addrs: running on the embedded in-memory store; limits are not shared with other instances",
			"store", "memory")
		d.checker.store = bucket.NewMemory()
	} else {
		d.log.Info("starting limiterd", "store", "redis", "redis_addrs", strings.Join(d.opts.RedisAddrs, ","))
		ro := redisstore.Options{Addrs: d.opts.RedisAddrs, Username: d.opts.RedisUsername,
			Timeout: d.opts.RedisTimeout, PoolSize: d.opts.RedisPoolSize, NoCoalesce: d.opts.RedisNoCoalesce,
			MaxBatch: d.opts.RedisMaxBatch, PipelinesPerNode: d.opts.RedisPipelines, BreakerOpen: d.opts.RedisBreakerOpen}
		if d.opts.RedisPasswordFile != "" {
			b, err := os.ReadFile(d.opts.RedisPasswordFile)
			if err != nil {
				return fmt.Errorf("--redis.password-file: %w", err)
			}
			ro.Password = strings.TrimSpace(string(b))
		}
		if d.opts.RedisTLS {
			ro.TLS = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		connectCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		s, err := redisstore.New(connectCtx, ro, d.registry)
		cancel()
		if err != nil {
			return fmt.Errorf("--redis.addrs: %w", err)
		}
		d.redis = s
		d.checker.store = s
		gctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		guard, err := redisstore.NewGuard(gctx, s, d.opts.RedisAllowUnsafeEviction, d.registry)
		cancel()
		if err != nil {
			d.closeStore()
			return fmt.Errorf("--redis.addrs: %w (--redis.allow-unsafe-eviction overrides)", err)
		}
		for _, r := range guard.Readings() {
			if r.Unsafe() {
				d.log.Warn("a Redis node may evict live counters: limits are then silently lost", "node", r.Node, "policy", r.Policy)
			}
		}
		var lctx context.Context
		lctx, d.stopGuard = context.WithCancel(context.Background())
		go guard.Run(lctx, redisstore.GuardInterval, func(r redisstore.MemoryReading) {
			d.log.Warn("a Redis node may evict live counters: limits are then silently lost", "node", r.Node, "policy", r.Policy)
		})
	}

	if d.checker.topo != nil {
		if err := d.dialHomes(); err != nil {
			d.closeStore()
			return err
		}
	}
	if d.opts.NATSURL != "" {
		nc, err := nats.Connect(d.opts.NATSURL, nats.Name("limiterd "+d.opts.Instance), nats.MaxReconnects(-1),
			nats.RetryOnFailedConnect(true), nats.ReconnectWait(250*time.Millisecond))
		if err != nil {
			d.closeStore()
			return fmt.Errorf("--nats.url: %w", err)
		}
		d.nc = nc
		d.rules.UseNATS(nc)
		// The flush counter starts again at every start: the start time in
		// the name keeps a restarted process (same host, same pid, as in a
		// container) from reusing message ids the streams would drop.
		instance := d.opts.Instance + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
		p, err := newSpendPublisher(nc, d.opts.Region, instance, d.opts.GossipInterval, d.log, d.registry)
		if err != nil {
			d.closeStore()
			return err
		}
		d.spends = p
		d.checker.spends = &p.acc
		pctx, cancel := context.WithCancel(context.Background())
		d.stopSpends = cancel
		d.spendsDone = make(chan struct{})
		go func() {
			p.run(pctx)
			close(d.spendsDone)
		}()
	}

	var gopts []grpc.ServerOption
	if d.opts.TLSCertFile != "" {
		tc, err := serverTLS(d.opts.TLSCertFile, d.opts.TLSKeyFile, d.opts.TLSClientCAFile)
		if err != nil {
			d.closeStore()
			return err
		}
		gopts = append(gopts, grpc.Creds(credentials.NewTLS(tc)))
	}
	gopts = append(gopts, grpc.ChainUnaryInterceptor(d.admin.interceptor))
	d.grpcServer = grpc.NewServer(gopts...)
	d.service = &limiterService{c: d.checker}
	limiterv1.RegisterLimiterServer(d.grpcServer, d.service)
	rlsv3.RegisterRateLimitServiceServer(d.grpcServer, &envoyService{c: d.checker})
	limiterv1.RegisterAdminServer(d.grpcServer, d.admin)
	rctx, stopRules := context.WithCancel(context.Background())
	d.stopRules = stopRules
	d.rulesDone = make(chan struct{})
	go func() {
		d.rules.Run(rctx)
		close(d.rulesDone)
	}()
	d.health = health.NewServer()
	healthpb.RegisterHealthServer(d.grpcServer, d.health)
	reflection.Register(d.grpcServer)

	var err error
	if d.grpcLis, err = net.Listen("tcp", d.opts.GRPCAddress); err != nil {
		d.closeStore()
		return fmt.Errorf("--grpc.listen-address: %w", err)
	}
	if d.httpLis, err = net.Listen("tcp", d.opts.HTTPAddress); err != nil {
		d.grpcLis.Close()
		d.closeStore()
		return fmt.Errorf("--http.listen-address: %w", err)
	}
	// Readiness does not follow the store: a limiterd whose store is down
	// still answers (fail-open rules locally), and taking every instance
	// out of service would turn a store outage into an API outage.
	mux := opshttp.NewMux(d.registry, &d.ready, "not ready")
	d.admin.routes(mux)
	if d.opts.ForwardAuth {
		mux.Handle(ForwardAuthPath, d.forwardAuthHandler())
	}
	d.httpServer = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}

	go func() { d.served <- d.grpcServer.Serve(d.grpcLis) }()
	go func() {
		if err := d.httpServer.Serve(d.httpLis); !errors.Is(err, http.ErrServerClosed) {
			d.served <- err
		}
	}()
	d.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	d.health.SetServingStatus(limiterv1.Limiter_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	d.ready.Store(true)
	d.log.Info("limiterd serving", "grpc", d.grpcLis.Addr().String(), "http", d.httpLis.Addr().String(),
		"rules", len(d.checker.rules.Load().byID))
	return nil
}

// GRPCAddr is the gRPC listener's address, once started.
func (d *Daemon) GRPCAddr() string { return d.grpcLis.Addr().String() }

// HTTPAddr is the HTTP listener's address, once started.
func (d *Daemon) HTTPAddr() string { return d.httpLis.Addr().String() }

// Stop drains the daemon: readiness turns false first, then after the
// shutdown delay the listeners close and in-flight checks finish, for at
// most the grace period, before the store connections close.
func (d *Daemon) Stop(ctx context.Context) error {
	if d.grpcServer == nil {
		return nil
	}
	d.ready.Store(false)
	d.health.Shutdown()
	d.log.Info("draining", "delay", d.opts.ShutdownDelay, "grace_period", d.opts.GracePeriod)
	select {
	case <-time.After(d.opts.ShutdownDelay):
	case <-ctx.Done():
	}
	stopped := make(chan struct{})
	go func() {
		d.grpcServer.GracefulStop()
		close(stopped)
	}()
	grace := time.NewTimer(d.opts.GracePeriod)
	defer grace.Stop()
	select {
	case <-stopped:
	case <-grace.C:
		d.log.Warn("grace period over, cancelling the remaining checks")
		d.grpcServer.Stop()
		<-stopped
	}
	d.refundLeases()
	if d.stopSpends != nil {
		// The last flush, after the last check.
		d.stopSpends()
		<-d.spendsDone
	}
	for _, cc := range d.homeConns {
		cc.Close()
	}
	if d.stopRules != nil {
		d.stopRules()
		<-d.rulesDone
	}
	if d.nc != nil {
		d.nc.Close()
	}
	httpCtx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	err := errors.Join(d.httpServer.Shutdown(httpCtx), d.closeStore())
	d.log.Info("stopped")
	return err
}

// refundLeases gives the tokens leased and not handed out back to the
// shared buckets, where the algorithm allows.
func (d *Daemon) refundLeases() {
	left := d.checker.leases.drain()
	if d.redis == nil || len(left) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	t := d.checker.rules.Load()
	refunded := 0
	for _, l := range left {
		e := t.byID[l.rule]
		if e == nil {
			continue
		}
		if err := d.redis.Refund(ctx, l.rule, l.key, e.limit, l.tokens); err != nil {
			d.log.Warn("leased tokens not given back", "rule", l.rule, "err", err)
			return
		}
		refunded++
	}
	d.log.Info("leased tokens given back", "leases", refunded)
}

func (d *Daemon) closeStore() error {
	if d.stopGuard != nil {
		d.stopGuard()
	}
	if d.redis == nil {
		return nil
	}
	return d.redis.Close()
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

func serverTLS(certFile, keyFile, clientCAFile string) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("--grpc.tls-cert-file, --grpc.tls-key-file: %w", err)
	}
	tc := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if clientCAFile != "" {
		pem, err := os.ReadFile(clientCAFile)
		if err != nil {
			return nil, fmt.Errorf("--grpc.tls-client-ca-file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--grpc.tls-client-ca-file: %s holds no PEM certificate", clientCAFile)
		}
		tc.ClientCAs = pool
		tc.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return tc, nil
}
