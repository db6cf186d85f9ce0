package limiterd

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// The model test's rules: zero refill, so a bucket's state is what was
// spent from it, and the reference model is exact. Every /m/ check spends
// from m-user; the path adds rules: per API key, pinned to the key's home
// region, leased (two rules, one per user and one per API key, so that one
// check takes the batch of one and waits for the other's), or a sliding
// log.
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
  - id: m-lease2
    capacity: 6
    refill_per_second: 0.000001
    lease: 2
    match: {path: /m/lease}
    key_by: api_key
  - id: m-log
    algorithm: sliding_log
    limit: 5
    window: 1h
    match: {path: /m/log}
    key_by: user
`

var modelCapacity = map[string]int{"m-user": 20, "m-key": 4, "m-pin": 5, "m-lease": 8, "m-lease2": 6, "m-log": 5}

// modelPaths are the rules each path adds to m-user.
var modelPaths = map[string][]string{"/m/a": nil, "/m/multi": {"m-key"}, "/m/pin": {"m-pin"}, "/m/lease": {"m-lease", "m-lease2"}, "/m/log": {"m-log"}}

// modelLeased are the leased rules.
var modelLeased = map[string]bool{"m-lease": true, "m-lease2": true}

// modelKeyedByAPIKey are the rules keyed by API key; the others by user.
var modelKeyedByAPIKey = map[string]bool{"m-key": true, "m-lease2": true}

type modelBucket struct{ rule, key string }

// modelCheck is one check of the run and what it touched. A check whose
// caller gave up (its deadline ended first) has an unknown outcome: it
// may have been admitted.
type modelCheck struct {
	user, apiKey, path      string
	allowed, failed, gaveUp bool
	start, end              time.Time
}

// modelSeed replays a run's checks: go test -run TestModelExact -model.seed=N.
// The interleaving of the callers is not replayed, only what they send.
var modelSeed = flag.Uint64("model.seed", 0, "seed of the model tests' checks (0: from the clock)")

// newSeed is the seed of a run: -model.seed, else the clock.
func newSeed() uint64 {
	if *modelSeed != 0 {
		return *modelSeed
	}
	return uint64(time.Now().UnixNano())
}

// modelSpansClients reports whether a check of path spends from buckets that
// no one script decides together: buckets of two clients (a user's and an
// API key's), or a key pinned to another region. A refusal of such a check
// gives back, after it, what it spent meanwhile.
func modelSpansClients(path string) bool {
	return path == "/m/multi" || path == "/m/pin" || path == "/m/lease"
}

// heldMeanwhile counts the refused checks other than c that spend from b,
// span clients, and ran while c did (with undoSlack after their answer):
// each may have held one of b's tokens when c was decided, and given it
// back after.
func heldMeanwhile(checks []modelCheck, c *modelCheck, b modelBucket) int {
	n := 0
	for i := range checks {
		d := &checks[i]
		if d == c || d.allowed || d.gaveUp || !modelSpansClients(d.path) {
			continue
		}
		if d.start.After(c.end) || d.end.Add(undoSlack).Before(c.start) {
			continue
		}
		if slices.Contains(d.buckets(), b) {
			n++
		}
	}
	return n
}

// undoSlack is how long after its answer a refused check may still hold
// tokens: a pinned key's home gives back after it answers.
const undoSlack = 200 * time.Millisecond

func (c modelCheck) buckets() []modelBucket {
	b := []modelBucket{{"m-user", "user:" + c.user}}
	for _, rule := range modelPaths[c.path] {
		if modelKeyedByAPIKey[rule] {
			b = append(b, modelBucket{rule, "api_key:" + c.apiKey})
		} else {
			b = append(b, modelBucket{rule, "user:" + c.user})
		}
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
			o.Region.Name, o.Region.TopologyFile, o.Region.PeerSecretFile, o.Rules.File = name, topo, secret, s.rules
			if storeTimeout > 0 {
				o.RedisTuning.Timeout = storeTimeout
			}
			o.Region.ForwardTimeout = 10 * time.Second
			if addr != "" {
				o.Server.GRPCAddress = addr
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

// impatientCaller gives up on a check of the leased rules after a random
// deadline of up to max: its checks end in the engine's waits (a lease
// batch another check is taking, the store call) as well as before and
// after them. Its other checks wait for their answer: a check given up on
// the way to a home region may be decided by the home's fallback.
type impatientCaller struct {
	c   limiterv1.LimiterClient
	max time.Duration
}

// errGaveUp: the caller's deadline ended before the answer.
var errGaveUp = errors.New("the caller gave up")

func (g impatientCaller) check(req *limiterv1.CheckRequest) (bool, error) {
	if req.GetAttributes().GetPath() != "/m/lease" {
		return grpcCaller{g.c}.check(req)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rand.Int64N(int64(g.max)))+100*time.Microsecond)
	defer cancel()
	resp, err := g.c.Check(ctx, req)
	if st := status.Code(err); st == codes.DeadlineExceeded || st == codes.Canceled {
		return false, fmt.Errorf("%w: %w", errGaveUp, err)
	}
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
				ck.start = time.Now()
				allowed, err := c.check(&limiterv1.CheckRequest{Attributes: &limiterv1.Attributes{User: ck.user, ApiKey: ck.apiKey, Path: ck.path}})
				ck.end = time.Now()
				ck.allowed, ck.failed, ck.gaveUp = allowed, err != nil && !errors.Is(err, errGaveUp), errors.Is(err, errGaveUp)
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

// modelUnknown counts, per bucket, the checks whose caller gave up: each
// may have been admitted.
func modelUnknown(checks []modelCheck) map[modelBucket]int {
	unknown := map[modelBucket]int{}
	for _, c := range checks {
		if c.gaveUp {
			for _, b := range c.buckets() {
				unknown[b]++
			}
		}
	}
	return unknown
}

// checkLeasedAnswer checks each leased bucket of admitted by rule id
// through each client, within a deadline far below a jammed key's: a
// lease batch a check took and never ended leaves every later check of
// its key waiting until its deadline.
func checkLeasedAnswer(t *testing.T, clients []limiterv1.LimiterClient, admitted map[modelBucket]int) int {
	t.Helper()
	n := 0
	for b := range admitted {
		if !modelLeased[b.rule] {
			continue
		}
		for i, c := range clients {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			_, err := c.Check(ctx, &limiterv1.CheckRequest{RuleId: b.rule, Key: b.key})
			cancel()
			if err != nil {
				t.Errorf("leased %v through instance %d: %v, want an answer (a jammed key)", b, i, err)
			}
			n++
		}
	}
	return n
}

// TestModelExactWithAHealthyStore: randomized all-or-nothing checks of
// several rules (a per-key rule, a rule pinned to the key's home region, a
// leased rule, a sliding log) from concurrent callers, two of them separate
// processes, two of them giving up on their checks after a few ms, through
// two limiterd instances, with a rules reload in the middle. With a
// healthy store the admissions equal the reference model: no bucket admits
// more than its capacity, every refused check had a rule whose bucket was
// exhausted (counting the checks given up as possibly admitted), and
// afterwards each bucket has exactly capacity - admitted left (an undo
// never gave back more than was spent), within the checks given up. And
// every leased bucket still answers a check through each instance: no
// check given up left its key jammed.
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
	// The callers that give up go through an instance of their own: a store
	// call cut short by its caller's deadline may be decided by that
	// instance's fallback, which the model would not count exact; the
	// store's state still is, with their checks as possibly admitted.
	impatient := limiterv1.NewLimiterClient(dial(t, startDaemon(t, s.east.Addrs(), s.region("us-east", "")).GRPCAddr()))
	for range 3 {
		callers = append(callers, impatientCaller{impatient, 5 * time.Millisecond})
	}
	const runs = 3
	for run := range runs {
		seed := newSeed()
		rng := rand.New(rand.NewPCG(seed, uint64(run)))
		prefix := fmt.Sprintf("h%d", run)
		if run == 1 {
			// A rules change under traffic: a rule added, none changed.
			go func() {
				time.Sleep(50 * time.Millisecond)
				if err := os.WriteFile(s.rules, []byte(modelRules+"  - id: added\n    capacity: 1\n    refill_per_second: 1\n"), 0o644); err != nil {
					t.Errorf("the rules change under traffic: %v", err)
				}
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
		admitted, unknown := modelAdmitted(checks), modelUnknown(checks)
		allowed, gaveUp := 0, 0
		for i := range checks {
			c := &checks[i]
			if c.gaveUp {
				gaveUp++
				continue
			}
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
				// A refused check of two clients holds tokens until it
				// gives them back: a refusal a little early, documented
				// (redisstore.TakeAll).
				if admitted[b]+unknown[b]+heldMeanwhile(checks, c, b) >= modelCapacity[b.rule] || modelLeased[b.rule] {
					exhausted = true
				}
			}
			if !exhausted {
				t.Errorf("run %d (seed %d): check %+v refused with every bucket below its capacity: %v", run, seed, *c, admittedOf(admitted, *c))
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
		prober := limiterv1.NewLimiterClient(dial(t, startDaemon(t, s.east.Addrs(), s.region("us-east", ""), func(o *Options) { o.Memory.DenyCacheSize = 0 }).GRPCAddr()))
		probes := 0
		for b, n := range admitted {
			if modelLeased[b.rule] {
				continue
			}
			resp, err := prober.Check(context.Background(), &limiterv1.CheckRequest{RuleId: b.rule, Key: b.key})
			if err != nil {
				t.Fatal(err)
			}
			probes++
			if n < modelCapacity[b.rule] && n+unknown[b] >= modelCapacity[b.rule] {
				continue // the checks given up decide it
			}
			if want := n < modelCapacity[b.rule]; resp.GetAllowed() != want {
				t.Errorf("run %d (seed %d): %v after %d admitted of %d: probe allowed %v, want %v", run, seed, b, n, modelCapacity[b.rule], resp.GetAllowed(), want)
			}
		}
		leased := checkLeasedAnswer(t, append(s.clients, impatient), admitted)
		t.Logf("run %d (seed %d): %d checks, %d allowed, %d given up, %d buckets, %d probes, %d leased checks after", run, seed, len(checks), allowed, gaveUp, len(admitted), probes, leased)
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
// replicated), plus the checks whose caller gave up (one caller gives up
// after a few ms: unknown outcomes). Afterwards every leased bucket still
// answers a check through each instance.
func TestModelBoundedUnderStoreFaults(t *testing.T) {
	s := newModelStack(t, 0) // the default, 5 ms: the slow replies outlast it
	var callers []caller
	for i := range 6 {
		callers = append(callers, grpcCaller{s.clients[i%2]})
	}
	in, out := helper(t, "attrs", "LIMITERD_ADDR="+s.eastDs[0].GRPCAddr())
	callers = append(callers, processCaller{in, out}, impatientCaller{s.clients[1], 5 * time.Millisecond})
	const runs = 2
	faults := map[string]int{}
	for run := range runs {
		seed := newSeed()
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
					behind := replicaBehind(s.east, p)
					for _, n := range s.east.Nodes() {
						if n.Addr() == addr {
							n.Stop()
							// It comes back only once its replica holds
							// its slots: back before, it would still own
							// them, empty, and its replica would copy
							// the empty data set (every bucket of those
							// slots full again).
							if err := s.east.Settle(context.Background()); err != nil {
								t.Errorf("run %d: after killing %s: %v", run, addr, err)
							}
							n.Start()
						}
					}
					t.Logf("run %d: killed primary %s, its replica %s bytes behind just before", run, addr, behind)
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
		admitted, unknown := modelAdmitted(checks), modelUnknown(checks)
		worst, allowed, failed, gaveUp := 0, 0, 0, 0
		for _, c := range checks {
			if c.allowed {
				allowed++
			}
			if c.failed {
				failed++
			}
			if c.gaveUp {
				gaveUp++
			}
		}
		for b, n := range admitted {
			bound := 2*modelCapacity[b.rule] + int(uncertain) + kills + unknown[b]
			if n > bound {
				var by []string
				for i, d := range s.eastDs {
					for _, r := range []string{"allowed", "fallback_allowed", "uncertain_allowed", "limited", "fallback_limited"} {
						by = append(by, fmt.Sprintf("%d/%s=%v", i, r, sumSeries(t, d, "limiter_decisions_total", "rule", b.rule, "result", r)))
					}
					by = append(by, fmt.Sprintf("%d/fleet=%v", i, fleetSize(t, d)))
				}
				t.Errorf("run %d (seed %d): %v admitted %d, bound %d; rule's decisions (cumulative) %v", run, seed, b, n, bound, by)
			}
			worst = max(worst, n-modelCapacity[b.rule])
		}
		s.east.WaitHealthy(t)
		leased := checkLeasedAnswer(t, s.clients, admitted)
		t.Logf("run %d (seed %d): %d checks, %d allowed, %d failed, %d given up, worst excess over capacity %d, uncertain %v, faults so far %v, %d leased checks after",
			run, seed, len(checks), allowed, failed, gaveUp, worst, uncertain, faults, leased)
	}
}

// replicaBehind reports how many bytes of p's replication stream its
// replica had not yet received, read on each side just before a kill: the
// writes the kill may lose. (A primary's own view of its replica's offset
// is the replica's last ack, sent once a second.)
func replicaBehind(c *redistest.Cluster, p *redis.Client) string {
	offset := func(cl *redis.Client, field string) (int64, string) {
		info, err := cl.Info(context.Background(), "replication").Result()
		if err != nil {
			return -1, ""
		}
		var n int64 = -1
		port := ""
		for line := range strings.Lines(info) {
			line = strings.TrimSpace(line)
			if v, ok := strings.CutPrefix(line, field+":"); ok {
				if x, err := strconv.ParseInt(v, 10, 64); err == nil {
					n = x
				}
			}
			if v, ok := strings.CutPrefix(line, "master_port:"); ok {
				port = v
			}
		}
		return n, port
	}
	primary, _ := offset(p, "master_repl_offset")
	_, pport, _ := strings.Cut(p.Options().Addr, ":")
	for _, n := range c.Nodes() {
		r := redis.NewClient(&redis.Options{Addr: n.Addr()})
		got, port := offset(r, "slave_repl_offset")
		r.Close()
		if port == pport && got >= 0 && primary >= 0 {
			return fmt.Sprint(max(primary-got, 0))
		}
	}
	return "?"
}

// sumSeries sums a metric's series that have every label=value of
// labels, given as name, value pairs.
func sumSeries(t *testing.T, d *Daemon, name string, labels ...string) float64 {
	t.Helper()
	total := 0.0
	for _, mf := range mustGather(t, d) {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			matched := 0
			for _, l := range m.GetLabel() {
				for i := 0; i+1 < len(labels); i += 2 {
					if l.GetName() == labels[i] && l.GetValue() == labels[i+1] {
						matched++
					}
				}
			}
			if matched == len(labels)/2 {
				total += m.GetCounter().GetValue()
			}
		}
	}
	return total
}
