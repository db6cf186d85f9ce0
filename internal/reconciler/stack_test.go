package reconciler

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/testenv"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// stack is two regions on loopback: for each a real Redis Cluster, a
// limiterd and reconcilers, all on one in-process JetStream server.
type stack struct {
	t        testing.TB
	nats     *testenv.NATSServer
	dir      string
	interval time.Duration
	regions  map[string]*regionStack
}

type regionStack struct {
	name    string
	cluster *testenv.Cluster
	redis   *redis.ClusterClient
	lim     *limiterd.Daemon
	client  limiterv1.LimiterClient
	recs    []*Reconciler
}

var stackRegions = []string{"us-east", "eu-west"}

func quiet() *slog.Logger {
	if os.Getenv("LIMITER_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// newStack starts both regions with the rules given, reconciling every
// interval, with reconcilers reconcilers per region.
func newStack(t testing.TB, rulesYAML string, interval time.Duration, reconcilers int) *stack {
	t.Helper()
	s := &stack{t: t, nats: testenv.NATS(t), dir: t.TempDir(), interval: interval, regions: map[string]*regionStack{}}
	writeFile(t, s.dir, "rules.yml", rulesYAML)
	for _, name := range stackRegions {
		c := testenv.RedisCluster(t, 3, 0)
		rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
		t.Cleanup(func() { rc.Close() })
		s.regions[name] = &regionStack{name: name, cluster: c, redis: rc}
	}
	// The topology names each limiterd's address, so pick them first.
	addrs := map[string]string{}
	var topo strings.Builder
	topo.WriteString("regions:\n")
	for _, name := range stackRegions {
		addrs[name] = freeAddr(t)
		fmt.Fprintf(&topo, "  - name: %s\n    limiter_address: %s\n", name, addrs[name])
	}
	writeFile(t, s.dir, "topology.yml", topo.String())
	secret := testenv.SecretFile(t)
	for _, name := range stackRegions {
		r := s.regions[name]
		d, err := limiterd.New(limiterd.Options{
			GRPCAddress: addrs[name], HTTPAddress: "127.0.0.1:0",
			TopologyFile: filepath.Join(s.dir, "topology.yml"), ForwardTimeout: time.Second, PeerSecretFile: secret,
			RulesFile: filepath.Join(s.dir, "rules.yml"), RedisAddrs: r.cluster.Addrs(), RedisTimeout: time.Second,
			Region: name, NATSURL: s.nats.URL(), GossipInterval: interval, Instance: "limiterd-" + name,
			Logger: quiet().With("component", "limiterd"),
		})
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
	for _, name := range stackRegions {
		for range reconcilers {
			s.startReconciler(name)
		}
	}
	s.waitReady()
	return s
}

func (s *stack) reconcilerOptions(region string) Options {
	return Options{
		Region: region, TopologyFile: filepath.Join(s.dir, "topology.yml"), RulesFile: filepath.Join(s.dir, "rules.yml"),
		NATSURL: s.nats.URL(), RedisAddrs: s.regions[region].cluster.Addrs(), Interval: s.interval,
		AckWait: time.Second, StreamMaxBytes: 64 << 20, HTTPAddress: "127.0.0.1:0",
		Logger: quiet().With("component", "reconciler", "region", region),
	}
}

// startReconciler starts one more reconciler in region.
func (s *stack) startReconciler(region string) *Reconciler {
	s.t.Helper()
	r, err := New(s.reconcilerOptions(region))
	if err != nil {
		s.t.Fatal(err)
	}
	if err := r.Start(context.Background()); err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { r.Stop() })
	s.regions[region].recs = append(s.regions[region].recs, r)
	return r
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

// freeAddr returns a loopback address that was free a moment ago.
func freeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func writeFile(t testing.TB, dir, name, content string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// check asks region's limiterd.
func (s *stack) check(region, rule, key string) (*limiterv1.CheckResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return s.regions[region].client.Check(ctx, &limiterv1.CheckRequest{RuleId: rule, Key: key})
}
