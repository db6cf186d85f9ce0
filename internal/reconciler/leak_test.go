package reconciler

import (
	"context"
	"net"
	"path/filepath"
	"testing"

	"go.uber.org/goleak"

	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// TestStartFailuresLeakNothing: a Start that fails at any step releases
// what the steps before it started (goroutines, connections, listeners),
// and a Start that succeeds leaves nothing once stopped.
func TestStartFailuresLeakNothing(t *testing.T) {
	// Not parallel: goleak would see the other tests' goroutines.
	cluster := redistest.NewCluster(t, 3, 0)
	nats := natstest.NewServer(t)
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	dir := t.TempDir()
	writeFile(t, dir, "rules.yml", quotaRules)
	writeFile(t, dir, "topology.yml", "regions:\n  - name: us-east\n    limiter_address: 127.0.0.1:1\n")
	tests := []struct {
		name   string
		mutate func(*Options)
		fails  bool
	}{
		{"redis password file missing", func(o *Options) { o.Redis.PasswordFile = filepath.Join(dir, "none") }, true},
		{"nats seed file missing", func(o *Options) { o.NATSAuth = natsconn.Auth{NkeySeedFile: filepath.Join(dir, "none")} }, true},
		{"http address taken", func(o *Options) { o.HTTPAddress = busy.Addr().String() }, true},
		{"started and stopped", func(*Options) {}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ignore := goleak.IgnoreCurrent()
			opts := DefaultOptions()
			opts.Region, opts.TopologyFile, opts.RulesFile = "us-east", filepath.Join(dir, "topology.yml"), filepath.Join(dir, "rules.yml")
			opts.NATSURL, opts.Redis, opts.HTTPAddress, opts.Logger = nats.URL(), redisstore.Conn{Addrs: cluster.Addrs()}, "127.0.0.1:0", quiet()
			tt.mutate(&opts)
			r, err := New(opts)
			if err != nil {
				t.Fatal(err)
			}
			err = r.Start(context.Background())
			if (err != nil) != tt.fails {
				t.Fatalf("Start: %v, want failing %v", err, tt.fails)
			}
			if err == nil {
				if err := r.Stop(); err != nil {
					t.Fatal(err)
				}
			}
			goleak.VerifyNone(t, append(redistest.IgnoreWarm(), ignore)...)
		})
	}
}
