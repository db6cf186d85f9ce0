package limiterd

import (
	"context"
	"net"
	"testing"

	"go.uber.org/goleak"

	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// TestStartFailuresLeakNothing: a Start that fails at any step releases
// what the steps before it started: goroutines, connections, listeners.
func TestStartFailuresLeakNothing(t *testing.T) {
	cluster := redistest.NewCluster(t, 3, 0)
	nats := natstest.NewServer(t)
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	tests := []struct {
		name   string
		mutate func(*Options)
	}{
		{"grpc address taken", func(o *Options) { o.Server.GRPCAddress = busy.Addr().String() }},
		{"http address taken", func(o *Options) { o.Server.HTTPAddress = busy.Addr().String() }},
		{"peer secret readable by others", func(o *Options) {
			o.Region.Name, o.Region.TopologyFile, o.Region.PeerSecretFile = "us-east", twoRegionTopology(t), "testdata/rules.yml"
		}},
		{"missing password file", func(o *Options) { o.Redis.PasswordFile = "testdata/none" }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ignore := goleak.IgnoreCurrent()
			opts := DefaultOptions()
			opts.Server.GRPCAddress, opts.Server.HTTPAddress, opts.Rules.File = "127.0.0.1:0", "127.0.0.1:0", "testdata/rules.yml"
			opts.Redis.Addrs, opts.NATS.URL, opts.Logger = cluster.Addrs(), nats.URL(), quietLogger()
			tt.mutate(&opts)
			d, err := New(opts)
			if err != nil {
				t.Fatal(err)
			}
			if err := d.Start(context.Background()); err == nil {
				d.Stop(context.Background())
				t.Fatal("Start succeeded")
			}
			goleak.VerifyNone(t, append(redistest.IgnoreWarm(), ignore)...)
		})
	}
}
