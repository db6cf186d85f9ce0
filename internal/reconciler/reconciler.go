// Package reconciler is the reconciler daemon: it relays its region's
// limiterd flushes to the region's spends stream, in the region's own
// JetStream cluster, and applies every other region's spends, sourced into
// the region's inbound stream, to this region's buckets, at most once each.
//
// Concurrency: one relay loop, in the reconciler that holds the region's
// relay lease (relay.go: it merges the flushes it reads in one go into one
// message per partition, gossip.PartitionSubject); per other region one
// retry loop; and one apply loop per partition that this reconciler holds
// the lease of. The region's reconcilers spread the relay and the
// partitions among them, one reconciler per lease at a time (package
// lease, in the region's NATS key-value bucket). A partition's loop reads
// it in stream order from the position
// stored in Redis, with an ephemeral consumer and no acks, applies
// up to 64 messages in one round trip per Redis node, and stores the
// position reached (partition.go). So each partition of a region's spends
// is applied in sequence, and the partitions side by side; that order, and
// a client's marker per partition, are what let the debit script tell a
// message read again from a new one. More reconcilers apply more
// partitions at once, up to one per partition. When one dies, its
// leases go to the others once they expire (--apply.lease-ttl):
// partitions are read from the positions stored (what it applied after
// them is read again and known by the markers and flush records), and the
// relay from the partitions' last messages. A client whose Redis node
// fails is not waited for: its debits go to the retry stream, in order,
// under a subject of its slot's bucket, and until that bucket's retries are
// applied every later debit of a client of the bucket follows them there;
// the retry loop applies them in the same order with the same markers. The
// region's reconcilers share each source's durable retry consumer, which
// hands out one entry at a time: it needs no lease. A topology switch that
// removes a region stops all of its loops, and waits for them, before the
// new topology is in force.
// Package apply applies each batch of messages and each retry entry,
// package lease places the partitions, and package streamsrc follows the
// inbound stream's sources; this package sets up the streams and
// consumers, runs the loops and follows the topology.
package reconciler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"golang.org/x/sync/errgroup"

	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/opshttp"
	"github.com/limiterd/limiterd/internal/reconciler/apply"
	"github.com/limiterd/limiterd/internal/reconciler/lease"
	"github.com/limiterd/limiterd/internal/reconciler/streamsrc"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/rulesource"
	"github.com/limiterd/limiterd/internal/topowatch"
	"github.com/limiterd/limiterd/internal/tracing"
	"github.com/limiterd/limiterd/pkg/gossip"
	"github.com/limiterd/limiterd/pkg/region"
)

// Defaults of the flags.
const (
	DefaultHTTPAddress    = "127.0.0.1:9191"
	DefaultAckWait        = 10 * time.Second
	DefaultStreamMaxAge   = time.Hour
	DefaultStreamMaxBytes = 256 << 20
	DefaultApplyTimeout   = apply.DefaultTimeout
	DefaultPartitions     = 8
	// DefaultClockAllowance is --apply.clock-allowance's default: well
	// above what NTP keeps servers within, below the time a token of a
	// 100-a-minute rule takes to refill.
	DefaultClockAllowance = 250 * time.Millisecond
	// MaxClockAllowance bounds --apply.clock-allowance.
	MaxClockAllowance = 10 * time.Second
)

// Options configure a Reconciler.
type Options struct {
	// Region is this region; it must be in the topology.
	Region string
	// TopologyFile lists the regions; it is read again every TopologyPoll
	// (0: topowatch.DefaultPoll).
	TopologyFile string
	TopologyPoll time.Duration
	// RulesFile holds the rules, as limiterd's: a spend of a rule this
	// region does not have, or does not reconcile, is skipped.
	RulesFile string
	// NATSURL is the NATS server (or cluster) holding the streams.
	NATSURL string
	// NATSAuth authenticates to NATS and verifies it (--nats.creds-file,
	// --nats.nkey-seed-file, --nats.tls-*), as limiterd's.
	NATSAuth natsconn.Auth
	// Redis is this region's store, reached as limiterd reaches it.
	Redis redisstore.Conn
	// MaxRules caps the rules in force.
	MaxRules int
	// Interval is the longest a loop waits for a message before it looks
	// again; limiterd flushes at its own --gossip.interval.
	Interval time.Duration
	// AckWait is how long a message of the relay's or the retry stream's
	// consumers may stay unacknowledged before it is delivered again (to
	// this or another reconciler).
	AckWait time.Duration
	// StreamMaxAge and StreamMaxBytes bound the streams: the backlog a
	// partition can build before the oldest spends are dropped. A client's
	// marker of the last message applied, and a flush's record, live as
	// long as a message can be delivered again: StreamMaxAge and ten ack
	// waits.
	StreamMaxAge   time.Duration
	StreamMaxBytes int64
	// StreamReplicas is the replication of the streams (1 on one server).
	StreamReplicas int
	// MaxMessageBytes bounds a spend message.
	MaxMessageBytes int
	// Partitions is the number of partitions of each region's spends
	// (--apply.partitions, 1 to gossip.MaxPartitions): this region's relay
	// splits its flushes into that many, and this region applies each
	// other region's that many, each with its own in-order consumer. It
	// must be the same in every region: a partition of another region's
	// beyond this region's count is not applied here (its spends wait in
	// the inbound stream), and below it a loop reads nothing. Changing it is safe for the spends already
	// relayed once every region's reconcilers have the new count: each
	// partition's subject keeps its own order and markers.
	Partitions int
	// LeaseTTL is how long a reconciler's lease of a partition lives
	// without a renewal (--apply.lease-ttl, lease.MinTTL to lease.MaxTTL):
	// how long a dead reconciler's partitions wait for another. A lease is
	// renewed every quarter of it.
	LeaseTTL time.Duration
	// ClockAllowance is how far another region's clock may run behind
	// this region's Redis clock (--apply.clock-allowance, 0 to
	// MaxClockAllowance): a spend counts as admitted that much later than
	// its region says, so a debit is skipped as refilled only when it
	// surely refilled.
	ClockAllowance time.Duration
	// HTTPAddress serves /metrics, /healthz and /readyz.
	HTTPAddress string
	// Trace sends spans to an OpenTelemetry collector (--trace.*, as
	// limiterd's); off by default.
	Trace tracing.Options
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Reconciler is one reconciler process. Make it with New, Start and Stop it.
type Reconciler struct {
	opts     Options
	log      *slog.Logger
	registry *prometheus.Registry
	rules    *rulesource.Source
	topo     *topowatch.Watcher
	m        *metrics
	// srcMu guards sources, the regions applied here (the other regions
	// of the topology in force), and added, when each source added at a
	// switch was added: the inbound stream sources it from then on.
	srcMu   sync.Mutex
	sources []string
	added   map[string]time.Time
	// loops are the running loops of each source, guarded by srcMu: a
	// switch that removes a source stops them and waits for them before
	// the new topology is in force.
	loops map[string]*sourceLoops
	// topoChanged tells the loops that the sources changed.
	topoChanged chan struct{}
	// inSince is when the first inbound stream this reconciler used was
	// made (zero before its first set-up): one made again sources from it.
	inSince time.Time

	// tracer sends the apply's spans; nil: tracing off.
	tracer  *tracing.Tracer
	store   *redisstore.Store
	applier *apply.Applier
	leases  *lease.Manager
	nc      *nats.Conn
	js      jetstream.JetStream
	httpLis net.Listener
	httpSrv *http.Server
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	ready   atomic.Bool

	// beforeDone, when set by a test, runs after a message's debits are
	// applied and before it counts as done; returning false stops the
	// batch there (its position is not stored), as a reconciler that dies
	// at that moment would: the message is read again.
	beforeDone func(src string, seq uint64) bool
	// beforeApply, when set by a test, runs in a partition's loop before
	// each batch read is applied.
	beforeApply func(ctx context.Context, src apply.Source)
	// afterApply, when set by a test, runs in a partition's loop after
	// each batch that beforeApply saw, once its position is stored (or
	// not: stopped before it began).
	afterApply func(src apply.Source)
	// bucket is the region's bucket of apply leases and its TTL, once
	// set up.
	bucket atomic.Pointer[applyBucket]
	// beforeSourceAdded, when set by a test, runs in setup before the
	// inbound stream that exists is updated with the sources added, named.
	beforeSourceAdded func(ctx context.Context, added []string)
	// beforeRelayPublish, when set by a test, runs before the relay
	// publishes a round's messages, the last flush in them at local
	// sequence last; returning false stops the relay there, as a relay
	// that dies then would. beforeRelayAck does the same between the
	// publishes and the acknowledgements.
	beforeRelayPublish func(last uint64) bool
	beforeRelayAck     func() bool
}

// DefaultOptions are the reconciler's defaults, the one place they are
// written: the flags' defaults are read from them, and Options given to New
// start from them (New fills no zero field but Logger).
func DefaultOptions() Options {
	return Options{
		TopologyPoll: topowatch.DefaultPoll, MaxRules: rulesource.DefaultMaxRules, NATSAuth: natsconn.Auth{Prefix: natsconn.FlagPrefix},
		Interval: gossip.DefaultInterval, AckWait: DefaultAckWait,
		StreamMaxAge: DefaultStreamMaxAge, StreamMaxBytes: DefaultStreamMaxBytes, StreamReplicas: 1,
		MaxMessageBytes: gossip.DefaultMaxMessageBytes, Partitions: DefaultPartitions, LeaseTTL: lease.DefaultTTL, ClockAllowance: DefaultClockAllowance,
		HTTPAddress: DefaultHTTPAddress, Trace: tracing.Default(),
	}
}

// validate reports every bad field at once, each naming its flag, and
// changes nothing.
func (o *Options) validate() error {
	var errs []error
	if err := region.ValidateName(o.Region); err != nil {
		errs = append(errs, fmt.Errorf("--region: %w", err))
	}
	for flag, v := range map[string]string{"--region.topology-file": o.TopologyFile, "--rules.file": o.RulesFile, "--nats.url": o.NATSURL} {
		if v == "" {
			errs = append(errs, fmt.Errorf("%s: required", flag))
		}
	}
	if len(o.Redis.Addrs) == 0 {
		errs = append(errs, errors.New("--redis.addrs: required"))
	}
	if err := o.NATSAuth.Validate(); err != nil {
		errs = append(errs, err)
	}
	if o.HTTPAddress == "" {
		errs = append(errs, errors.New("--http.listen-address: required"))
	}
	if o.TopologyPoll < 0 || (o.TopologyPoll > 0 && (o.TopologyPoll < topowatch.MinPoll || o.TopologyPoll > topowatch.MaxPoll)) {
		errs = append(errs, fmt.Errorf("--region.topology-poll: must be in [%v, %v], got %v", topowatch.MinPoll, topowatch.MaxPoll, o.TopologyPoll))
	}
	if o.Interval < gossip.MinInterval || o.Interval > time.Minute {
		errs = append(errs, fmt.Errorf("--gossip.interval: must be in [%v, 1m], got %v", gossip.MinInterval, o.Interval))
	}
	if o.AckWait < time.Second || o.AckWait > 10*time.Minute {
		errs = append(errs, fmt.Errorf("--gossip.ack-wait: must be in [1s, 10m], got %v", o.AckWait))
	}
	if o.StreamMaxAge < time.Minute {
		errs = append(errs, fmt.Errorf("--stream.max-age: must be at least 1m, got %v", o.StreamMaxAge))
	}
	if o.StreamMaxBytes < 1<<20 {
		errs = append(errs, fmt.Errorf("--stream.max-bytes: must be at least 1MiB, got %d", o.StreamMaxBytes))
	}
	if o.StreamReplicas < 1 || o.StreamReplicas > 5 {
		errs = append(errs, fmt.Errorf("--stream.replicas: must be 1 to 5, got %d", o.StreamReplicas))
	}
	if o.MaxRules < 1 || o.MaxRules > rulesource.MaxMaxRules {
		errs = append(errs, fmt.Errorf("--rules.max-rules: must be 1 to %d, got %d", rulesource.MaxMaxRules, o.MaxRules))
	}
	if o.MaxMessageBytes < 4<<10 || o.MaxMessageBytes > 8<<20 {
		errs = append(errs, fmt.Errorf("--gossip.max-message-bytes: must be 4KiB to 8MiB, got %d", o.MaxMessageBytes))
	}
	if o.Partitions < 1 || o.Partitions > gossip.MaxPartitions {
		errs = append(errs, fmt.Errorf("--apply.partitions: must be 1 to %d, got %d", gossip.MaxPartitions, o.Partitions))
	}
	if o.LeaseTTL < lease.MinTTL || o.LeaseTTL > lease.MaxTTL {
		errs = append(errs, fmt.Errorf("--apply.lease-ttl: must be in [%v, %v], got %v", lease.MinTTL, lease.MaxTTL, o.LeaseTTL))
	}
	if o.ClockAllowance < 0 || o.ClockAllowance > MaxClockAllowance {
		errs = append(errs, fmt.Errorf("--apply.clock-allowance: must be 0 to %v, got %v", MaxClockAllowance, o.ClockAllowance))
	}
	if err := o.Trace.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// New validates opts, which start from DefaultOptions, and loads the rules
// and the topology. A nil Logger is slog.Default().
func New(opts Options) (*Reconciler, error) {
	if err := opts.validate(); err != nil {
		return nil, err
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	reg := prometheus.NewRegistry()
	r := &Reconciler{opts: opts, log: opts.Logger.With("region", opts.Region), added: map[string]time.Time{}, loops: map[string]*sourceLoops{}, topoChanged: make(chan struct{}, 1)}
	topo, err := topowatch.New(topowatch.Options{File: opts.TopologyFile, Region: opts.Region, Poll: opts.TopologyPoll,
		Validate: r.validateTopology, OnSwitch: r.switchTopology, Logger: r.log}, reg)
	if errors.Is(err, topowatch.ErrOwnRegionMissing) {
		return nil, fmt.Errorf("--region: %q is not in --region.topology-file %s", opts.Region, opts.TopologyFile)
	}
	if err != nil {
		return nil, fmt.Errorf("--region.topology-file: %w", err)
	}
	r.topo = topo
	src, err := rulesource.New(rulesource.Options{File: opts.RulesFile, Logger: opts.Logger.With("component", "rules"),
		MaxRules: opts.MaxRules, ValidateRule: r.homesValid}, reg)
	if err != nil {
		return nil, fmt.Errorf("--rules.file: %w", err)
	}
	r.rules = src
	r.sources = otherRegions(topo.Active(), opts.Region)
	r.registry = reg
	r.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if r.m, err = newMetrics(r.registry, r.sources, opts.Partitions); err != nil {
		return nil, err
	}
	return r, nil
}

func otherRegions(topo *region.Topology, self string) []string {
	var out []string
	for _, name := range topo.Names() {
		if name != self {
			out = append(out, name)
		}
	}
	return out
}

// homesValid checks a rule's home_keys against the topology in force and
// the one pending.
func (r *Reconciler) homesValid(rule *rules.Rule) error {
	if err := rules.HomesIn(r.topo.Active())(rule); err != nil {
		return err
	}
	if p := r.topo.Pending(); p != nil {
		return rules.HomesIn(p)(rule)
	}
	return nil
}

// validateTopology checks the rules in force against a new topology.
func (r *Reconciler) validateTopology(next *region.Topology) error {
	check := rules.HomesIn(next)
	for _, rule := range r.rules.Current().Rules() {
		if err := check(rule); err != nil {
			return err
		}
	}
	return nil
}

// switchTopology makes the other regions of next the sources: a region
// added is sourced into the inbound stream from now on (its past is not
// debited here), with its consumers and loops (run picks the change up);
// the loops of a removed one are stopped, and waited for, before the
// switch returns, so that none of its spends is applied once next is in
// force.
func (r *Reconciler) switchTopology(_, next *region.Topology) error {
	sources := otherRegions(next, r.opts.Region)
	now := time.Now()
	var removed []*sourceLoops
	r.srcMu.Lock()
	for _, name := range sources {
		if !slices.Contains(r.sources, name) {
			r.added[name] = now
			r.m.addSource(name)
		}
	}
	for _, name := range r.sources {
		if !slices.Contains(sources, name) {
			r.m.removeSource(name)
			if l := r.loops[name]; l != nil {
				removed = append(removed, l)
				delete(r.loops, name)
			}
		}
	}
	r.sources = sources
	r.srcMu.Unlock()
	for _, l := range removed {
		l.stopAndWait()
		r.log.Info("source region removed: its spends are no longer applied here (its consumers stay)", "source", l.name)
	}
	select {
	case r.topoChanged <- struct{}{}:
	default:
	}
	return nil
}

// sourceLoops are the loops of one source region, stopped together: its
// retry loop, and the loops of the partitions whose lease this reconciler
// holds, which join wg as they start (applyPartition).
type sourceLoops struct {
	name string
	src  *source
	ctx  context.Context
	stop context.CancelFunc
	// lost sends the reconciler back to setting up its streams.
	lost context.CancelFunc
	wg   sync.WaitGroup
}

func (l *sourceLoops) stopAndWait() {
	l.stop()
	l.wg.Wait()
}

// startLoops starts src's retry loop under ctx, and lets the loops of its
// partitions held start, unless src is no longer a source (a switch
// removed it since the set-up) or its loops run already. lost sends the
// reconciler back to setting up its streams.
func (r *Reconciler) startLoops(ctx context.Context, src *source, lost context.CancelFunc) {
	r.srcMu.Lock()
	defer r.srcMu.Unlock()
	if !slices.Contains(r.sources, src.name) || r.loops[src.name] != nil {
		return
	}
	sctx, stop := context.WithCancel(ctx)
	l := &sourceLoops{name: src.name, src: src, ctx: sctx, stop: stop, lost: lost}
	r.loops[src.name] = l
	l.wg.Go(func() { r.retryLoop(sctx, src) })
}

// leaseItems are the partitions this region applies: each partition of
// each source.
func (r *Reconciler) leaseItems() []lease.Item {
	r.srcMu.Lock()
	defer r.srcMu.Unlock()
	items := make([]lease.Item, 0, 1+len(r.sources)*r.opts.Partitions)
	items = append(items, r.relayItem())
	for _, src := range r.sources {
		for p := range r.opts.Partitions {
			items = append(items, lease.Item{Source: src, Partition: p})
		}
	}
	return items
}

// stopLoops stops every source's loops and waits for them.
func (r *Reconciler) stopLoops() {
	r.srcMu.Lock()
	loops := slices.Collect(maps.Values(r.loops))
	clear(r.loops)
	r.srcMu.Unlock()
	for _, l := range loops {
		l.stopAndWait()
	}
}

// currentSources returns the sources and when each added at a switch was.
func (r *Reconciler) currentSources() ([]string, map[string]time.Time) {
	r.srcMu.Lock()
	defer r.srcMu.Unlock()
	return slices.Clone(r.sources), maps.Clone(r.added)
}

// beforeDoneHook runs beforeDone, when a test set it, else lets the
// message be done.
func (r *Reconciler) beforeDoneHook(src string, seq uint64) bool {
	return r.beforeDone == nil || r.beforeDone(src, seq)
}

// applyBucket is the region's bucket of apply leases, as set up.
type applyBucket struct {
	kv  jetstream.KeyValue
	ttl time.Duration
}

// leaseBucket is the region's bucket of apply leases and its TTL, once set
// up (nil before), as the leases read it.
type leaseBucket struct{ r *Reconciler }

func (b leaseBucket) Bucket() (jetstream.KeyValue, time.Duration) {
	if ab := b.r.bucket.Load(); ab != nil {
		return ab.kv, ab.ttl
	}
	return nil, 0
}

// setupBucket makes the region's bucket of apply leases when it is
// missing. One that exists keeps its TTL, which the leases then live.
func (r *Reconciler) setupBucket(ctx context.Context) error {
	name := gossip.ApplyBucket(r.opts.Region)
	kv, err := r.js.KeyValue(ctx, name)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		var placement *jetstream.Placement
		if cluster := r.nc.ConnectedClusterName(); cluster != "" {
			placement = &jetstream.Placement{Cluster: cluster}
		}
		kv, err = r.js.CreateKeyValue(ctx, lease.BucketConfig(r.opts.Region, r.opts.LeaseTTL, r.opts.StreamReplicas, placement))
	}
	if err != nil {
		return fmt.Errorf("bucket %s: %w", name, err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return fmt.Errorf("bucket %s: %w", name, err)
	}
	if st.TTL() != r.opts.LeaseTTL && (r.bucket.Load() == nil || r.bucket.Load().ttl != st.TTL()) {
		r.log.Warn("the bucket of apply leases was made with another --apply.lease-ttl: its leases live as long as it says", "bucket", name,
			"bucket_ttl", st.TTL(), "lease_ttl", r.opts.LeaseTTL)
	}
	r.bucket.Store(&applyBucket{kv: kv, ttl: st.TTL()})
	return nil
}

// Registry is the reconciler's metrics registry.
func (r *Reconciler) Registry() *prometheus.Registry { return r.registry }

// HTTPAddr is the HTTP listener's address, once started.
func (r *Reconciler) HTTPAddr() string { return r.httpLis.Addr().String() }

// Start connects to Redis and NATS, creates or updates the streams and the
// consumers, and starts the loops. NATS may be unreachable at start: the
// loops wait for it.
func (r *Reconciler) Start(ctx context.Context) (err error) {
	ro, err := r.opts.Redis.Options(r.log)
	if err != nil {
		return err
	}
	host, _ := os.Hostname()
	if r.tracer, err = tracing.Start(r.opts.Trace, "reconciler", r.opts.Region, fmt.Sprintf("%s-%d", host, os.Getpid())); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			_ = r.tracer.Shutdown(0) // nothing was traced yet
		}
	}()
	ro.Timeout = DefaultApplyTimeout
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	store, err := redisstore.New(cctx, ro, r.registry)
	cancel()
	if err != nil {
		return fmt.Errorf("--redis.addrs: %w", err)
	}
	r.store = store
	natsconn.WarnURLSecrets("--nats.url", r.opts.NATSURL, r.log)
	auth, err := r.opts.NATSAuth.Options(r.log)
	if err != nil {
		store.Close()
		return err
	}
	auth = append(auth, natsconn.Inbox(natsconn.IdentityName("reconciler", r.opts.Region)))
	r.nc, err = natsconn.Connect(r.opts.NATSURL, "reconciler "+r.opts.Region, r.log, auth...)
	if err != nil {
		store.Close()
		return fmt.Errorf("--nats.url: %w", err)
	}
	if r.js, err = jetstream.New(r.nc); err != nil {
		r.nc.Close()
		store.Close()
		return fmt.Errorf("--nats.url: %w", err)
	}
	aopts := apply.Options{Region: r.opts.Region, AckWait: r.opts.AckWait, StreamMaxAge: r.opts.StreamMaxAge,
		MaxMessageBytes: r.opts.MaxMessageBytes, ClockAllowance: r.opts.ClockAllowance, Logger: r.log, BeforeDone: r.beforeDoneHook}
	if r.tracer != nil {
		aopts.TracerProvider = r.tracer.Provider()
	}
	r.applier = apply.New(aopts, store, r.js, r.rules, r.m.apply)
	r.leases = lease.New(lease.Options{Region: r.opts.Region, TTL: r.opts.LeaseTTL, PositionTTL: r.applier.MarkerTTL(),
		Logger: r.log.With("component", "leases")}, leaseBucket{r}, store, r.m.leases)
	if r.httpLis, err = net.Listen("tcp", r.opts.HTTPAddress); err != nil {
		r.nc.Close()
		store.Close()
		return fmt.Errorf("--http.listen-address: %w", err)
	}
	mux := opshttp.NewMux(r.registry, &r.ready, "streams not set up yet")
	r.httpSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := r.httpSrv.Serve(r.httpLis); !errors.Is(err, http.ErrServerClosed) {
			r.log.Error("metrics and health server stopped", "err", err)
		}
	}()

	lctx, stop := context.WithCancel(context.Background())
	r.cancel = stop
	r.rules.UseNATS(r.nc)
	r.wg.Go(func() { r.rules.Run(lctx) })
	r.wg.Go(func() { r.topo.Run(lctx) })
	r.wg.Go(func() { r.run(lctx) })
	r.wg.Go(func() { r.leases.Run(lctx, r.leaseItems, r.holdLease) })
	sources, _ := r.currentSources()
	r.log.Info("reconciler started", "sources", strings.Join(sources, ","), "interval", r.opts.Interval, "lease_token", r.leases.Token())
	return nil
}

// Stop ends the loops (a batch being applied is finished first), releases
// the leases and closes the connections.
func (r *Reconciler) Stop() error {
	if r.cancel == nil {
		return nil
	}
	r.cancel()
	r.wg.Wait()
	r.nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	// Last of all: the spans of the last batches go out.
	return errors.Join(r.httpSrv.Shutdown(ctx), r.store.Close(), r.tracer.Shutdown(2*time.Second))
}

// Run starts a reconciler and runs it until ctx ends.
func Run(ctx context.Context, opts Options) error {
	r, err := New(opts)
	if err != nil {
		return err
	}
	if err := r.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	return r.Stop()
}

// JetStream's error codes for a stream larger than the server may store.
const (
	jsInsufficientResources        jetstream.ErrorCode = 10023
	jsInsufficientMemoryResources  jetstream.ErrorCode = 10028
	jsInsufficientStorageResources jetstream.ErrorCode = 10047
)

// insufficientResources reports a JetStream refusal of a stream for lack
// of memory or storage on the server.
func insufficientResources(err error) bool {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return false
	}
	switch apiErr.ErrorCode {
	case jsInsufficientResources, jsInsufficientMemoryResources, jsInsufficientStorageResources:
		return true
	}
	return false
}

// run sets up the streams and consumers (retrying while NATS is away),
// then runs the relay, apply and retry loops until ctx ends. A stream or a
// consumer found missing while running (deleted and made again by an
// operator) sends it back to the set-up, which reads the stream's new epoch.
func (r *Reconciler) run(ctx context.Context) {
	for ctx.Err() == nil {
		var st *streams
		for {
			var err error
			if st, err = r.setup(ctx); err == nil {
				break
			}
			if insufficientResources(err) {
				r.log.Error("streams not set up: the NATS server's JetStream store is smaller than the streams asked for; lower --stream.max-bytes or raise the server's max_file_store (retrying)",
					"stream_max_bytes", r.opts.StreamMaxBytes, "err", err)
			} else {
				r.log.Warn("streams not set up, retrying", "err", err)
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
		}
		r.ready.Store(true)
		lctx, lost := context.WithCancel(ctx)
		var wg sync.WaitGroup
		for _, src := range st.current() {
			r.startLoops(lctx, src, lost)
		}
		wg.Go(func() { r.backlogLoop(lctx, st, lost) })
		wg.Go(func() { r.watchSources(st).Run(lctx, r.opts.Interval) })
		r.follow(lctx, st, lost)
		wg.Wait()
		r.stopLoops()
		lost()
		if ctx.Err() == nil {
			r.log.Warn("a stream or consumer is gone, setting up again")
		}
	}
}

// follow waits for ctx, setting the streams up again at each change of the
// sources: the loops of a source added start, and the others go on
// undisturbed. (A removed source's loops are stopped by the switch itself,
// and its leases released; its retry consumer stays: the reconciler may
// not delete it.)
func (r *Reconciler) follow(ctx context.Context, st *streams, lost context.CancelFunc) {
	var retry <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.topoChanged:
		case <-retry:
		}
		retry = nil
		next, err := r.setup(ctx)
		if err != nil {
			if ctx.Err() == nil {
				r.log.Warn("streams not set up for the new topology, retrying", "err", err)
				retry = time.After(time.Second)
			}
			continue
		}
		var srcs []*source
		for _, src := range next.sources {
			old := st.find(src.name)
			if old == nil {
				old = src
				r.log.Info("source region added: its spends from now on are applied here", "source", src.name)
			}
			// Started again when a switch removed it and the next
			// brought it back before this round.
			r.startLoops(ctx, old, lost)
			srcs = append(srcs, old)
		}
		st.set(srcs)
	}
}

// watchSources is the watch of the inbound stream's sources of st.
func (r *Reconciler) watchSources(st *streams) *streamsrc.Watcher {
	return &streamsrc.Watcher{JS: r.js, Region: r.opts.Region, Log: r.log,
		Active: r.m.sourceActive, Stalls: r.m.sourceStalls, Resets: r.m.sourceResets,
		Regions: func() []string {
			var names []string
			for _, src := range st.current() {
				names = append(names, src.name)
			}
			return names
		},
		Unknown: func() {
			select {
			case r.topoChanged <- struct{}{}:
			default:
			}
		}}
}

// streams are the consumers a reconciler reads, made by setup.
type streams struct {
	local jetstream.Stream
	in    jetstream.Stream
	mu    sync.Mutex // guards sources, changed by follow
	// sources are the regions applied here.
	sources []*source
}

func (st *streams) current() []*source {
	st.mu.Lock()
	defer st.mu.Unlock()
	return slices.Clone(st.sources)
}

func (st *streams) set(srcs []*source) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.sources = srcs
}

func (st *streams) find(name string) *source {
	st.mu.Lock()
	defer st.mu.Unlock()
	for _, s := range st.sources {
		if s.name == name {
			return s
		}
	}
	return nil
}

// source is what this region reads of one other region.
type source struct {
	name string
	// epoch is the creation (µs) of the inbound stream its partitions are
	// read from.
	epoch int64
	// retry reads this region's debits of the source to apply again, from
	// the retry stream, whose counts retryStream reads.
	retry       jetstream.Consumer
	retryStream apply.RetryStream
}

// applied is src as the applier reads it: its retry entries, each naming
// its partition, or (partition) one partition of its inbound messages.
func (src *source) applied() apply.Source {
	return apply.Source{Name: src.name, Epoch: src.epoch, Retry: src.retryStream}
}

// partition is src's partition p as the applier reads it.
func (src *source) partition(p int) apply.Source {
	as := src.applied()
	as.Partition = p
	return as
}

// streamConfig is what every stream of this region shares: its limits, its
// replicas and its place, the JetStream cluster this reconciler is
// connected to (its region's), unless the server is not clustered.
func (r *Reconciler) streamConfig(name string, retention jetstream.RetentionPolicy) jetstream.StreamConfig {
	cfg := jetstream.StreamConfig{
		Name:       name,
		Retention:  retention,
		MaxAge:     r.opts.StreamMaxAge,
		MaxBytes:   r.opts.StreamMaxBytes,
		MaxMsgSize: int32(r.opts.MaxMessageBytes),
		Discard:    jetstream.DiscardOld,
		Duplicates: 2 * time.Minute,
		Replicas:   r.opts.StreamReplicas,
		Storage:    jetstream.FileStorage,
	}
	if cluster := r.nc.ConnectedClusterName(); cluster != "" {
		cfg.Placement = &jetstream.Placement{Cluster: cluster}
	}
	return cfg
}

// setup creates this region's streams and the durable consumers (each
// source's retry consumer), or updates those whose
// configuration differs; every reconciler of the region
// runs it, and it is idempotent: a matching stream is not rewritten. This
// region's streams are its local stream (limiterd's flushes), its spends
// stream (the flushes relayed, read by the other regions), its inbound
// stream (sourcing every other region's spends stream) and its retry
// stream.
func (r *Reconciler) setup(ctx context.Context) (*streams, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	self := r.opts.Region
	st := &streams{}
	local := r.streamConfig(gossip.LocalStream(self), jetstream.WorkQueuePolicy)
	local.Subjects = []string{gossip.LocalSubject(self)}
	spends := r.streamConfig(gossip.RegionStream(self), jetstream.LimitsPolicy)
	spends.Subjects = []string{gossip.PartitionSubjects(self)}
	in := r.streamConfig(gossip.InStream(self), jetstream.LimitsPolicy)
	retry := r.streamConfig(gossip.RetryStream(self), jetstream.WorkQueuePolicy)
	retry.Subjects = []string{gossip.RetrySubjectPrefix + self + ".>"}
	// The streams but the inbound one are made, and the inbound stream
	// looked up, side by side, as the consumers below: each call may cross
	// the WAN to the meta leader.
	var cur jetstream.Stream
	g, gctx := errgroup.WithContext(ctx)
	for _, cfg := range []jetstream.StreamConfig{local, spends, retry} {
		g.Go(func() error {
			s, err := natsconn.EnsureStream(gctx, r.js, cfg)
			if cfg.Name == local.Name {
				st.local = s
			}
			return err
		})
	}
	g.Go(func() error { return r.setupBucket(gctx) })
	g.Go(func() error {
		s, err := r.js.Stream(gctx, in.Name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return nil
		} else if err != nil {
			return fmt.Errorf("stream %s: %w", in.Name, err)
		}
		cur = s
		return nil
	})
	if err := g.Wait(); err != nil {
		return nil, err
	}
	// A new inbound stream takes the other regions' spends from now on (a
	// new region is not debited with the past). One made again while this
	// reconciler runs (an operator deleted it) takes them from when the
	// deleted one was made: what was published meanwhile is not lost, and
	// what was applied already is known by its flush record and skipped.
	since := time.Now()
	if !r.inSince.IsZero() {
		since = r.inSince
	}
	// An inbound stream that exists keeps its sources exactly as they are
	// (an update that moved a source's start would make the server source
	// it again from there); a region added is sourced from when it was
	// added, and one removed stays (it is no longer applied: its loops
	// stop), so that reconcilers of the region on different generations
	// for a moment do not undo one another's updates.
	sources, added := r.currentSources()
	have, exists := map[string]bool{}, cur != nil
	if exists {
		for _, src := range cur.CachedInfo().Config.Sources {
			in.Sources = append(in.Sources, src)
			have[src.Name+" "+src.FilterSubject] = true
		}
	}
	// Each other region's spends stream is sourced once, filtered to its
	// partitions' subjects.
	var newSources []string
	g, gctx = errgroup.WithContext(ctx)
	for _, src := range sources {
		name, filter := gossip.RegionStream(src), gossip.PartitionSubjects(src)
		if have[name+" "+filter] {
			continue
		}
		from := &since
		if exists {
			from = r.sourceStart(added[src])
		}
		ss := &jetstream.StreamSource{Name: name, FilterSubject: filter, OptStartTime: from}
		in.Sources = append(in.Sources, ss)
		newSources = append(newSources, src)
		// Sourced from a time, the server sources from the inbound
		// stream's last message instead when that is later, as it first
		// succeeds (trySetupSourceConsumer): another source's message
		// landing before this one is set up would make it skip what its
		// stream got since from. So the source starts at the sequence of
		// its stream's first message since from, asked of every source
		// region side by side (a round trip to each).
		g.Go(func() error {
			if seq, ok := streamsrc.FirstSeqSince(gctx, r.nc, r.js, name, *from); ok {
				ss.OptStartTime, ss.OptStartSeq = nil, seq
			} else {
				r.log.Warn("spends stream not asked where to source it from: sourced from a time, its spends until the source is set up may be skipped",
					"source", src, "filter", filter, "since", *from)
			}
			return nil
		})
	}
	_ = g.Wait() // firstSeqSince fails to a start time, not an error
	if exists && len(newSources) > 0 && r.beforeSourceAdded != nil {
		r.beforeSourceAdded(ctx, newSources)
	}
	if _, err := natsconn.EnsureStream(ctx, r.js, in); err != nil {
		return nil, err
	}
	// The consumers are made side by side. Each create, even of a
	// consumer that exists as asked, is a proposal to the JetStream meta
	// leader, which on a supercluster may be in another region: made one
	// after another they took a WAN round trip or two each, and under load
	// outlasted the set-up's timeout, after which the set-up began again
	// with as many.
	g, gctx = errgroup.WithContext(ctx)
	g.SetLimit(maxConsumerCreates)
	create := func(dst *jetstream.Consumer, stream string, c jetstream.ConsumerConfig) {
		g.Go(func() error {
			cons, err := r.js.CreateOrUpdateConsumer(gctx, stream, c)
			if err != nil {
				return fmt.Errorf("consumer %s on %s: %w", c.Durable, stream, err)
			}
			*dst = cons
			return nil
		})
	}
	for _, name := range sources {
		src := &source{name: name, retryStream: apply.StreamPending{NC: r.nc, Name: retry.Name}}
		// One entry at a time, in order: see the package comment.
		create(&src.retry, retry.Name, jetstream.ConsumerConfig{
			Durable:       retryConsumer(self, name),
			FilterSubject: gossip.RetrySubjects(self, name),
			DeliverPolicy: jetstream.DeliverAllPolicy,
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       r.opts.AckWait,
			MaxAckPending: 1,
			MaxDeliver:    -1,
		})
		st.sources = append(st.sources, src)
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	// The epoch is read after the consumers are made (and each partition's
	// reader checks it again after it is made): a stream made again since
	// would have taken them with it, and the loops would come back here.
	info, err := r.js.Stream(ctx, in.Name)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", in.Name, err)
	}
	st.in = info
	epoch := max(info.CachedInfo().Created.UnixMicro(), 1)
	for _, src := range st.sources {
		src.epoch = epoch
	}
	if r.inSince.IsZero() || info.CachedInfo().Created.Before(r.inSince) {
		r.inSince = info.CachedInfo().Created
	}
	return st, nil
}

// sourceStart is where a source missing from an existing inbound stream is
// sourced from: when it was added at a switch, else (a reconciler started on
// a topology that has it) the topology's effective_at when it has passed,
// else now.
func (r *Reconciler) sourceStart(added time.Time) *time.Time {
	if added.IsZero() {
		added = time.Now()
		if at := r.topo.Active().EffectiveAt(); !at.IsZero() && at.Before(added) {
			added = at
		}
	}
	return &added
}

// maxConsumerCreates bounds the consumer creates a set-up has under way
// at once.
const maxConsumerCreates = 32

func retryConsumer(self, src string) string { return "retry-" + self + "-from-" + src }

// retryLoop applies src's retry entries, one at a time, in order.
func (r *Reconciler) retryLoop(ctx context.Context, src *source) {
	as := src.applied()
	for ctx.Err() == nil {
		batch, err := src.retry.Fetch(1, jetstream.FetchMaxWait(r.opts.Interval))
		if err != nil {
			r.pause(ctx, "retry fetch", err)
			continue
		}
		for msg := range batch.Messages() {
			if ctx.Err() != nil {
				msg.Nak() // stopped, as in applyLoop
				continue
			}
			r.applier.Retry(ctx, as, msg)
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && ctx.Err() == nil {
			r.pause(ctx, "retry fetch", err)
		}
	}
}

func (r *Reconciler) pause(ctx context.Context, what string, err error) {
	if ctx.Err() != nil {
		return
	}
	r.log.Debug(what, "err", err)
	select {
	case <-ctx.Done():
	case <-time.After(250 * time.Millisecond):
	}
}

// gone reports an answer that says a stream or a consumer does not exist.
func gone(err error) bool {
	return errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrStreamNotFound)
}

// backlogLoop exports how many messages wait, per source, every interval;
// the local stream or a retry consumer found gone, or the inbound stream, or the
// bucket of apply leases, calls lost, which sends the reconciler back to
// setting up its streams.
func (r *Reconciler) backlogLoop(ctx context.Context, st *streams, lost context.CancelFunc) {
	t := time.NewTicker(r.opts.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		ictx, cancel := context.WithTimeout(ctx, r.opts.Interval)
		// The local stream is a work queue: a flush stays until relayed.
		info, err := st.local.Info(ictx)
		if err == nil {
			r.m.relayBacklog.Set(float64(info.State.Msgs))
		}
		missing := gone(err)
		// The inbound stream's readers, every partition's of every
		// source, in one listing rather than a call each.
		var readers []*jetstream.ConsumerInfo
		list := st.in.ListConsumers(ictx)
		for ci := range list.Info() {
			readers = append(readers, ci)
		}
		listErr := list.Err()
		missing = missing || gone(listErr)
		if b := r.bucket.Load(); b != nil {
			_, err := b.kv.Status(ictx)
			missing = missing || gone(err) || errors.Is(err, jetstream.ErrBucketNotFound)
		}
		for _, src := range st.current() {
			if listErr == nil {
				r.m.backlog.WithLabelValues(src.name).Set(float64(partitionBacklog(readers, r.opts.Region, src.name, r.opts.Partitions)))
			}
			if info, err := src.retry.Info(ictx); err == nil {
				r.m.retryBacklog.WithLabelValues(src.name).Set(float64(info.NumPending + uint64(info.NumAckPending)))
			} else {
				missing = missing || gone(err)
			}
		}
		cancel()
		if missing {
			lost()
			return
		}
	}
}

// partitionBacklog is how many messages of src's partitions wait to be
// read in self's inbound stream, from its readers' infos: per partition,
// the fewest of its readers (the current one's: a reader left by a
// reconciler gone falls behind). A partition with no reader counts none.
func partitionBacklog(readers []*jetstream.ConsumerInfo, self, src string, partitions int) uint64 {
	var n uint64
	for p := range partitions {
		prefix, subject := readerPrefix(self, src, p), gossip.PartitionSubject(src, p)
		least, found := uint64(0), false
		for _, ci := range readers {
			if !strings.HasPrefix(ci.Name, prefix) || ci.Config.FilterSubject != subject {
				continue
			}
			if !found || ci.NumPending < least {
				least, found = ci.NumPending, true
			}
		}
		n += least
	}
	return n
}

type metrics struct {
	apply        *apply.Metrics
	leases       *lease.Metrics
	partitions   float64
	partitionsOf *prometheus.GaugeVec
	batches      prometheus.Histogram
	relayed      prometheus.Counter
	relayMsgs    prometheus.Counter
	relayReplays prometheus.Counter
	relayClients prometheus.Counter
	retryBacklog *prometheus.GaugeVec
	backlog      *prometheus.GaugeVec
	relayBacklog prometheus.Gauge
	sourceActive *prometheus.GaugeVec
	sourceStalls *prometheus.CounterVec
	sourceResets *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer, sources []string, partitions int) (*metrics, error) {
	am, err := apply.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	lm, err := lease.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	m := &metrics{
		apply:      am,
		leases:     lm,
		partitions: float64(partitions),
		partitionsOf: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_apply_partitions",
			Help: "Partitions of a source region's spends this region applies (--apply.partitions): the region's reconcilers hold as many leases of them between them when every partition is applied.",
		}, []string{"source_region"}),
		batches: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "limiter_apply_batch_messages",
			Help:    "Spend messages of a partition applied together, in one round trip per Redis node.",
			Buckets: []float64{1, 2, 4, 8, 16, 32, 64},
		}),
		relayed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_spends_published_total",
			Help: "Spend entries of this region relayed to the other regions.",
		}),
		relayMsgs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_relay_messages_total",
			Help: "Messages this region's relay published to its spends stream: the flushes of a round merged, one message per partition.",
		}),
		relayClients: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_relay_clients_total",
			Help: "Clients (distinct keys) in the messages this region's relay published: each costs one debit script in every region that applies them.",
		}),
		relayReplays: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_relay_replays_total",
			Help: "limiterd flushes published again under a new local sequence (from a spool, past the duplicate window) that the relay found relayed already and dropped.",
		}),
		retryBacklog: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_retry_backlog_messages",
			Help: "Entries of the retry stream of a source region waiting to be applied here.",
		}, []string{"source_region"}),
		backlog: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_reconcile_backlog_messages",
			Help: "Spend messages of a source region waiting to be read by the readers of its partitions here (a partition nobody holds counts none).",
		}, []string{"source_region"}),
		relayBacklog: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "limiter_relay_backlog_messages",
			Help: "limiterd flushes of this region waiting to be relayed.",
		}),
		sourceActive: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_stream_source_active_seconds",
			Help: "Time since this region's inbound stream last heard of a source region's spends stream (a message or a heartbeat, sent every second when healthy); read every interval.",
		}, []string{"source_region"}),
		sourceStalls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_stream_source_stalls_total",
			Help: "Times the inbound stream's source of a region was seen stalled: not heard of for 5 s, or reporting an error.",
		}, []string{"source_region"}),
		sourceResets: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_stream_source_resets_total",
			Help: "Times this reconciler reset a stalled source of the inbound stream (removed and added back) once the source region's spends stream answered, cutting short nats-server's retry backoff.",
		}, []string{"source_region"}),
	}
	for _, c := range []prometheus.Collector{m.batches, m.partitionsOf, m.relayed, m.relayMsgs, m.relayClients, m.relayReplays, m.retryBacklog, m.backlog, m.relayBacklog, m.sourceActive, m.sourceStalls, m.sourceResets} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, src := range sources {
		m.addSource(src)
	}
	return m, nil
}

// addSource makes the series of a source region.
func (m *metrics) addSource(src string) {
	m.apply.AddSource(src)
	m.partitionsOf.WithLabelValues(src).Set(m.partitions)
	m.leases.Held.WithLabelValues(src)
	m.retryBacklog.WithLabelValues(src)
	m.backlog.WithLabelValues(src)
	m.sourceStalls.WithLabelValues(src)
	m.sourceResets.WithLabelValues(src)
}

// removeSource drops the gauges of a source region no longer applied (its
// counters stay, as counted; its partitions held fall to 0 as their
// leases are released).
func (m *metrics) removeSource(src string) {
	m.partitionsOf.DeleteLabelValues(src)
	m.retryBacklog.DeleteLabelValues(src)
	m.backlog.DeleteLabelValues(src)
	m.sourceActive.DeleteLabelValues(src)
}
