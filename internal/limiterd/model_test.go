package limiterd

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// The model test's rules: zero refill, so a bucket's state is what was
// spent from it, and the reference model is exact. Every /m/ check spends
// from m-user; the path adds a second rule: per API key, pinned to the
// key's home region, leased, or a sliding log.
const modelRules = `
rules:
  - id: m-user
    capacity: 20
    refill_per_second: 0.000001
    match: {path: "/m/**"}
    key_by: user
  - id: m-key
    capacity: 4
    refill_per_second: 0.000001
    match: {path: /m/multi}
    key_by: api_key
  - id: m-pin
    capacity: 5
    refill_per_second: 0.000001
    home: pinned
    match: {path: /m/pin}
    key_by: user
  - id: m-lease
    capacity: 8
    refill_per_second: 0.000001
    lease: 2
    match: {path: /m/lease}
    key_by: user
  - id: m-log
    algorithm: sliding_log
    limit: 5
    window: 1h
    match: {path: /m/log}
    key_by: user
`

var modelCapacity = map[string]int{"m-user": 20, "m-key": 4, "m-pin": 5, "m-lease": 8, "m-log": 5}

var modelPaths = map[string]string{"/m/a": "", "/m/multi": "m-key", "/m/pin": "m-pin", "/m/lease": "m-lease", "/m/log": "m-log"}

type modelBucket struct{ rule, key string }

// modelCheck is one check of the run and what it touched.
type modelCheck struct {
	user, apiKey, path string
	allowed, failed    bool
}

func (c modelCheck) buckets() []modelBucket {
	b := []modelBucket{{"m-user", "user:" + c.user}}
	switch second := modelPaths[c.path]; second {
	case "":
	case "m-key":
		b = append(b, modelBucket{second, "api_key:" + c.apiKey})
	default:
		b = append(b, modelBucket{second, "user:" + c.user})
	}
	return b
}

// modelStack is two regions: us-east (two limiterd on a cluster with
// replicas, the one that takes the traffic and the faults) and eu-west (one
// limiterd on its own cluster, the home of half the pinned keys).
type modelStack struct {
	east    *redistest.Cluster
	eastDs  []*Daemon
	west    *Daemon
	rules   string
	clients []limiterv1.LimiterClient
	// region configures a daemon of region name, listening on addr ("":
	// any port).
	region func(name, addr string) func(*Options)
}

// newModelStack starts the regions; storeTimeout is --redis.timeout (0:
// the default).
func newModelStack(t *testing.T, storeTimeout time.Duration) *modelStack {
	t.Helper()
	dir := t.TempDir()
	s := &modelStack{rules: filepath.Join(dir, "rules.yml"), east: redistest.NewCluster(t, 3, 1)}
	west := redistest.NewCluster(t, 3, 0)
	if err := os.WriteFile(s.rules, []byte(modelRules), 0o644); err != nil {
		t.Fatal(err)
	}
	eastAddr, westAddr := testenv.FreeAddr(t), testenv.FreeAddr(t)
	topo := filepath.Join(dir, "topology.yml")
	if err := os.WriteFile(topo, []byte(fmt.Sprintf("regions:\n  - name: us-east\n    limiter_address: %s\n  - name: eu-west\n    limiter_address: %s\n", eastAddr, westAddr)), 0o644); err != nil {
		t.Fatal(err)
	}
	secret := testenv.SecretFile(t)
	s.region = func(name, addr string) func(*Options) {
		return func(o *Options) {
			o.Region, o.TopologyFile, o.PeerSecretFile, o.RulesFile = name, topo, secret, s.rules
			o.RedisTimeout = storeTimeout
			o.ForwardTimeout = 10 * time.Second
			if addr != "" {
				o.GRPCAddress = addr
			}
		}
	}
	s.west = startDaemon(t, west.Addrs(), s.region("eu-west", westAddr))
	s.eastDs = []*Daemon{startDaemon(t, s.east.Addrs(), s.region("us-east", eastAddr)), startDaemon(t, s.east.Addrs(), s.region("us-east", ""))}
	for _, d := range s.eastDs {
		s.clients = append(s.clients, limiterv1.NewLimiterClient(dial(t, d.GRPCAddr())))
	}
	return s
}

// caller sends checks: a goroutine with a gRPC client, or a separate
// process that reads requests on its stdin.
type caller interface {
	check(req *limiterv1.CheckRequest) (allowed bool, err error)
}

type grpcCaller struct{ c limiterv1.LimiterClient }

func (g grpcCaller) check(req *limiterv1.CheckRequest) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	resp, err := g.c.Check(ctx, req)
	return resp.GetAllowed(), err
}

type processCaller struct {
	in  io.Writer
	out *bufio.Reader
}

func (p processCaller) check(req *limiterv1.CheckRequest) (bool, error) {
	b, err := json.Marshal(req.GetAttributes())
	if err != nil {
		return false, err
	}
	if _, err := fmt.Fprintf(p.in, "%s\n", b); err != nil {
		return false, err
	}
	line, err := p.out.ReadString('\n')
	if err != nil {
		return false, err
	}
	switch line = strings.TrimSpace(line); line {
	case "allowed":
		return true, nil
	case "limited":
		return false, nil
	}
	return false, fmt.Errorf("client process: %s", line)
}

// runModel sends n random checks of users with prefix from every caller at
// once and returns them with their verdicts. With pace > 0 each caller
// waits up to pace between two checks.
func runModel(t *testing.T, callers []caller, rng *rand.Rand, prefix string, n int, pace time.Duration) []modelCheck {
	t.Helper()
	paths := []string{"/m/a", "/m/multi", "/m/pin", "/m/lease", "/m/log"}
	checks := make([]modelCheck, n)
	for i := range checks {
		checks[i] = modelCheck{
			user:   fmt.Sprintf("%s-u%d", prefix, rng.IntN(10)),
			apiKey: fmt.Sprintf("%s-k%d", prefix, rng.IntN(4)),
			path:   paths[rng.IntN(len(paths))],
		}
	}
	next := make(chan int)
	var wg sync.WaitGroup
	for _, c := range callers {
		wg.Go(func() {
			for i := range next {
				if pace > 0 {
					time.Sleep(time.Duration(rand.Int64N(int64(pace))))
				}
				ck := &checks[i]
				allowed, err := c.check(&limiterv1.CheckRequest{Attributes: &limiterv1.Attributes{User: ck.user, ApiKey: ck.apiKey, Path: ck.path}})
				ck.allowed, ck.failed = allowed, err != nil
			}
		})
	}
	for i := range checks {
		next <- i
	}
	close(next)
	wg.Wait()
	return checks
}

// modelAdmitted counts, per bucket, the checks admitted that spent from it.
func modelAdmitted(checks []modelCheck) map[modelBucket]int {
	admitted := map[modelBucket]int{}
	for _, c := range checks {
		for _, b := range c.buckets() {
			if c.allowed {
				admitted[b] += 1
			} else if _, ok := admitted[b]; !ok {
				admitted[b] = 0
			}
		}
	}
	return admitted
}

// TestModelExactWithAHealthyStore: randomized all-or-nothing checks of
// several rules (a per-key rule, a rule pinned to the key's home region, a
// leased rule, a sliding log) from concurrent callers, two of them separate
// processes, through two limiterd instances, with a rules reload in the
// middle. With a healthy store the admissions equal the reference model:
// no bucket admits more than its capacity, every refused check had a rule
// whose bucket was exhausted, and afterwards each bucket has exactly
// capacity - admitted left (an undo never gave back more than was spent).
//
// Healthy means answering: the store timeout is 250 ms here, since this
// test alone (nine Redis servers, three limiterd under the race detector,
// eight callers) loads both cores past what the 5 ms default is for; a
// reply later than the timeout is not decided by the store, and the test
// fails saying so rather than compare it with the model.
func TestModelExactWithAHealthyStore(t *testing.T) {
	s := newModelStack(t, 250*time.Millisecond)
	var callers []caller
	for i := range 6 {
		callers = append(callers, grpcCaller{s.clients[i%2]})
	}
	for i := range 2 {
		in, out := helper(t, "attrs", "LIMITERD_ADDR="+s.eastDs[i].GRPCAddr())
		callers = append(callers, processCaller{in, out})
	}
	const runs = 3
	for run := range runs {
		seed := uint64(time.Now().UnixNano())
		rng := rand.New(rand.NewPCG(seed, uint64(run)))
		prefix := fmt.Sprintf("h%d", run)
		if run == 1 {
			// A rules change under traffic: a rule added, none changed.
			go func() {
				time.Sleep(50 * time.Millisecond)
				os.WriteFile(s.rules, []byte(modelRules+"  - id: added\n    capacity: 1\n    refill_per_second: 1\n"), 0o644)
			}()
		}
		checks := runModel(t, callers, rng, prefix, 250, 0)
		for _, d := range append(s.eastDs, s.west) {
			// Refunds to a home region run on after the answer.
			if err := d.engine.Wait(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		var uncertain, fallback float64
		for _, d := range append(s.eastDs, s.west) {
			uncertain += sumSeries(t, d, "limiter_decisions_total", "result", "uncertain_allowed")
			fallback += sumSeries(t, d, "limiter_decisions_total", "result", "fallback_allowed") +
				sumSeries(t, d, "limiter_decisions_total", "result", "fallback_limited")
		}
		if uncertain+fallback > 0 {
			t.Fatalf("run %d: %v checks answered uncertain, %v by the fallback: the store did not answer within --redis.timeout, and the model is exact only for a store that answers", run, uncertain, fallback)
		}
		admitted := modelAdmitted(checks)
		allowed := 0
		for _, c := range checks {
			if c.failed {
				t.Fatalf("run %d (seed %d): a check failed with a healthy store: %+v", run, seed, c)
			}
			if c.allowed {
				allowed++
				continue
			}
			exhausted := false
			for _, b := range c.buckets() {
				// A leased rule may refuse while another instance's lease
				// holds the rest of the bucket.
				if admitted[b] == modelCapacity[b.rule] || b.rule == "m-lease" {
					exhausted = true
				}
			}
			if !exhausted {
				t.Errorf("run %d (seed %d): check %+v refused with every bucket below its capacity: %v", run, seed, c, admittedOf(admitted, c))
			}
		}
		for b, n := range admitted {
			if n > modelCapacity[b.rule] {
				t.Errorf("run %d (seed %d): %v admitted %d, capacity %d", run, seed, b, n, modelCapacity[b.rule])
			}
		}
		// What is left: one more check of each bucket by rule id passes
		// exactly when the model has a token left. The probes go through
		// an instance started now, without a deny cache: another check's
		// undo may have given back a token after an instance remembered a
		// refusal (a refusal early, never an admission too many).
		prober := limiterv1.NewLimiterClient(dial(t, startDaemon(t, s.east.Addrs(), s.region("us-east", ""), func(o *Options) { o.DenyCacheSize = -1 }).GRPCAddr()))
		probes := 0
		for b, n := range admitted {
			if b.rule == "m-lease" {
				continue
			}
			resp, err := prober.Check(context.Background(), &limiterv1.CheckRequest{RuleId: b.rule, Key: b.key})
			if err != nil {
				t.Fatal(err)
			}
			probes++
			if want := n < modelCapacity[b.rule]; resp.GetAllowed() != want {
				t.Errorf("run %d (seed %d): %v after %d admitted of %d: probe allowed %v, want %v", run, seed, b, n, modelCapacity[b.rule], resp.GetAllowed(), want)
			}
		}
		t.Logf("run %d (seed %d): %d checks, %d allowed, %d buckets, %d probes", run, seed, len(checks), allowed, len(admitted), probes)
	}
}

func admittedOf(admitted map[modelBucket]int, c modelCheck) map[string]int {
	out := map[string]int{}
	for _, b := range c.buckets() {
		out[b.rule+"/"+b.key] = admitted[b]
	}
	return out
}

// primaries returns a client to each primary of the cluster now.
func primaries(t *testing.T, c *redistest.Cluster) []*redis.Client {
	t.Helper()
	var out []*redis.Client
	for _, a := range c.PrimaryAddrs() {
		cl := redis.NewClient(&redis.Options{Addr: a})
		t.Cleanup(func() { cl.Close() })
		out = append(out, cl)
	}
	return out
}

// TestModelBoundedUnderStoreFaults: the same workload, paced over a few
// seconds, while the store misbehaves at random: a primary paused (CLIENT
// PAUSE WRITE: scripts wait, the connection stays up) for up to 0.8 s,
// replies slower than the store timeout (repeated 15 ms pauses), and once a
// run a primary killed and failed over to its replica. No bucket admits more than the
// documented bound: its capacity in the store, plus what the fallback may
// admit (the fleet's shares of a fail-open limit add up to one capacity),
// plus the checks answered uncertain_allowed (sent, no reply in time),
// plus one per killed primary (a write acknowledged and not yet
// replicated).
func TestModelBoundedUnderStoreFaults(t *testing.T) {
	s := newModelStack(t, 0) // the default, 5 ms: the slow replies outlast it
	var callers []caller
	for i := range 6 {
		callers = append(callers, grpcCaller{s.clients[i%2]})
	}
	in, out := helper(t, "attrs", "LIMITERD_ADDR="+s.eastDs[0].GRPCAddr())
	callers = append(callers, processCaller{in, out})
	const runs = 2
	faults := map[string]int{}
	for run := range runs {
		seed := uint64(time.Now().UnixNano())
		rng := rand.New(rand.NewPCG(seed, uint64(run)))
		stop := make(chan struct{})
		var faulting sync.WaitGroup
		kills := 0
		faulting.Go(func() {
			frng := rand.New(rand.NewPCG(seed, 99))
			killAt := time.Now().Add(time.Second)
			for {
				select {
				case <-stop:
					return
				case <-time.After(time.Duration(200+frng.IntN(400)) * time.Millisecond):
				}
				ps := primaries(t, s.east)
				p := ps[frng.IntN(len(ps))]
				switch {
				case kills == 0 && time.Now().After(killAt):
					// A primary killed; its replica takes over, then it
					// comes back as a replica.
					faults["kill"]++
					kills++
					addr := p.Options().Addr
					for _, n := range s.east.Nodes() {
						if n.Addr() == addr {
							n.Stop()
							time.Sleep(3 * time.Second)
							n.Start()
						}
					}
				case frng.IntN(2) == 0:
					faults["pause"]++
					p.Do(context.Background(), "CLIENT", "PAUSE", 200+frng.IntN(600), "WRITE")
				default:
					faults["slow"]++
					for range 10 {
						p.Do(context.Background(), "CLIENT", "PAUSE", 15, "WRITE")
						time.Sleep(20 * time.Millisecond)
					}
				}
			}
		})
		checks := runModel(t, callers, rng, fmt.Sprintf("f%d", run), 1500, 20*time.Millisecond)
		close(stop)
		faulting.Wait()
		uncertain := 0.0
		for _, d := range s.eastDs {
			uncertain += sumSeries(t, d, "limiter_decisions_total", "result", "uncertain_allowed")
		}
		admitted := modelAdmitted(checks)
		worst, allowed, failed := 0, 0, 0
		for _, c := range checks {
			if c.allowed {
				allowed++
			}
			if c.failed {
				failed++
			}
		}
		for b, n := range admitted {
			bound := 2*modelCapacity[b.rule] + int(uncertain) + kills
			if n > bound {
				t.Errorf("run %d (seed %d): %v admitted %d, bound %d", run, seed, b, n, bound)
			}
			worst = max(worst, n-modelCapacity[b.rule])
		}
		t.Logf("run %d (seed %d): %d checks, %d allowed, %d failed, worst excess over capacity %d, uncertain %v, faults so far %v",
			run, seed, len(checks), allowed, failed, worst, uncertain, faults)
		s.east.WaitHealthy(t)
	}
}

// sumSeries sums a metric's series whose label has value.
func sumSeries(t *testing.T, d *Daemon, name, label, value string) float64 {
	t.Helper()
	total := 0.0
	for _, mf := range mustGather(t, d) {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					total += m.GetCounter().GetValue()
				}
			}
		}
	}
	return total
}
