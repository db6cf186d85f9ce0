package reconciler

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/natsauth"
	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/internal/wanproxy"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// stack is regions on loopback: for each a real Redis Cluster, a
// limiterd and reconcilers, all on one nats-server (newStack: us-east and
// eu-west) or each region on its own NATS cluster of a supercluster
// (newSuperStack).
type stack struct {
	t        testing.TB
	names    []string
	nats     *natstest.Server       // nil on a supercluster
	super    *natstest.Supercluster // nil on one server
	replicas int                    // of the streams (--stream.replicas), 1 unless a supercluster sets it
	dir      string
	authDir  string // the identities' seeds (natsauth.Write)
	interval time.Duration
	regions  map[string]*regionStack
	addrs    map[string]string // each region's limiterd
	// recOpts, when set, changes each reconciler's options before New.
	recOpts func(*Options)
	// limOpts, when set (by the function that starts NATS, which runs
	// first), changes each limiterd's options before New.
	limOpts func(*limiterd.Options)
	// wan, when set (newWANStack), is the one-way delay between each pair
	// of regions, both orders; peers[viewer][region] is the proxy that
	// region's limiterd is reached through from viewer's, with that delay.
	wan   map[[2]string]time.Duration
	peers map[string]map[string]*wanproxy.Proxy
}

type regionStack struct {
	name    string
	cluster *redistest.Cluster
	redis   *redis.ClusterClient
	lim     *limiterd.Daemon
	client  limiterv1.LimiterClient
	recs    []*Reconciler
}

var stackRegions = []string{"us-east", "eu-west"}

// stackAdminToken is the admin token of every limiterd of a stack.
const stackAdminToken = "stack-admin-token-of-the-tests"

func quiet() *slog.Logger {
	if os.Getenv("LIMITER_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// lockNATS runs the stacks' NATS server with the identities and
// permissions of package natsauth, each daemon connecting as its own; a
// test of what the permissions refuse fails with it off.
var lockNATS = true

// newStack starts both regions with the rules given, reconciling every
// interval, with reconcilers reconcilers per region, each daemon with its
// NATS identity (the limiterd of us-east also with the admin writer's).
func newStack(t testing.TB, rulesYAML string, interval time.Duration, reconcilers int) *stack {
	t.Helper()
	return buildStack(t, stackRegions, rulesYAML, interval, reconcilers, func(s *stack, opts ...natstest.Option) {
		s.nats = natstest.NewServer(t, opts...)
	})
}

// newSuperStack starts regions as newStack does, one reconciler each, but
// on a NATS supercluster of serversPerRegion servers per region: each
// region's daemons connect to their own region's servers, and the streams
// have as many replicas as a region has servers (at most 3).
func newSuperStack(t testing.TB, regions []string, serversPerRegion int, rulesYAML string, interval time.Duration) *stack {
	t.Helper()
	return buildStack(t, regions, rulesYAML, interval, 1, func(s *stack, opts ...natstest.Option) {
		began := time.Now()
		s.super = natstest.NewSupercluster(t, regions, serversPerRegion, opts...)
		s.replicas = min(serversPerRegion, 3)
		t.Logf("NATS supercluster of %d regions x %d servers formed in %v", len(regions), serversPerRegion, time.Since(began).Round(10*time.Millisecond))
	})
}

// newWANStack starts regions as newSuperStack does, one NATS server each,
// with the one-way delays of wan (keyed by pairs of regions, either order)
// on the gateways between the regions and on the Peer links between
// their limiterd: each limiterd reaches another region's through a
// wanproxy.Proxy of that pair, named in a topology file of its own.
func newWANStack(t testing.TB, regions []string, wan map[[2]string]time.Duration, rulesYAML string, interval time.Duration) *stack {
	t.Helper()
	return buildStack(t, regions, rulesYAML, interval, 1, func(s *stack, opts ...natstest.Option) {
		s.wan = map[[2]string]time.Duration{}
		for p, d := range wan {
			s.wan[p], s.wan[[2]string{p[1], p[0]}] = d, d
		}
		s.super = natstest.NewSupercluster(t, regions, 1, opts...)
		s.replicas = 1
		for p, d := range wan {
			s.super.SetDelay(p[0], p[1], d)
		}
	})
}

// startPeerProxies starts, for each ordered pair of regions, the proxy
// that carries the first's Peer calls to the second's limiterd with their
// delay, and writes each region's topology file naming them.
func (s *stack) startPeerProxies() {
	s.t.Helper()
	s.peers = map[string]map[string]*wanproxy.Proxy{}
	for _, viewer := range s.names {
		s.peers[viewer] = map[string]*wanproxy.Proxy{}
		for _, r := range s.names {
			if r == viewer {
				continue
			}
			d := wanproxy.Shape{Delay: s.wan[[2]string{viewer, r}]}
			p, err := wanproxy.Listen("127.0.0.1:0", s.addrs[r], wanproxy.NewLink(d, d))
			if err != nil {
				s.t.Fatal(err)
			}
			s.t.Cleanup(func() { p.Close() })
			s.peers[viewer][r] = p
		}
		writeFile(s.t, s.dir, "topology-"+viewer+".yml", s.topologyFor(viewer, 0, time.Time{}, s.names...))
	}
}

// natsURL is where region's daemons connect.
func (s *stack) natsURL(region string) string {
	if s.super != nil {
		return s.super.URL(region)
	}
	return s.nats.URL()
}

func buildStack(t testing.TB, names []string, rulesYAML string, interval time.Duration, reconcilers int, startNATS func(*stack, ...natstest.Option)) *stack {
	t.Helper()
	return buildStackTopo(t, names, nil, rulesYAML, interval, reconcilers, startNATS)
}

// buildStackTopo is buildStack where region's daemons start on a topology
// file of their own, of the regions topos[region] (all of them when it is
// not set).
func buildStackTopo(t testing.TB, names []string, topos map[string][]string, rulesYAML string, interval time.Duration, reconcilers int, startNATS func(*stack, ...natstest.Option)) *stack {
	t.Helper()
	return buildStackLate(t, names, topos, nil, rulesYAML, interval, reconcilers, startNATS)
}

// buildStackLate is buildStackTopo where the regions of late get no
// reconciler (the test starts them with startReconciler): their streams
// do not exist yet.
func buildStackLate(t testing.TB, names []string, topos map[string][]string, late []string, rulesYAML string, interval time.Duration, reconcilers int, startNATS func(*stack, ...natstest.Option)) *stack {
	t.Helper()
	s := &stack{t: t, names: names, dir: t.TempDir(), interval: interval, replicas: 1, regions: map[string]*regionStack{}}
	s.authDir = filepath.Join(s.dir, "auth")
	ids, err := natsauth.Write(s.authDir, names)
	if err != nil {
		t.Fatal(err)
	}
	ids = append(ids, opsIdentity(t, s.authDir))
	if lockNATS {
		startNATS(s, natstest.Config(natsauth.Config(ids)))
	} else {
		startNATS(s)
	}
	writeFile(t, s.dir, "rules.yml", rulesYAML)
	for _, name := range names {
		c := redistest.NewCluster(t, 3, 0)
		rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
		t.Cleanup(func() { rc.Close() })
		s.regions[name] = &regionStack{name: name, cluster: c, redis: rc}
	}
	// The topology names each limiterd's address, so pick them first.
	s.addrs = map[string]string{}
	for _, name := range names {
		s.addrs[name] = testenv.FreeAddr(t)
	}
	writeFile(t, s.dir, "topology.yml", s.topology(0, time.Time{}, names...))
	if s.wan != nil {
		s.startPeerProxies()
	}
	for name, regions := range topos {
		writeFile(t, s.dir, "topology-"+name+".yml", s.topology(1, time.Time{}, regions...))
	}
	addrs := s.addrs
	secret := testenv.SecretFile(t)
	writeFile(t, s.dir, "admin-token", stackAdminToken)
	if err := os.Chmod(filepath.Join(s.dir, "admin-token"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		r := s.regions[name]
		var admin natsconn.Auth
		if name == "us-east" {
			admin = s.auth("admin")
		}
		// A check shed after the default 50 ms in the queue is the test
		// machine's load (the tests run in parallel), not what these
		// tests are about.
		o := limiterd.DefaultOptions()
		// Generous store deadlines: on a busy machine a check that times
		// out is admitted by the fallback, uncounted in this region's
		// Redis, and the tests' counts are exact.
		o.RedisTuning.Timeout, o.RedisTuning.MaxQueueWait = time.Second, time.Second
		o.RedisTuning.ReplyDeadline, o.RedisTuning.DialTimeout = 5*time.Second, 2*time.Second
		o.Server.GRPCAddress, o.Server.HTTPAddress = addrs[name], "127.0.0.1:0"
		// A forward's deadline as generous, under the checks' own 2 s: in
		// make test's phase 1 a forward over a 220 ms round trip took
		// over 1 s.
		o.Region.TopologyFile, o.Region.TopologyPoll, o.Region.ForwardTimeout, o.Region.PeerSecretFile = s.topologyFile(name), 100*time.Millisecond, 1500*time.Millisecond, secret
		o.Rules.File, o.Redis.Addrs = filepath.Join(s.dir, "rules.yml"), r.cluster.Addrs()
		o.Region.Name, o.NATS.URL, o.NATS.GossipInterval, o.Region.Instance = name, s.natsURL(name), interval, "limiterd-"+name
		o.NATS.GossipMaxDefer = 0 // each spend published at its interval, as the tests expect
		o.NATS.Auth, o.Admin.NATSAuth = s.auth("limiterd-"+name), admin
		o.Admin.TokenFile = filepath.Join(s.dir, "admin-token")
		o.Logger = quiet().With("component", "limiterd")
		if s.limOpts != nil {
			s.limOpts(&o)
		}
		d, err := limiterd.New(o)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Stop(context.Background()) })
		r.lim = d
		cc, err := grpc.NewClient(d.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		r.client = limiterv1.NewLimiterClient(cc)
	}
	for _, name := range names {
		if slices.Contains(late, name) {
			continue
		}
		for range reconcilers {
			s.startReconciler(name)
		}
	}
	s.waitReady()
	return s
}

func (s *stack) reconcilerOptions(region string) Options {
	o := DefaultOptions()
	o.Region, o.TopologyFile, o.TopologyPoll, o.RulesFile = region, s.topologyFile(region), 100*time.Millisecond, filepath.Join(s.dir, "rules.yml")
	o.NATSURL, o.Redis, o.Interval, o.StreamReplicas = s.natsURL(region), redisstore.Conn{Addrs: s.regions[region].cluster.Addrs()}, s.interval, s.replicas
	o.AckWait, o.StreamMaxBytes, o.HTTPAddress = time.Second, 64<<20, "127.0.0.1:0"
	// A partition of a reconciler that dies goes to another within 2 s.
	o.LeaseTTL = 2 * time.Second
	o.NATSAuth = s.auth("reconciler-" + region)
	o.Logger = quiet().With("component", "reconciler", "region", region)
	return o
}

// topology is a topology file of generation gen over regions, effective at
// at (zero: none).
func (s *stack) topology(gen int, at time.Time, regions ...string) string {
	return s.topologyFor("", gen, at, regions...)
}

// topologyFor is topology as viewer's limiterd reads it: each other
// region at the address of its Peer proxy, when there is one.
func (s *stack) topologyFor(viewer string, gen int, at time.Time, regions ...string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "generation: %d\n", gen)
	if !at.IsZero() {
		fmt.Fprintf(&b, "effective_at: %s\n", at.UTC().Format(time.RFC3339Nano))
	}
	b.WriteString("regions:\n")
	for _, name := range regions {
		addr := s.addrs[name]
		if p := s.peers[viewer][name]; p != nil {
			addr = p.Addr()
		}
		fmt.Fprintf(&b, "  - name: %s\n    limiter_address: %s\n", name, addr)
	}
	return b.String()
}

// topologyFile is region's topology file: its own when it has one.
func (s *stack) topologyFile(region string) string {
	own := filepath.Join(s.dir, "topology-"+region+".yml")
	if _, err := os.Stat(own); err == nil {
		return own
	}
	return filepath.Join(s.dir, "topology.yml")
}

// startReconciler starts one more reconciler in region.
//
// Each setup runs between New and Start, so what it sets (a test hook
// such as beforeAck) is written before the reconciler's goroutines start.
func (s *stack) startReconciler(region string, setup ...func(*Reconciler)) *Reconciler {
	s.t.Helper()
	o := s.reconcilerOptions(region)
	if s.recOpts != nil {
		s.recOpts(&o)
	}
	r, err := New(o)
	if err != nil {
		s.t.Fatal(err)
	}
	for _, f := range setup {
		f(r)
	}
	if err := r.Start(context.Background()); err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { r.Stop() })
	s.regions[region].recs = append(s.regions[region].recs, r)
	return r
}

// opsIdentity is an operator of the test, with every permission (deleting
// a stream, as a person recovering a deployment might): no daemon holds it.
// Its seed is written beside the daemons' as ops.nk.
func opsIdentity(t testing.TB, dir string) natsauth.Identity {
	t.Helper()
	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	pub, _ := kp.PublicKey()
	seed, _ := kp.Seed()
	if err := os.WriteFile(natsauth.SeedFile(dir, "ops"), append(seed, '\n'), 0o600); err != nil {
		t.Fatal(err)
	}
	return natsauth.Identity{Name: "ops", PublicKey: pub, Seed: seed,
		Permissions: natsauth.Permissions{PublishAllow: []string{">"}, SubscribeAllow: []string{">"}}}
}

// auth is the NATS credential of the identity named name.
func (s *stack) auth(name string) natsconn.Auth {
	if !lockNATS {
		return natsconn.Auth{} // a server without authorization takes no nkey
	}
	return natsconn.Auth{NkeySeedFile: natsauth.SeedFile(s.authDir, name)}
}

// connectAs connects to the stack's NATS (on a supercluster, the first
// region's servers) as the identity named name, as a daemon holding its
// seed would (or an attacker who took it).
func (s *stack) connectAs(name string) *nats.Conn {
	s.t.Helper()
	return s.connectAsIn(name, s.names[0])
}

// connectAsIn is connectAs to region's NATS servers.
func (s *stack) connectAsIn(name, region string) *nats.Conn {
	s.t.Helper()
	a := s.auth(name)
	opts, err := a.Options(quiet())
	if err != nil {
		s.t.Fatal(err)
	}
	// The refusals are read from LastError, not printed. Replies come to
	// the identity's own inbox, as they do to the daemons.
	opts = append(opts, nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}), natsconn.Inbox(name))
	nc, err := nats.Connect(s.natsURL(region), opts...)
	if err != nil {
		s.t.Fatalf("connect as %s: %v", name, err)
	}
	s.t.Cleanup(nc.Close)
	return nc
}

func (s *stack) waitReady() {
	s.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for _, r := range s.regions {
		for _, rec := range r.recs {
			for !rec.ready.Load() {
				if time.Now().After(deadline) {
					s.t.Fatal("reconcilers not ready after 20s")
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
	}
}

func writeFile(t testing.TB, dir, name, content string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// check asks region's limiterd, within 5 s: a first check forwarded to a
// pinned key's home dials it over the WAN proxy, and under make test's
// load took more than 2 s. A test of how fast an answer comes measures it.
func (s *stack) check(region, rule, key string) (*limiterv1.CheckResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return s.regions[region].client.Check(ctx, &limiterv1.CheckRequest{RuleId: rule, Key: key})
}
