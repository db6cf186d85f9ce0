package scale

import (
	"context"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/spendpub"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// The one rule of the model: 100 a minute with a burst of 100, the
// design's long tail (a client spending 1 of a capacity of 100 now and
// then), with the default accuracy budget.
const (
	ruleID   = "api"
	capacity = 100.0
	refill   = 100.0 / 60
	budget   = rules.DefaultMaxOvershoot * capacity
)

var rulesYAML = fmt.Sprintf("rules:\n  - id: %s\n    capacity: %v\n    refill_per_second: %v\n", ruleID, capacity, refill)

// region is one region of the model: its Redis Cluster, its reconciler
// process, its synthetic publishers and what was seen of them.
type region struct {
	name    string
	cluster *redistest.Cluster
	nodes   []*redis.Client
	rec     *testenv.Process
	recHTTP string
	nc      *nats.Conn
	pubs    []*spendpub.Publisher
	regs    []*prometheus.Registry
	checks  atomic.Int64
	// rate paces the publishers' entries: the rule's refill, or 0 with
	// -scale.paced=false.
	rate float64

	// unpub[key][i] is what publisher i admitted of key and has not
	// published yet, from the checks given to it and the messages seen on
	// the local subject; heldMax the most of one key, over the region's
	// publishers, seen while measuring, and overBudget the checks after
	// which that sum was above the budget.
	mu         sync.Mutex
	unpub      map[string][]float64
	measuring  bool
	heldMax    float64
	overBudget int64
	seenChecks int64
}

// snapshot is one region's counters at one instant.
type snapshot struct {
	at                  time.Time
	redis               redisStats
	recCPU, natsCPU     float64
	streamMsgs, streamB float64
	rec                 recMetrics
	checks, entries     float64
	messages            map[string]float64
}

// model is a run of the scale model.
type model struct {
	t     *testing.T
	cfg   config
	dir   string
	names []string
	super *natstest.Supercluster
	reg   map[string]*region
	// stops end each region's publishers.
	stops []func()
}

// TestScale runs the scale model with the -scale.* knobs (the defaults
// are a smoke run of a few seconds) and logs the report; it fails when a
// region did not apply exactly what the others published.
//
//	make scale REGIONS=3 KEYS=100000 RATE=2000 DURATION=20s
func TestScale(t *testing.T) {
	cfg := configFromFlags()
	if err := cfg.validate(); err != nil {
		t.Fatal(err)
	}
	m := newModel(t, cfg)
	idle := m.idleRedisCPU()
	t.Logf("idle Redis CPU per region: %v ms/s", idle)

	ctx, stopTraffic := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i, name := range m.names {
		wg.Go(func() { m.traffic(ctx, m.reg[name], uint64(i)) })
	}
	time.Sleep(cfg.warmup)
	before := m.snapshots()
	for _, r := range m.reg {
		r.mu.Lock()
		r.measuring = true
		r.mu.Unlock()
	}
	time.Sleep(cfg.duration)
	after := m.snapshots()
	for _, r := range m.reg {
		r.mu.Lock()
		r.measuring = false
		r.mu.Unlock()
	}
	stopTraffic()
	wg.Wait()
	m.stopPublishers()
	applied := m.waitApplied()

	perCheck := m.checkCost()
	m.report(before, after, idle, perCheck)
	if applied != nil {
		t.Fatal(applied)
	}
}

func newModel(t *testing.T, cfg config) *model {
	bin := reconcilerBinary(t)
	m := &model{t: t, cfg: cfg, dir: t.TempDir(), names: regionNames(cfg.regions), reg: map[string]*region{}}
	began := time.Now()
	m.super = natstest.NewSupercluster(t, m.names, 1)
	delays, err := wanDelays(cfg.wan, m.names)
	if err != nil {
		t.Fatal(err)
	}
	for p, d := range delays {
		m.super.SetDelay(p[0], p[1], d)
	}
	for _, name := range m.names {
		c := redistest.NewCluster(t, cfg.primaries, 0)
		r := &region{name: name, cluster: c, recHTTP: testenv.FreeAddr(t), unpub: map[string][]float64{}}
		if cfg.paced {
			r.rate = refill
		}
		for _, n := range c.Nodes() {
			rc := redis.NewClient(&redis.Options{Addr: n.Addr()})
			t.Cleanup(func() { rc.Close() })
			r.nodes = append(r.nodes, rc)
		}
		m.reg[name] = r
	}
	t.Logf("%d regions: NATS and Redis up in %v", len(m.names), time.Since(began).Round(100*time.Millisecond))

	write(t, m.dir, "rules.yml", rulesYAML)
	var topo strings.Builder
	topo.WriteString("regions:\n")
	for _, name := range m.names {
		// No limiterd: the reconcilers read the regions, not the address.
		fmt.Fprintf(&topo, "  - name: %s\n    limiter_address: 127.0.0.1:1\n", name)
	}
	write(t, m.dir, "topology.yml", topo.String())
	for _, name := range m.names {
		m.startReconciler(bin, m.reg[name])
	}
	for _, name := range m.names {
		m.waitReady(m.reg[name])
	}
	for _, name := range m.names {
		m.startPublishers(m.reg[name])
	}
	m.waitFlowing()
	t.Logf("spends flowing between every two regions %v after the start", time.Since(began).Round(100*time.Millisecond))
	return m
}

var bins struct {
	once sync.Once
	dir  string
	err  error
}

// reconcilerBinary builds cmd/reconciler once per test binary.
func reconcilerBinary(t *testing.T) string {
	t.Helper()
	bins.once.Do(func() {
		if bins.dir, bins.err = os.MkdirTemp("", "scale-bin"); bins.err != nil {
			return
		}
		goBin := os.Getenv("GO")
		if goBin == "" {
			goBin = "go"
		}
		if out, err := exec.Command(goBin, "build", "-o", bins.dir+"/", "../../cmd/reconciler").CombinedOutput(); err != nil {
			bins.err = fmt.Errorf("go build ./cmd/reconciler: %w\n%s", err, out)
		}
	})
	if bins.err != nil {
		t.Fatal(bins.err)
	}
	return filepath.Join(bins.dir, "reconciler")
}

func TestMain(m *testing.M) {
	code := m.Run()
	if bins.dir != "" {
		os.RemoveAll(bins.dir)
	}
	os.Exit(code)
}

func write(t *testing.T, dir, name, content string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// startReconciler runs region's reconciler as a process of its own, so
// that its CPU is its own; it is stopped with SIGTERM when the test ends.
func (m *model) startReconciler(bin string, r *region) {
	t := m.t
	args := []string{
		"--region", r.name, "--region.topology-file", filepath.Join(m.dir, "topology.yml"),
		"--rules.file", filepath.Join(m.dir, "rules.yml"), "--nats.url", m.super.URL(r.name),
		"--redis.addrs", strings.Join(r.cluster.Addrs(), ","), "--gossip.interval", m.cfg.interval.String(),
		"--stream.max-bytes", fmt.Sprint(64 << 20), "--http.listen-address", r.recHTTP, "--log.level", "warn",
	}
	out := filepath.Join(m.dir, "reconciler-"+r.name+".log")
	p, err := testenv.StartProcess(m.dir, out, bin, args...)
	if err != nil {
		t.Fatal(err)
	}
	r.rec = p
	t.Cleanup(func() {
		_ = p.Signal(syscall.SIGTERM)
		select {
		case <-p.Done():
		case <-time.After(15 * time.Second):
			p.Kill()
		}
	})
}

func (m *model) waitReady(r *region) {
	t := m.t
	// Minutes on a busy machine: ten regions' reconcilers make their
	// consumers at once, each a JetStream API call.
	deadline := time.Now().Add(3 * time.Minute)
	for {
		resp, err := http.Get("http://" + r.recHTTP + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		select {
		case <-r.rec.Done():
			t.Fatalf("reconciler of %s exited: %v\n%s", r.name, r.rec.Err(), testenv.TailFiles(filepath.Join(m.dir, "reconciler-"+r.name+".log")))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("reconciler of %s not ready after 3 minutes\n%s", r.name, testenv.TailFiles(filepath.Join(m.dir, "reconciler-"+r.name+".log")))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// startPublishers starts region's synthetic limiterd fleet: spendpub
// publishers on one NATS connection, and a subscription to the local
// subject that takes what they publish off the unpublished sums.
func (m *model) startPublishers(r *region) {
	t := m.t
	nc, err := nats.Connect(m.super.URL(r.name), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	r.nc = nc
	if _, err := nc.Subscribe(gossip.LocalSubject(r.name), func(msg *nats.Msg) { r.seen(msg.Data) }); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i := range m.cfg.publishers {
		reg := prometheus.NewRegistry()
		// Instance names unique across the regions, as limiterd's are
		// (they end in the start time): the relay keeps the flush's
		// message id, and an inbound stream drops a second message of one
		// id, whichever region it came from.
		p, err := spendpub.New(nc, r.name, r.name+"-gw"+strconv.Itoa(i), m.cfg.interval, m.cfg.maxDefer, "", log, reg)
		if err != nil {
			t.Fatal(err)
		}
		r.pubs, r.regs = append(r.pubs, p), append(r.regs, reg)
		wg.Go(func() { p.Run(ctx) })
	}
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			wg.Wait()
		}
	}
	m.stops = append(m.stops, stop)
	t.Cleanup(stop)
}

// seen takes a published message's entries off the unpublished sums.
func (r *region) seen(data []byte) {
	b, err := gossip.Decode(data, gossip.DefaultMaxMessageBytes)
	if err != nil {
		return
	}
	i, err := strconv.Atoi(strings.TrimPrefix(b.GetInstance(), r.name+"-gw"))
	if err != nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range b.GetSpends() {
		if u := r.unpub[s.GetKey()]; u != nil && i < len(u) {
			u[i] -= s.GetCost()
		}
	}
}

// check is one admitted check of key given to publisher i, which holds
// share of the key's budget.
func (r *region) check(key string, i, publishers int, share float64) {
	r.mu.Lock()
	u := r.unpub[key]
	if u == nil {
		u = make([]float64, publishers)
		r.unpub[key] = u
	}
	u[i]++
	if r.measuring {
		sum := 0.0
		for _, v := range u {
			sum += v
		}
		r.heldMax = max(r.heldMax, sum)
		if sum > budget+1e-9 {
			r.overBudget++
		}
		r.seenChecks++
	}
	r.mu.Unlock()
	r.pubs[i].Accumulator().AddPaced(ruleID, key, 1, budget*share, r.rate, time.Now().UnixMicro())
	r.checks.Add(1)
}

// traffic makes the region's admitted checks at the configured rate, in
// ticks of 10 ms, clients drawn from the Zipf population, each check given
// to one of the region's publishers at random, holding its share of the
// budget as limiterd does, or with affinity to the publisher its key
// hashes to, holding the whole budget, until ctx ends.
func (m *model) traffic(ctx context.Context, r *region, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 0x5ca1e))
	zipf := newZipf(rng, m.cfg.zipf, m.cfg.keys)
	const tick = 10 * time.Millisecond
	tk := time.NewTicker(tick)
	defer tk.Stop()
	start := time.Now()
	done := 0
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tk.C:
			due := int(float64(m.cfg.rate) * now.Sub(start).Seconds())
			for ; done < due; done++ {
				key := m.cfg.client(seed, zipf())
				n := len(r.pubs)
				if m.cfg.affinity {
					r.check(key, int(fnv32(key)%uint32(n)), n, 1)
				} else {
					r.check(key, rng.IntN(n), n, 1/float64(n))
				}
			}
		}
	}
}

// fnv32 is the FNV-1a hash of key: a gateway's choice of instance by key.
func fnv32(key string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(key))
	return h.Sum32()
}

// newZipf draws ranks in [0, n) with P(k) ∝ 1/(k+1)^s; s 0 draws every
// rank alike.
func newZipf(rng *rand.Rand, s float64, n int) func() uint64 {
	if s == 0 {
		return func() uint64 { return rng.Uint64N(uint64(n)) }
	}
	z := rand.NewZipf(rng, s, 1, uint64(n-1))
	return z.Uint64
}

// waitFlowing publishes a spend at its budget (out within the tick) in
// every region every 500 ms until each region has applied one of every
// other's, as the soak's warm-up does: the servers set up a source whose
// spends stream was made late after a back-off.
func (m *model) waitFlowing() {
	t := m.t
	ctx := context.Background()
	start := time.Now()
	for i := 0; ; i++ {
		for _, from := range m.names {
			m.reg[from].pubs[0].Accumulator().Add(ruleID, fmt.Sprintf("flowing-%s-%d", from, i), budget, budget, time.Now().UnixMicro())
		}
		missing := ""
		for deadline := time.Now().Add(500 * time.Millisecond); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			missing = ""
			for _, to := range m.names {
				got, err := scrape(ctx, m.reg[to].recHTTP)
				if err != nil {
					t.Fatal(err)
				}
				for _, from := range m.names {
					if from != to && got.from[from] == 0 && missing == "" {
						missing = from + " in " + to
					}
				}
			}
			if missing == "" {
				return
			}
		}
		if time.Since(start) > 2*time.Minute {
			t.Fatalf("no spend of %s applied after 2 minutes\n%s\n%s", missing, m.streams(strings.Fields(missing)[2]), m.logs())
		}
	}
}

// streams says what region's inbound stream holds from each source, and
// where its apply consumers are.
func (m *model) streams(name string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	js, err := jetstream.New(m.reg[name].nc)
	if err != nil {
		return err.Error()
	}
	st, err := js.Stream(ctx, gossip.InStream(name))
	if err != nil {
		return err.Error()
	}
	info := st.CachedInfo()
	var b strings.Builder
	for _, other := range m.names {
		for _, sn := range []string{gossip.LocalStream(other), gossip.RegionStream(other)} {
			if o, err := js.Stream(ctx, sn); err == nil {
				fmt.Fprintf(&b, "%s: %d messages\n", sn, o.CachedInfo().State.Msgs)
			} else {
				fmt.Fprintf(&b, "%s: %v\n", sn, err)
			}
		}
	}
	fmt.Fprintf(&b, "%s: %d messages, last %d\n", gossip.InStream(name), info.State.Msgs, info.State.LastSeq)
	for _, src := range info.Sources {
		fmt.Fprintf(&b, "  source %s: lag %d, active %v, error %v\n", src.Name, src.Lag, src.Active, src.Error)
	}
	for _, src := range info.Config.Sources {
		fmt.Fprintf(&b, "  configured source %s: filter %q, start seq %d, start time %v, transforms %v, external %v\n", src.Name, src.FilterSubject, src.OptStartSeq, src.OptStartTime, src.SubjectTransforms, src.External)
	}
	for c := range st.ListConsumers(ctx).Info() {
		fmt.Fprintf(&b, "  consumer %s: delivered %d, ack floor %d, pending %d, waiting %d\n", c.Name, c.Delivered.Stream, c.AckFloor.Stream, c.NumPending, c.NumWaiting)
	}
	return b.String()
}

// logs are the last lines of every reconciler's log.
func (m *model) logs() string {
	var paths []string
	for _, name := range m.names {
		paths = append(paths, filepath.Join(m.dir, "reconciler-"+name+".log"))
	}
	return testenv.TailFiles(paths...)
}

// idleRedisCPU is each region's Redis CPU per second with nothing to do
// (the servers' own timers), over one second, in ms/s.
func (m *model) idleRedisCPU() map[string]float64 {
	ctx := context.Background()
	a := map[string]redisStats{}
	for _, name := range m.names {
		a[name] = m.redisOf(ctx, m.reg[name])
	}
	start := time.Now()
	time.Sleep(time.Second)
	out := map[string]float64{}
	for _, name := range m.names {
		d := m.redisOf(ctx, m.reg[name]).minus(a[name])
		out[name] = math.Round(d.cpu/time.Since(start).Seconds()*1e4) / 10
	}
	return out
}

func (m *model) redisOf(ctx context.Context, r *region) redisStats {
	var sum redisStats
	for _, c := range r.nodes {
		st, err := readRedis(ctx, c)
		if err != nil {
			m.t.Fatalf("%s: INFO: %v", r.name, err)
		}
		sum.cpu += st.cpu
		sum.scripts += st.scripts
		sum.scriptSecs += st.scriptSecs
	}
	return sum
}

func (m *model) snapshots() map[string]snapshot {
	ctx := context.Background()
	out := map[string]snapshot{}
	for _, name := range m.names {
		r := m.reg[name]
		s := snapshot{at: time.Now(), redis: m.redisOf(ctx, r), messages: map[string]float64{}}
		var err error
		if s.recCPU, err = procCPU(r.rec.Pid()); err != nil {
			m.t.Fatal(err)
		}
		if srv := m.super.Servers(name); len(srv) > 0 {
			if s.natsCPU, err = procCPU(srv[0].Pid()); err != nil {
				m.t.Fatal(err)
			}
		}
		js, err := jetstream.New(r.nc)
		if err != nil {
			m.t.Fatal(err)
		}
		st, err := js.Stream(ctx, gossip.RegionStream(name))
		if err != nil {
			m.t.Fatalf("%s: spends stream: %v", name, err)
		}
		s.streamMsgs, s.streamB = float64(st.CachedInfo().State.LastSeq), float64(st.CachedInfo().State.Bytes)
		if s.rec, err = scrape(ctx, r.recHTTP); err != nil {
			m.t.Fatal(err)
		}
		s.checks = float64(r.checks.Load())
		for _, reg := range r.regs {
			s.entries += testenv.MetricValue(m.t, reg, "limiter_spends_flushed_total")
			mfs, err := reg.Gather()
			if err != nil {
				m.t.Fatal(err)
			}
			for _, mf := range mfs {
				if mf.GetName() != "limiter_spend_messages_total" {
					continue
				}
				for _, mm := range mf.GetMetric() {
					for _, l := range mm.GetLabel() {
						if l.GetName() == "trigger" {
							s.messages[l.GetValue()] += mm.GetCounter().GetValue()
						}
					}
				}
			}
		}
		out[name] = s
	}
	return out
}

// stopPublishers ends every publisher's Run: each publishes what it
// still holds.
func (m *model) stopPublishers() {
	for _, stop := range m.stops {
		stop()
	}
}

// waitApplied waits until each region has handled, exactly, every client
// of the messages the other regions relayed (a client debited, or found
// refilled). It returns an error when a region handled more, or when a
// minute passes without a region's count moving.
func (m *model) waitApplied() error {
	t := m.t
	ctx := context.Background()
	// Each region's relay first relays every entry its publishers flushed;
	// the clients of the messages it merged them into are then what every
	// other region debits or finds refilled.
	clients := map[string]float64{}
	total := 0.0
	for _, name := range m.names {
		flushed := 0.0
		for _, reg := range m.reg[name].regs {
			flushed += testenv.MetricValue(t, reg, "limiter_spends_flushed_total")
		}
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(100 * time.Millisecond) {
			got, err := scrape(ctx, m.reg[name].recHTTP)
			if err != nil {
				return err
			}
			if got.relayed == flushed {
				clients[name] = got.relayClients
				break
			}
			if got.relayed > flushed || time.Now().After(deadline) {
				return fmt.Errorf("%s relayed %v spend entries of the %v its publishers flushed\n%s", name, got.relayed, flushed, m.streams(name))
			}
		}
		total += clients[name]
	}
	for _, name := range m.names {
		want := total - clients[name]
		last, moved := -1.0, time.Now()
		for {
			got, err := scrape(ctx, m.reg[name].recHTTP)
			if err != nil {
				return err
			}
			handled := got.applied + got.refilled
			switch {
			case handled == want:
			case handled > want:
				return fmt.Errorf("%s debited %v clients and found %v refilled, more than the %v clients the other regions relayed", name, got.applied, got.refilled, want)
			case handled != last:
				last, moved = handled, time.Now()
				time.Sleep(100 * time.Millisecond)
				continue
			case time.Since(moved) > time.Minute:
				return fmt.Errorf("%s debited %v clients and found %v refilled of the %v clients the other regions relayed, and no more for a minute: by source %v of %v\n%s", name, got.applied, got.refilled, want, got.from, clients, m.streams(name))
			default:
				time.Sleep(100 * time.Millisecond)
				continue
			}
			break
		}
	}
	return nil
}

// checkCost is the Redis CPU one check costs the first region's Redis:
// the single-check token bucket script through redisstore, from 64
// concurrent callers (pipelined as limiterd's are), over Zipf clients of
// the same population, in µs per check.
func (m *model) checkCost() float64 {
	t := m.t
	ctx := context.Background()
	r := m.reg[m.names[0]]
	// Deadlines of a busy test machine, not of a gateway's 5 ms: a check
	// that timed out would be counted without its cost being known.
	st, err := redisstore.New(ctx, redisstore.Options{Addrs: r.cluster.Addrs(), Timeout: time.Second, MaxQueueWait: time.Second}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	lim := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: capacity, RefillPerSecond: refill}
	// Connected and the script loaded before the measurement.
	for deadline := time.Now().Add(30 * time.Second); ; {
		if _, err := st.Take(ctx, bucket.Request{Rule: ruleID, Key: "warm", Limit: lim, Cost: 1}); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("check on %s's Redis: %v", r.name, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	before := m.redisOf(ctx, r)
	var next atomic.Int64
	var failed atomic.Int64
	var wg sync.WaitGroup
	for w := range 64 {
		wg.Go(func() {
			zipf := newZipf(rand.New(rand.NewPCG(uint64(w), 7)), m.cfg.zipf, m.cfg.keys)
			for next.Add(1) <= int64(m.cfg.checkCalls) {
				if _, err := st.Take(ctx, bucket.Request{Rule: ruleID, Key: "c" + strconv.FormatUint(zipf(), 10), Limit: lim, Cost: 1}); err != nil {
					failed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	d := m.redisOf(ctx, r).minus(before)
	if n := failed.Load(); n > 0 {
		t.Fatalf("%d of %d checks failed", n, m.cfg.checkCalls)
	}
	t.Logf("checks' own cost: %d check scripts (INFO counted %v) took %.3f s of %s's Redis CPU, %.3f s of it in the scripts", m.cfg.checkCalls, d.scripts, d.cpu, r.name, d.scriptSecs)
	return d.cpu / float64(m.cfg.checkCalls) * 1e6
}

// report logs the table of the run: per region, what reconciliation cost
// over the measured window, against what its checks cost its Redis.
func (m *model) report(before, after map[string]snapshot, idle map[string]float64, checkUS float64) {
	t := m.t
	var b strings.Builder
	c := m.cfg
	fmt.Fprintf(&b, "scale model: %d regions, %d clients (Zipf %v), %d checks/s and %d publishers per region (key affinity %v), interval %v, max-defer %v, wan %s, %d Redis primaries per region, clients of one region each %v, paced %v; %v measured after %v\n",
		c.regions, c.keys, c.zipf, c.rate, c.publishers, c.affinity, c.interval, c.maxDefer, c.wan, c.primaries, c.home, c.paced, c.duration, c.warmup)
	fmt.Fprintf(&b, "a check costs Redis %.1f µs (the token bucket script, %d calls, 64 callers)\n", checkUS, c.checkCalls)
	b.WriteString("| region | checks/s | entries/s | checks per entry | debits/s applied | refilled/s | scripts/s | Redis ms/s (idle) | in scripts ms/s | checks' Redis ms/s | reconciliation / checks | at the published rate | Redis µs per client | reconciler ms/s | reconciler µs per client | NATS ms/s | msgs/s per link | bytes/s per link | lag p50 | lag p99 | held max (budgets) | checks over budget |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	var worst, totalEntries float64
	for _, name := range m.names {
		a, z := before[name], after[name]
		totalEntries += (z.entries - a.entries) / z.at.Sub(a.at).Seconds()
	}
	for _, name := range m.names {
		a, z := before[name], after[name]
		secs := z.at.Sub(a.at).Seconds()
		rate := func(x, y float64) float64 { return (y - x) / secs }
		checks := rate(a.checks, z.checks)
		entries := rate(a.entries, z.entries)
		debits := rate(a.rec.applied, z.rec.applied)
		refilled := rate(a.rec.refilled, z.rec.refilled)
		// Each client the others published is debited or found refilled.
		clients := debits + refilled
		rd := z.redis.minus(a.redis)
		redisMS := rd.cpu / secs * 1000
		reconMS := max(redisMS-idle[name], 0)
		checksMS := checks * checkUS / 1000
		ratio := reconMS / checksMS
		// What the region would spend applying every entry the others
		// published in the window, at its cost per client: the same as
		// ratio unless its reconciler fell behind.
		steady := (totalEntries - entries) * (reconMS / clients) / checksMS
		worst = max(worst, steady)
		recMS := rate(a.recCPU, z.recCPU) * 1000
		lag := lagDelta(a.rec.lag, z.rec.lag)
		r := m.reg[name]
		r.mu.Lock()
		held, over, seen := r.heldMax, r.overBudget, r.seenChecks
		r.mu.Unlock()
		fmt.Fprintf(&b, "| %s | %.0f | %.0f | %.2f | %.0f | %.0f | %.0f | %.1f (%.1f) | %.1f | %.1f | %.0f%% | %.0f%% | %.1f | %.1f | %.1f | %.1f | %.2f | %.0f | %.2f s | %.2f s | %.1f | %.3f%% |\n",
			name, checks, entries, checks/entries, debits, refilled, rd.scripts/secs, redisMS, idle[name], rd.scriptSecs/secs*1000, checksMS, ratio*100, steady*100,
			reconMS*1000/clients, recMS, recMS*1000/clients, rate(a.natsCPU, z.natsCPU)*1000,
			rate(a.streamMsgs, z.streamMsgs), rate(a.streamB, z.streamB),
			quantile(0.5, lag), quantile(0.99, lag), held/budget, 100*float64(over)/float64(max(seen, 1)))
	}
	fmt.Fprintf(&b, "messages by trigger over the run, all regions:")
	for _, trig := range []string{"interval", "budget", "full"} {
		sum := 0.0
		for _, name := range m.names {
			sum += after[name].messages[trig]
		}
		fmt.Fprintf(&b, " %s %.0f", trig, sum)
	}
	fmt.Fprintf(&b, "\nworst region: applying what the others published costs %.0f%% of its checks' Redis CPU (goal: 20%%)\n", worst*100)
	fmt.Fprintf(&b, "machine: shared; CPU figures are per unit of work (per debit, per check), from INFO cpu and /proc/PID/stat\n")
	t.Log("\n" + b.String())
}
