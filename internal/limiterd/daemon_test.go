package limiterd

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nkeys"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// startDaemon runs a limiterd in-process on loopback ports.
func startDaemon(t testing.TB, redisAddrs []string, mutate ...func(*Options)) *Daemon {
	t.Helper()
	opts := DefaultOptions()
	opts.Server.GRPCAddress, opts.Server.HTTPAddress, opts.Rules.File = "127.0.0.1:0", "127.0.0.1:0", "testdata/rules.yml"
	opts.Redis.Addrs, opts.RedisTuning.Timeout, opts.Logger = redisAddrs, time.Second, quietLogger()
	// The tests see each spend published at its interval.
	opts.NATS.GossipMaxDefer = 0
	for _, m := range mutate {
		m(&opts)
	}
	d, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop(context.Background()) })
	return d
}

func dial(t testing.TB, addr string) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

func TestCheckValidation(t *testing.T) {
	d := startDaemon(t, nil)
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	tests := []struct {
		name string
		req  *limiterv1.CheckRequest
		code codes.Code
		// field is the field the error message must name.
		field string
	}{
		{"valid", &limiterv1.CheckRequest{RuleId: "tb", Key: "k"}, codes.OK, ""},
		{"unknown rule", &limiterv1.CheckRequest{RuleId: "nope", Key: "k"}, codes.NotFound, "rule_id"},
		{"empty rule", &limiterv1.CheckRequest{Key: "k"}, codes.NotFound, "rule_id"},
		{"empty key", &limiterv1.CheckRequest{RuleId: "tb"}, codes.InvalidArgument, "key"},
		{"long key", &limiterv1.CheckRequest{RuleId: "tb", Key: strings.Repeat("k", 513)}, codes.InvalidArgument, "key"},
		{"key of 512 bytes", &limiterv1.CheckRequest{RuleId: "tb", Key: strings.Repeat("k", 512)}, codes.OK, ""},
		{"NaN cost", &limiterv1.CheckRequest{RuleId: "tb", Key: "k", Cost: math.NaN()}, codes.InvalidArgument, "cost"},
		{"+Inf cost", &limiterv1.CheckRequest{RuleId: "tb", Key: "k", Cost: math.Inf(1)}, codes.InvalidArgument, "cost"},
		{"-Inf cost", &limiterv1.CheckRequest{RuleId: "tb", Key: "k", Cost: math.Inf(-1)}, codes.InvalidArgument, "cost"},
		{"negative cost", &limiterv1.CheckRequest{RuleId: "tb", Key: "k", Cost: -1}, codes.InvalidArgument, "cost"},
		{"cost above capacity", &limiterv1.CheckRequest{RuleId: "tb", Key: "k", Cost: 11}, codes.InvalidArgument, "cost"},
		{"fractional log cost", &limiterv1.CheckRequest{RuleId: "log", Key: "k", Cost: 1.5}, codes.InvalidArgument, "cost"},
		{"settle", &limiterv1.CheckRequest{RuleId: "tb", Key: "k", Settle: true}, codes.OK, ""},
		{"settle paced", &limiterv1.CheckRequest{RuleId: "tb", Key: "k", Settle: true, MaxWaitMs: 100}, codes.InvalidArgument, "settle"},
		{"settle by attributes", &limiterv1.CheckRequest{Settle: true, Attributes: &limiterv1.Attributes{Path: "/x"}}, codes.InvalidArgument, "settle"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := client.Check(context.Background(), tt.req)
			if got := status.Code(err); got != tt.code {
				t.Fatalf("code = %v (%v), want %v", got, err, tt.code)
			}
			if err != nil && !strings.HasPrefix(status.Convert(err).Message(), tt.field+":") {
				t.Fatalf("message %q does not start with the field %q", status.Convert(err).Message(), tt.field)
			}
			if err == nil && (!resp.Allowed || resp.Limit != 10) {
				t.Fatalf("resp = %v", resp)
			}
		})
	}
}

func TestCheckResponse(t *testing.T) {
	d := startDaemon(t, nil)
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	ctx := context.Background()
	for i := range 3 {
		resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "log", Key: "u"})
		if err != nil || !resp.Allowed || resp.Remaining != float64(2-i) || resp.RuleId != "log" {
			t.Fatalf("check %d: %v, %v", i, resp, err)
		}
	}
	resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "log", Key: "u"})
	if err != nil || resp.Allowed || resp.RetryAfterMs <= 0 || resp.RetryAfterMs > 3600_000 || resp.ResetAfterMs <= 0 {
		t.Fatalf("4th check: %v, %v; want a rejection with 0 < retry_after_ms <= 1h", resp, err)
	}
}

// TestRaceTwoInstances: 50 concurrent clients through two limiterd
// instances on one 3-primary cluster against a 10-token bucket admit
// exactly 10, run after run.
func TestRaceTwoInstances(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	a := startDaemon(t, c.Addrs())
	b := startDaemon(t, c.Addrs())
	clients := []limiterv1.LimiterClient{
		limiterv1.NewLimiterClient(dial(t, a.GRPCAddr())),
		limiterv1.NewLimiterClient(dial(t, b.GRPCAddr())),
	}
	for run := range 3 {
		key := fmt.Sprintf("race-%d", run)
		var admitted, failed atomic.Int64
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range 50 {
			wg.Go(func() {
				<-start
				resp, err := clients[i%2].Check(context.Background(), &limiterv1.CheckRequest{RuleId: "tb", Key: key})
				switch {
				case err != nil:
					failed.Add(1)
					t.Error(err)
				case resp.Allowed:
					admitted.Add(1)
				}
			})
		}
		close(start)
		wg.Wait()
		t.Logf("run %d: %d of 50 admitted", run, admitted.Load())
		if admitted.Load() != 10 || failed.Load() != 0 {
			t.Fatalf("run %d: admitted %d, failed %d; want exactly 10 admitted", run, admitted.Load(), failed.Load())
		}
	}
}

// TestStoreDown: with every Redis node stopped, fail-open rules decide from
// the local bucket and fail-closed rules answer UNAVAILABLE; with Redis back,
// decisions come from the store again.
func TestStoreDown(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	d := startDaemon(t, c.Addrs(), func(o *Options) { o.RedisTuning.Timeout = 200 * time.Millisecond })
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	ctx := context.Background()
	// The first check dials the nodes and loads the scripts: on a loaded
	// machine that may take longer than the 200 ms timeout of the test.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		_, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "closed", Key: "k"})
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the store still failing 10 s after it started: %v", err)
		}
	}
	c.StopAll()
	// Once the store's probe has seen it down: a check on a connection
	// the kill cut may have reached Redis, and is answered as uncertain.
	for deadline := time.Now().Add(10 * time.Second); d.redis.Health() == nil; {
		if time.Now().After(deadline) {
			t.Fatal("the store still reports healthy 10 s after every node was killed")
		}
		time.Sleep(50 * time.Millisecond)
	}
	allowed := 0
	for range 6 {
		resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "open", Key: "k"})
		if err != nil {
			t.Fatalf("fail-open rule: %v", err)
		}
		if resp.Allowed {
			allowed++
		}
	}
	// A check already on its way when the nodes died (a busy machine
	// sends it late) gets no reply: the outcome is unknown, and a
	// fail-open rule admits it as uncertain, outside the fallback's limit.
	fallback := metricValue(t, d, "limiter_decisions_total", map[string]string{"rule": "open", "result": "fallback_allowed"})
	uncertain := metricValue(t, d, "limiter_decisions_total", map[string]string{"rule": "open", "result": "uncertain_allowed"})
	if fallback != 4 || float64(allowed) != fallback+uncertain {
		t.Fatalf("fail-open rule admitted %d of 6 (%v by the fallback, %v uncertain), want the fallback's limit 4 by the fallback", allowed, fallback, uncertain)
	}
	_, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "closed", Key: "k"})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("fail-closed rule with the store down: %v, want Unavailable", err)
	}
	c.StartAll()
	c.WaitHealthy(t)
	deadline := time.Now().Add(15 * time.Second)
	for {
		resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "closed", Key: "k"})
		if err == nil {
			// The cluster restarted empty (no persistence): a fresh bucket.
			if !resp.Allowed {
				t.Fatalf("after recovery: %v", resp)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("store still failing 15s after it came back: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// What the fallback did not admit of the six it limited: two, or
	// fewer when some were uncertain.
	if limited := metricValue(t, d, "limiter_decisions_total", map[string]string{"rule": "open", "result": "fallback_limited"}); limited != float64(6-allowed) {
		t.Errorf("limiter_decisions_total{result=\"fallback_limited\",rule=\"open\"} = %v, want %d: 6 checks, %d admitted", limited, 6-allowed, allowed)
	}
	body := scrape(t, d)
	for _, want := range []string{
		`limiter_decisions_total{result="fallback_allowed",rule="open"} 4`,
		`limiter_decisions_total{result="error",rule="closed"}`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

func scrape(t *testing.T, d *Daemon) string {
	t.Helper()
	resp, err := http.Get("http://" + d.HTTPAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func TestMetricsLint(t *testing.T) {
	d := startDaemon(t, nil)
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	_, _ = client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "tb", Key: "k"})
	testenv.Lint(t, mustGather(t, d))
	body := scrape(t, d)
	for _, want := range []string{
		`limiter_decisions_total{result="allowed",rule="tb"} 1`,
		`limiter_admitted_cost_total{rule="tb"} 1`,
		`limiter_rule_capacity{rule="tb"} 10`,
		`limiter_rule_sustained_rate{rule="log"} 0.000833`,
		"limiter_check_duration_seconds_bucket",
		`limiter_invalid_requests_total{field="cost"} 0`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

func TestMetricsLintRedis(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	d := startDaemon(t, c.Addrs())
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	_, _ = client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "tb", Key: "k"})
	testenv.Lint(t, mustGather(t, d))
	if body := scrape(t, d); !strings.Contains(body, `limiter_store_script_duration_seconds_count{script="token_bucket"} 1`) {
		t.Errorf("no store script duration recorded")
	}
}

// TestDrain: on Stop, readiness and gRPC health turn false first, checks
// are still answered during the shutdown delay, then the daemon stops.
func TestDrain(t *testing.T) {
	d := startDaemon(t, nil, func(o *Options) { o.Server.ShutdownDelay = 500 * time.Millisecond; o.Server.GracePeriod = time.Second })
	cc := dial(t, d.GRPCAddr())
	client := limiterv1.NewLimiterClient(cc)
	ready := func() int {
		resp, err := http.Get("http://" + d.HTTPAddr() + "/readyz")
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if got := ready(); got != http.StatusOK {
		t.Fatalf("readyz before Stop = %d", got)
	}
	stopped := make(chan error)
	go func() { stopped <- d.Stop(context.Background()) }()
	deadline := time.Now().Add(400 * time.Millisecond)
	for ready() != http.StatusServiceUnavailable {
		if time.Now().After(deadline) {
			t.Fatal("readyz still OK after Stop began")
		}
		time.Sleep(10 * time.Millisecond)
	}
	h, err := healthpb.NewHealthClient(cc).Check(context.Background(), &healthpb.HealthCheckRequest{})
	if err != nil || h.Status != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("gRPC health while draining: %v, %v", h, err)
	}
	if _, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "tb", Key: "k"}); err != nil {
		t.Fatalf("check during the shutdown delay: %v", err)
	}
	select {
	case err := <-stopped:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Stop did not return within the delay and the grace period")
	}
	if _, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "tb", Key: "k"}); err == nil {
		t.Fatal("check answered after Stop")
	}
}

// TestStartNATSCredentials: a seed or credentials file that is missing,
// open to other users or not a key stops Start with an error naming its
// flag, and leaves nothing running.
func TestStartNATSCredentials(t *testing.T) {
	dir := t.TempDir()
	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := kp.Seed()
	write := func(name string, data []byte, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := write("good.nk", seed, 0o600)
	open := write("open.nk", seed, 0o644)
	junk := write("junk.nk", []byte("junk\n"), 0o600)
	tests := []struct {
		name string
		main natsconn.Auth
		adm  natsconn.Auth
		want string
	}{
		{"seed open to others", natsconn.Auth{NkeySeedFile: open}, natsconn.Auth{}, "--nats.nkey-seed-file: "},
		{"seed not a seed", natsconn.Auth{NkeySeedFile: junk}, natsconn.Auth{}, "--nats.nkey-seed-file: "},
		{"creds missing", natsconn.Auth{CredsFile: filepath.Join(dir, "none")}, natsconn.Auth{}, "--nats.creds-file: "},
		{"admin seed open to others", natsconn.Auth{NkeySeedFile: good}, natsconn.Auth{NkeySeedFile: open}, "--admin.nats-nkey-seed-file: "},
		{"admin creds not creds", natsconn.Auth{}, natsconn.Auth{CredsFile: junk}, "--admin.nats-creds-file: "},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := DefaultOptions()
			o.Rules.File, o.Server.GRPCAddress, o.Server.HTTPAddress = "testdata/rules.yml", "127.0.0.1:0", "127.0.0.1:0"
			o.NATS.URL, o.NATS.Auth, o.Admin.NATSAuth, o.Logger = "nats://127.0.0.1:1", tt.main, tt.adm, quietLogger()
			d, err := New(o)
			if err != nil {
				t.Fatal(err)
			}
			err = d.Start(context.Background())
			if err == nil {
				d.Stop(context.Background())
				t.Fatal("Start: no error")
			}
			if !strings.HasPrefix(err.Error(), tt.want) {
				t.Fatalf("Start = %v, want an error starting %q", err, tt.want)
			}
		})
	}
}

// TestBadOptions: each bad option, set on the defaults, is refused naming
// its flag.
func TestBadOptions(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Options)
		want   string
	}{
		{"no rules", func(o *Options) { o.Rules.File = "" }, "--rules.file"},
		{"missing rules file", func(o *Options) { o.Rules.File = "testdata/nope.yml" }, "--rules.file"},
		{"bad region", func(o *Options) { o.Region.Name = "US East" }, "--region"},
		{"no region", func(o *Options) { o.Region.Name = "" }, "--region"},
		{"bad fleet", func(o *Options) { o.Region.FleetSize = -2 }, "--fleet.size"},
		{"no connections", func(o *Options) { o.Server.MaxConnections = 0 }, "--server.max-connections"},
		{"negative deny cache", func(o *Options) { o.Memory.DenyCacheSize = -1 }, "--deny-cache.size"},
		{"half TLS", func(o *Options) { o.Server.TLSCertFile = "x.pem" }, "--grpc.tls-key-file"},
		{"redis auth without redis", func(o *Options) { o.Redis.Username = "u" }, "--redis.addrs"},
		{"redis tuning zero", func(o *Options) { o.Redis.Addrs, o.RedisTuning = []string{"127.0.0.1:1"}, redisstore.Tuning{} }, "--redis.timeout"},
		{"nats creds and seed", func(o *Options) {
			o.NATS.URL, o.NATS.Auth = "nats://127.0.0.1:1", natsconn.Auth{CredsFile: "a", NkeySeedFile: "b"}
		}, "--nats.creds-file and --nats.nkey-seed-file"},
		{"admin creds and seed", func(o *Options) {
			o.NATS.URL, o.Admin.NATSAuth = "nats://127.0.0.1:1", natsconn.Auth{CredsFile: "a", NkeySeedFile: "b"}
		}, "--admin.nats-creds-file and --admin.nats-nkey-seed-file"},
		{"nats half client cert", func(o *Options) {
			o.NATS.URL, o.NATS.Auth = "nats://127.0.0.1:1", natsconn.Auth{TLSCertFile: "c.pem"}
		}, "--nats.tls-cert-file and --nats.tls-key-file"},
		{"nats seed without nats", func(o *Options) { o.NATS.Auth = natsconn.Auth{NkeySeedFile: "b"} }, "--nats.url"},
		{"admin seed without nats", func(o *Options) { o.Admin.NATSAuth = natsconn.Auth{NkeySeedFile: "b"} }, "--nats.url"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := DefaultOptions()
			o.Rules.File, o.Logger = "testdata/rules.yml", quietLogger()
			tt.mutate(&o)
			before := fmt.Sprintf("%+v", o)
			_, err := New(o)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("New = %v, want an error naming %s", err, tt.want)
			}
			if after := fmt.Sprintf("%+v", o); after != before {
				t.Fatalf("New changed its options")
			}
		})
	}
}

// TestProfiling: /debug/pprof/ is served only with --http.pprof.
func TestProfiling(t *testing.T) {
	for _, on := range []bool{false, true} {
		d := startDaemon(t, nil, func(o *Options) { o.Server.Profiling = on })
		for path, want := range map[string]string{"/debug/pprof/": "goroutine", "/debug/pprof/heap?debug=1": "heap profile"} {
			resp, err := http.Get("http://" + d.HTTPAddr() + path)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			served := resp.StatusCode == http.StatusOK && strings.Contains(string(body), want)
			if served != on {
				t.Errorf("--http.pprof=%v: GET %s: %d, served %v", on, path, resp.StatusCode, served)
			}
		}
	}
}
