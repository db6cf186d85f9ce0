package soak

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/limiterd/limiterd/internal/natsauth"
	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/internal/wanproxy"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// regions of the soak, as in the reference deployment.
var regions = []string{"us-east", "eu-west", "ap-south"}

// natsServers is the number of nats-server processes per region; the
// streams have as many replicas.
const natsServers = 3

// stack is the three regions: per region a Redis Cluster of three
// primaries with a replica each, a NATS cluster of a supercluster, and one
// limiterd and one reconciler, each a process of its own.
type stack struct {
	t        *testing.T
	dir      string
	authDir  string
	interval time.Duration
	// maxDefer is the limiterds' --gossip.max-defer.
	maxDefer time.Duration
	// wan is the one-way delay between each two regions, on their NATS
	// gateways and on the links their limiterds forward checks over.
	wan   wan
	super *natstest.Supercluster
	// limAddrs are the limiterds' gRPC addresses, by region.
	limAddrs map[string]string
	regions  map[string]*regionStack
}

type regionStack struct {
	name    string
	redis   *redistest.Cluster
	rc      *redis.ClusterClient
	lim     *proc
	rec     *proc
	limHTTP string
	client  limiterv1.LimiterClient
}

// proc is a daemon run as its own OS process, on fixed addresses so that a
// restart takes the same ones. kill is SIGKILL, by its pid.
type proc struct {
	name     string
	bin      string
	args     []string
	httpAddr string
	logPath  string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

func (p *proc) start() error {
	out, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "=== start %s\n", time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		out.Close()
		return err
	}
	done := make(chan struct{})
	go func() {
		cmd.Wait()
		out.Close()
		close(done)
	}()
	p.mu.Lock()
	p.cmd, p.done = cmd, done
	p.mu.Unlock()
	client := &http.Client{Timeout: time.Second}
	for deadline := time.Now().Add(30 * time.Second); ; {
		if resp, err := client.Get("http://" + p.httpAddr + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-done:
			return fmt.Errorf("%s exited before it was ready:\n%s", p.name, tail(p.logPath))
		default:
		}
		if time.Now().After(deadline) {
			p.kill()
			return fmt.Errorf("%s not ready after 30 s:\n%s", p.name, tail(p.logPath))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// running reports whether the process was started and not ended by kill
// or stop.
func (p *proc) running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd != nil
}

// kill ends the process with SIGKILL and waits for it; a stopped process
// is left alone.
func (p *proc) kill() {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.cmd = nil
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-done
}

// stop ends the process with SIGTERM (SIGKILL after 15 s).
func (p *proc) stop() {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.cmd = nil
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

func tail(path string) string {
	data, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return strings.Join(lines, "\n")
}

var bins struct {
	once                 sync.Once
	limiterd, reconciler string
	err                  error
}

// binaries builds cmd/limiterd and cmd/reconciler once per test binary,
// without the race detector: the daemons as users run them.
func binaries(t *testing.T) (limiterd, reconciler string) {
	t.Helper()
	bins.once.Do(func() {
		dir, err := os.MkdirTemp("", "soak-bin")
		if err != nil {
			bins.err = err
			return
		}
		out, err := exec.Command("go", "build", "-o", dir+"/", "../../cmd/limiterd", "../../cmd/reconciler").CombinedOutput()
		if err != nil {
			bins.err = fmt.Errorf("go build: %w\n%s", err, out)
		}
		bins.limiterd, bins.reconciler = filepath.Join(dir, "limiterd"), filepath.Join(dir, "reconciler")
	})
	if bins.err != nil {
		t.Fatal(bins.err)
	}
	return bins.limiterd, bins.reconciler
}

// newStack starts the three regions with rulesYAML, the regions delays
// apart, and waits until every daemon is ready.
func newStack(t *testing.T, rulesYAML string, interval, maxDefer time.Duration, delays wan) *stack {
	limBin, recBin := binaries(t)
	dir := *flagDir
	if dir == "" {
		dir = t.TempDir()
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	s := &stack{t: t, dir: dir, interval: interval, maxDefer: maxDefer, wan: delays, regions: map[string]*regionStack{}}
	s.authDir = filepath.Join(s.dir, "auth")
	ids, err := natsauth.Write(s.authDir, regions)
	if err != nil {
		t.Fatal(err)
	}
	ids = append(ids, opsIdentity(t, s.authDir))

	var wg sync.WaitGroup
	clusters := make([]*redistest.Cluster, len(regions))
	wg.Go(func() {
		began := time.Now()
		s.super = natstest.NewSupercluster(t, regions, natsServers, natstest.Config(natsauth.Config(ids)))
		t.Logf("NATS supercluster of %d x %d servers in %v", len(regions), natsServers, time.Since(began).Round(10*time.Millisecond))
	})
	// natstest and redistest fail the test from these goroutines with
	// Fatalf, which ends only the goroutine: the checks below catch it.
	for i := range regions {
		clusters[i] = redistest.NewCluster(t, 3, 1)
	}
	wg.Wait()
	if t.Failed() || s.super == nil {
		t.FailNow()
	}
	for i, a := range regions {
		for _, b := range regions[i+1:] {
			s.super.SetDelay(a, b, delays.delay(a, b))
		}
	}
	write(t, s.dir, "rules.yml", rulesYAML)
	addrs := map[string]string{}
	for _, name := range regions {
		addrs[name] = testenv.FreeAddr(t)
	}
	write(t, s.dir, "topology.yml", topology(addrs))
	s.limAddrs = addrs
	for _, src := range regions {
		if err := s.writeTopology(src, 0, time.Time{}); err != nil {
			t.Fatal(err)
		}
	}
	secret := testenv.SecretFile(t)
	for i, name := range regions {
		c := clusters[i]
		rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRetries: 5, DialTimeout: time.Second})
		t.Cleanup(func() { rc.Close() })
		r := &regionStack{name: name, redis: c, rc: rc, limHTTP: testenv.FreeAddr(t)}
		redisAddrs := strings.Join(c.Addrs(), ",")
		args := []string{
			"--grpc.listen-address", addrs[name], "--http.listen-address", r.limHTTP,
			"--rules.file", filepath.Join(s.dir, "rules.yml"), "--redis.addrs", redisAddrs,
			"--region", name, "--region.topology-file", filepath.Join(s.dir, "topology-"+name+".yml"),
			"--region.peer-secret-file", secret,
			"--nats.url", s.super.URL(name), "--nats.nkey-seed-file", natsauth.SeedFile(s.authDir, "limiterd-"+name),
			"--gossip.interval", interval.String(), "--gossip.max-defer", maxDefer.String(), "--gossip.spool-dir", filepath.Join(s.dir, "spool-"+name),
			"--instance", "limiterd-" + name, "--log.level", "warn",
		}
		if i == 0 {
			args = append(args, "--admin.nats-nkey-seed-file", natsauth.SeedFile(s.authDir, "admin"))
		}
		r.lim = &proc{name: "limiterd-" + name, bin: limBin, args: args, httpAddr: r.limHTTP,
			logPath: filepath.Join(s.dir, "limiterd-"+name+".log")}
		recHTTP := testenv.FreeAddr(t)
		r.rec = &proc{name: "reconciler-" + name, bin: recBin, httpAddr: recHTTP,
			logPath: filepath.Join(s.dir, "reconciler-"+name+".log"), args: []string{
				"--region", name, "--region.topology-file", filepath.Join(s.dir, "topology.yml"),
				"--rules.file", filepath.Join(s.dir, "rules.yml"),
				"--nats.url", s.super.URL(name), "--nats.nkey-seed-file", natsauth.SeedFile(s.authDir, "reconciler-"+name),
				"--redis.addrs", redisAddrs, "--gossip.interval", interval.String(), "--gossip.ack-wait", "1s",
				"--stream.replicas", fmt.Sprint(min(natsServers, 3)), "--stream.max-bytes", fmt.Sprint(64 << 20),
				"--http.listen-address", recHTTP, "--log.level", "warn",
			}}
		s.regions[name] = r
	}
	// Reconcilers first, at once: they make the streams the limiterds
	// publish to and the others source.
	for _, name := range regions {
		t.Cleanup(s.regions[name].rec.stop)
	}
	errs := make([]error, len(regions))
	for i, name := range regions {
		wg.Go(func() { errs[i] = s.regions[name].rec.start() })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range regions {
		r := s.regions[name]
		t.Cleanup(r.lim.stop)
		if err := r.lim.start(); err != nil {
			t.Fatal(err)
		}
		// The soak's clients dial a restarted limiterd again within a
		// second: gRPC's default backoff (up to 2 minutes) would count
		// the client's own wait as the daemon's outage.
		cc, err := grpc.NewClient(addrs[name], grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithConnectParams(grpc.ConnectParams{MinConnectTimeout: time.Second,
				Backoff: backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second}}))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		r.client = limiterv1.NewLimiterClient(cc)
	}
	s.warmUp()
	return s
}

// warmUp checks one ledger key in each region and waits until every other
// region has applied it: an inbound stream made before another region's
// spends stream finds it only at nats-server's next retry of the source
// (10 s times the failures so far, up to 2 minutes), and the soak starts
// once every region hears every other. The three checks go first, then
// the waits: a ledger spend is far under its budget, so each limiterd
// holds it for --gossip.max-defer (10 s) before it publishes it, and
// checking one region after another's spends were applied took three
// times that.
func (s *stack) warmUp() {
	t := s.t
	began := time.Now()
	key := func(src string) string { return "probe-" + src + "-warmup" }
	for _, src := range regions {
		resp, err := s.check(context.Background(), src, ruleIDs[ruleLedger], key(src), 1)
		if err != nil || !resp.GetAllowed() {
			t.Fatalf("warm-up check in %s: %v, %v", src, resp, err)
		}
	}
	for _, src := range regions {
		for _, dst := range regions {
			if dst == src {
				continue
			}
			for s.regions[dst].rc.Exists(context.Background(), redisstore.Key(ruleIDs[ruleLedger], key(src))).Val() != 1 {
				if time.Since(began) > 3*time.Minute {
					t.Fatalf("warm-up: %s has not applied %s's spend after 3 minutes", dst, src)
				}
				time.Sleep(100 * time.Millisecond)
			}
		}
	}
	t.Logf("warm-up: every region applies every other's spends, %v after the daemons were ready", time.Since(began).Round(100*time.Millisecond))
}

// opsIdentity is the soak's own operator, with every permission: it reads
// the streams for the audit (and, in the broken run, publishes a replay).
func opsIdentity(t *testing.T, dir string) natsauth.Identity {
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

// ops connects to region's NATS servers as the soak's operator.
func (s *stack) ops(region string) (*nats.Conn, error) {
	a := natsconn.Auth{NkeySeedFile: natsauth.SeedFile(s.authDir, "ops")}
	opts, err := a.Options(nil)
	if err != nil {
		return nil, err
	}
	opts = append(opts, nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}), natsconn.Inbox("ops"))
	return nats.Connect(s.super.URL(region), opts...)
}

// scrape returns the exposition text of a daemon's /metrics, "" when it
// does not answer.
func scrape(httpAddr string) string {
	client := &http.Client{Timeout: 2 * time.Second}
	resp, err := client.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return string(body)
}

// check asks region's limiterd.
func (s *stack) check(ctx context.Context, region, rule, key string, cost float64) (*limiterv1.CheckResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return s.regions[region].client.Check(ctx, &limiterv1.CheckRequest{RuleId: rule, Key: key, Cost: cost})
}

// writeTopology writes src's limiterd its topology file of generation
// gen, in force at at (the zero time: at once). It reaches each other
// region through a new link of the pair's delay, whose end the file
// names: a new generation changes every other region's address.
func (s *stack) writeTopology(src string, gen int, at time.Time) error {
	via := map[string]string{}
	for _, dst := range regions {
		via[dst] = s.limAddrs[dst]
		if dst == src {
			continue
		}
		d := s.wan.delay(src, dst)
		p, err := wanproxy.Listen("127.0.0.1:0", s.limAddrs[dst], wanproxy.NewLink(wanproxy.Shape{Delay: d}, wanproxy.Shape{Delay: d}))
		if err != nil {
			return err
		}
		s.t.Cleanup(func() { p.Close() })
		via[dst] = p.Addr()
	}
	head := ""
	if gen > 0 {
		head = fmt.Sprintf("generation: %d\neffective_at: %s\n", gen, at.UTC().Format(time.RFC3339Nano))
	}
	// Written whole, then renamed: the watcher never reads half a file.
	tmp := filepath.Join(s.dir, ".topology-"+src+".yml")
	if err := os.WriteFile(tmp, []byte(head+topology(via)), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(s.dir, "topology-"+src+".yml"))
}

// topology is a topology file of the soak's regions at addrs.
func topology(addrs map[string]string) string {
	var b strings.Builder
	b.WriteString("regions:\n")
	for _, name := range regions {
		fmt.Fprintf(&b, "  - name: %s\n    limiter_address: %s\n", name, addrs[name])
	}
	return b.String()
}

func write(t *testing.T, dir, name, content string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestMain removes the daemons' binaries when the tests end.
func TestMain(m *testing.M) {
	code := m.Run()
	if bins.limiterd != "" {
		os.RemoveAll(filepath.Dir(bins.limiterd))
	}
	os.Exit(code)
}
