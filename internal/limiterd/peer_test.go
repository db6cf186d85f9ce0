package limiterd

import (
	"context"
	"crypto/tls"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/peer"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/wanproxy"
	"github.com/limiterd/limiterd/pkg/region"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// twoRegionTopology writes a topology where this daemon is us-east and
// eu-west is elsewhere (never reached by these tests).
func twoRegionTopology(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "topology.yml")
	if err := os.WriteFile(path, []byte("regions:\n  - name: us-east\n    limiter_address: 127.0.0.1:1\n  - name: eu-west\n    limiter_address: 127.0.0.1:2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func refusedPeerCalls(t *testing.T, d *Daemon, reason string) float64 {
	t.Helper()
	n, err := testutil.GatherAndCount(d.Registry(), "limiter_peer_calls_refused_total")
	if err != nil || n == 0 {
		t.Fatalf("limiter_peer_calls_refused_total not exported: %v", err)
	}
	for _, mf := range mustGather(t, d) {
		if mf.GetName() != "limiter_peer_calls_refused_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && l.GetValue() == reason {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestPeerCallsNeedCredentials: only a caller with the peer secret may have
// a check decided as the key's home; the old marker on a Check, which once
// let any client decide a pinned rule locally with the full limit, is
// refused. Each refusal is counted.
func TestPeerCallsNeedCredentials(t *testing.T) {
	secretFile := testenv.SecretFile(t)
	secret, err := peer.ReadSecret(secretFile, nil)
	if err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, nil, func(o *Options) {
		o.Region.Name = "us-east"
		o.Region.TopologyFile = twoRegionTopology(t)
		o.Region.PeerSecretFile = secretFile
	})
	cc := dial(t, d.GRPCAddr())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()

	p := limiterv1.NewPeerClient(cc)
	req := &limiterv1.PeerDecideRequest{OriginRegion: "eu-west", Items: []*limiterv1.PeerItem{{RuleId: "tb", Key: "k", Cost: 1}}}
	tests := []struct {
		name string
		ctx  context.Context
		req  *limiterv1.PeerDecideRequest
		want codes.Code
	}{
		{"no secret", ctx, req, codes.PermissionDenied},
		{"wrong secret", metadata.AppendToOutgoingContext(ctx, peer.SecretHeader, "not-the-secret-at-all"), req, codes.PermissionDenied},
		{"origin not in the topology", metadata.AppendToOutgoingContext(ctx, peer.SecretHeader, string(secret)),
			&limiterv1.PeerDecideRequest{OriginRegion: "mars", Items: req.Items}, codes.InvalidArgument},
		{"no items", metadata.AppendToOutgoingContext(ctx, peer.SecretHeader, string(secret)),
			&limiterv1.PeerDecideRequest{OriginRegion: "eu-west"}, codes.InvalidArgument},
		{"the secret", metadata.AppendToOutgoingContext(ctx, peer.SecretHeader, string(secret)), req, codes.OK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := p.Decide(tt.ctx, tt.req)
			if status.Code(err) != tt.want {
				t.Fatalf("Decide = %v, %v; want %v", resp, err, tt.want)
			}
			if tt.want == codes.OK && (!resp.GetAllowed() || len(resp.GetStatuses()) != 1 || resp.GetStatuses()[0].GetRemaining() != 9) {
				t.Fatalf("Decide = %v, want allowed with 9 left", resp)
			}
		})
	}
	if got := refusedPeerCalls(t, d, "unauthenticated"); got != 2 {
		t.Errorf("unauthenticated refusals = %v, want 2", got)
	}
}

// TestPeerIdentityByCertificate: with --region.peer-identities, a client
// certificate naming an allowed identity is a peer; another certificate of
// the same CA (any gateway's) is not.
func TestPeerIdentityByCertificate(t *testing.T) {
	ca := testenv.NewCA(t)
	srvCert, srvKey := ca.Issue(t, "server", true)
	cliCert, cliKey := ca.Issue(t, "test", false)
	d := startDaemon(t, nil, func(o *Options) {
		o.Region.Name = "us-east"
		o.Region.TopologyFile = twoRegionTopology(t)
		o.Server.TLSCertFile, o.Server.TLSKeyFile, o.Server.TLSClientCAFile = srvCert, srvKey, ca.File
		o.Region.PeerIdentities = []string{"limiterd.eu-west"}
	})
	roots := ca.Pool()
	pair, err := tls.LoadX509KeyPair(cliCert, cliKey)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(d.GRPCAddr(), grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: roots, Certificates: []tls.Certificate{pair}})))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = limiterv1.NewPeerClient(cc).Decide(ctx, &limiterv1.PeerDecideRequest{OriginRegion: "eu-west",
		Items: []*limiterv1.PeerItem{{RuleId: "tb", Key: "k", Cost: 1}}})
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("Decide with a gateway's certificate (CN test): %v, want PermissionDenied", err)
	}
}

// TestTopologyNeedsPeerCredentials: a limiterd with a topology and no way
// to tell peers from anyone else does not start.
func TestTopologyNeedsPeerCredentials(t *testing.T) {
	_, err := New(Options{Rules: RulesOptions{File: "testdata/rules.yml"}, Region: RegionOptions{Name: "us-east", TopologyFile: twoRegionTopology(t)}, Logger: quietLogger()})
	if err == nil {
		t.Fatal("New accepted a topology without --region.peer-secret-file or --region.peer-identities")
	}
	// A secret readable by others is refused at start.
	f := testenv.SecretFile(t)
	if err := os.Chmod(f, 0o644); err != nil {
		t.Fatal(err)
	}
	o := DefaultOptions()
	o.Server.GRPCAddress, o.Server.HTTPAddress, o.Rules.File = "127.0.0.1:0", "127.0.0.1:0", "testdata/rules.yml"
	o.Region.Name, o.Region.TopologyFile, o.Region.PeerSecretFile, o.Logger = "us-east", twoRegionTopology(t), f, quietLogger()
	d, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(context.Background()); err == nil {
		d.Stop(context.Background())
		t.Fatal("Start accepted a world-readable peer secret")
	}
}

// TestForwardedCheckFindsPeerConnected: a daemon connects to the other
// regions' limiterd when it loads the topology, not on the first check
// forwarded there. Behind a one-way delay of 500 ms, setting up the
// connection on demand (the server's settings come back in one delay) and
// then asking (a round trip) takes 1.5 s, over the 1.25 s forward timeout;
// connected ahead, the first check takes the round trip and is answered.
func TestForwardedCheckFindsPeerConnected(t *testing.T) {
	const oneWay = 500 * time.Millisecond
	dir := t.TempDir()
	rules := filepath.Join(dir, "rules.yml")
	if err := os.WriteFile(rules, []byte("rules:\n  - id: hard\n    capacity: 10\n    refill_per_second: 0.000001\n    home: pinned\n    on_failure: closed\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	secret := testenv.SecretFile(t)
	topoFile := func(name, east, west string) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte("regions:\n  - name: us-east\n    limiter_address: "+east+"\n  - name: eu-west\n    limiter_address: "+west+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	west := startDaemon(t, nil, func(o *Options) {
		o.Rules.File, o.Region.Name, o.Region.PeerSecretFile = rules, "eu-west", secret
		o.Region.TopologyFile = topoFile("west.yml", "127.0.0.1:1", "127.0.0.1:2")
	})
	proxy, err := wanproxy.Listen("127.0.0.1:0", west.GRPCAddr(), wanproxy.NewLink(wanproxy.Shape{Delay: oneWay}, wanproxy.Shape{Delay: oneWay}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.Close() })
	east := startDaemon(t, nil, func(o *Options) {
		o.Rules.File, o.Region.Name, o.Region.PeerSecretFile = rules, "us-east", secret
		o.Region.TopologyFile = topoFile("east.yml", "127.0.0.1:1", proxy.Addr())
		o.Region.ForwardTimeout = 1250 * time.Millisecond
	})
	topo, err := region.Load(filepath.Join(dir, "east.yml"))
	if err != nil {
		t.Fatal(err)
	}
	key := ""
	for i := 0; key == ""; i++ {
		if k := fmt.Sprint("user-", i); topo.Home(k, nil) == "eu-west" {
			key = k
		}
	}
	// Time for the connection, set up when the topology loaded.
	time.Sleep(4 * oneWay)
	client := limiterv1.NewLimiterClient(dial(t, east.GRPCAddr()))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "hard", Key: key})
	if err != nil || !resp.GetAllowed() {
		t.Fatalf("first check forwarded to eu-west: %v, %v", resp, err)
	}
	if took := time.Since(start); took < 2*oneWay {
		t.Fatalf("first check forwarded to eu-west answered in %v, under the round trip %v: not forwarded", took, 2*oneWay)
	}
}
