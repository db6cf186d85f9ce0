package limiterd

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc/connectivity"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/region"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// pinRules count every decision exactly where it is made: a pinned rule
// with a huge fixed window, so a key's count in a region's Redis is the
// checks decided there.
const pinRules = `rules:
  - id: pin
    algorithm: fixed_window
    limit: 1000000000
    window: 8760h
    home: pinned
    on_failure: open
`

// topoYAML is a topology file of generation gen over regions (name ->
// address), effective at at (zero: none).
func topoYAML(gen int, at time.Time, regions map[string]string, names ...string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "generation: %d\n", gen)
	if !at.IsZero() {
		fmt.Fprintf(&b, "effective_at: %s\n", at.UTC().Format(time.RFC3339Nano))
	}
	b.WriteString("regions:\n")
	for _, n := range names {
		fmt.Fprintf(&b, "  - name: %s\n    limiter_address: %s\n", n, regions[n])
	}
	return b.String()
}

// replaceFile swaps path's content at once, as a ConfigMap update does.
func replaceFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path+".new", []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".new", path); err != nil {
		t.Fatal(err)
	}
}

// topoRegion is one region of a topology test: its Redis Cluster, its
// limiterd and its own copy of the topology file.
type topoRegion struct {
	name, addr, file string
	d                *Daemon
	// start starts the region's limiterd again, on its address, Redis and
	// file (the first is d).
	start      func() *Daemon
	redisAddrs []string // the cluster's primaries
	redis      *redis.ClusterClient
	client     limiterv1.LimiterClient
}

type topoStack struct {
	t         *testing.T
	rulesFile string // every region's --rules.file
	poll      time.Duration
	addrs     map[string]string
	regions   map[string]*topoRegion
}

// newTopoStackWith makes the regions a, b, c, each on its own Redis
// Cluster (3 primaries); files gives each region's first topology file,
// from the regions' addresses.
func newTopoStackWith(t *testing.T, poll time.Duration, files func(addrs map[string]string) map[string]string) *topoStack {
	t.Helper()
	return newRegionStack(t, poll, pinRules, files)
}

// newRegionStack is newTopoStackWith with the rules of rulesYAML.
func newRegionStack(t *testing.T, poll time.Duration, rulesYAML string, files func(addrs map[string]string) map[string]string) *topoStack {
	t.Helper()
	dir := t.TempDir()
	rulesFile := filepath.Join(dir, "rules.yml")
	if err := os.WriteFile(rulesFile, []byte(rulesYAML), 0o644); err != nil {
		t.Fatal(err)
	}
	secret := testenv.SecretFile(t)
	s := &topoStack{t: t, poll: poll, addrs: map[string]string{}, regions: map[string]*topoRegion{}, rulesFile: rulesFile}
	for _, n := range []string{"a", "b", "c"} {
		s.addrs[n] = testenv.FreeAddr(t)
	}
	first := files(s.addrs)
	for _, n := range []string{"a", "b", "c"} {
		cluster := redistest.NewCluster(t, 3, 0)
		r := &topoRegion{name: n, addr: s.addrs[n], file: filepath.Join(dir, n+"-topology.yml")}
		if err := os.WriteFile(r.file, []byte(first[n]), 0o644); err != nil {
			t.Fatal(err)
		}
		r.start = func() *Daemon {
			return startDaemon(t, cluster.Addrs(), func(o *Options) {
				o.Region.Name, o.Region.TopologyFile, o.Region.TopologyPoll, o.Region.PeerSecretFile, o.Rules.File = n, r.file, poll, secret, rulesFile
				o.Server.GRPCAddress = r.addr
				// The race detector on two cores, beside other tests: a
				// check is not refused as overloaded, nor a late reply
				// taken for an unknown outcome, only because the machine
				// is busy (either sends a fail-open rule to its fallback).
				o.Region.ForwardTimeout = 2 * time.Second
				o.RedisTuning.MaxQueueWait, o.RedisTuning.ReplyDeadline = time.Second, 5*time.Second
			})
		}
		r.d = r.start()
		r.redisAddrs = cluster.Addrs()
		r.redis = redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs()})
		t.Cleanup(func() { r.redis.Close() })
		r.client = limiterv1.NewLimiterClient(dial(t, r.d.GRPCAddr()))
		s.regions[n] = r
	}
	s.waitPeers()
	return s
}

// waitPeers waits until every region's links to the regions its topology
// names are up. A region dials the others when its topology loads; those
// started after it are found at its next attempt, up to peerBackoff's
// MaxDelay later, and a check forwarded before that fails at once.
func (s *topoStack) waitPeers() {
	s.t.Helper()
	for _, r := range s.regions {
		testenv.WaitFor(s.t, "region "+r.name+"'s links to the other regions", func() bool {
			r.d.peersMu.Lock()
			defer r.d.peersMu.Unlock()
			for _, pc := range r.d.peers {
				if pc.cc.GetState() != connectivity.Ready {
					return false
				}
			}
			return true
		})
	}
}

// count is the checks of key decided in region's Redis.
func (s *topoStack) count(region, key string) int {
	s.t.Helper()
	v, err := s.regions[region].redis.Get(context.Background(), redisstore.Key("pin", key)).Result()
	if errors.Is(err, redis.Nil) {
		return 0
	}
	if err != nil {
		s.t.Fatal(err)
	}
	f := strings.Fields(v)
	n, err := strconv.ParseFloat(f[len(f)-1], 64)
	if err != nil {
		s.t.Fatalf("pin state %q: %v", v, err)
	}
	return int(n)
}

// round is one check of every key through each of the regions via, and
// which regions decided each key meanwhile (their Redis counts grew).
type round struct {
	start, end time.Time
	deciders   map[string][]string // key -> regions
}

// runRound checks every key once through each region of via (all must be
// allowed) and attributes each decision by the regions' Redis counts.
func (s *topoStack) runRound(keys []string, via []string, before map[string]map[string]int) round {
	s.t.Helper()
	r := round{start: time.Now(), deciders: map[string][]string{}}
	var wg sync.WaitGroup
	errs := make(chan error, len(keys)*len(via))
	sem := make(chan struct{}, 8)
	for _, k := range keys {
		for _, v := range via {
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				resp, err := s.regions[v].client.Check(ctx, &limiterv1.CheckRequest{RuleId: "pin", Key: k})
				if err == nil && !resp.GetAllowed() {
					err = fmt.Errorf("check of %s through %s refused", k, v)
				}
				if err != nil {
					errs <- err
				}
			})
		}
	}
	wg.Wait()
	r.end = time.Now()
	close(errs)
	for err := range errs {
		s.t.Fatal(err)
	}
	for _, k := range keys {
		for _, n := range []string{"a", "b", "c"} {
			c := s.count(n, k)
			if c > before[n][k] {
				r.deciders[k] = append(r.deciders[k], n)
			}
			before[n][k] = c
		}
	}
	return r
}

func newCounts() map[string]map[string]int {
	return map[string]map[string]int{"a": {}, "b": {}, "c": {}}
}

// waitGauge waits until d's series of name with labels has value want.
func waitGauge(t *testing.T, d *Daemon, name string, labels map[string]string, want float64, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for metricValue(t, d, name, labels) != want {
		if time.Now().After(deadline) {
			t.Fatalf("%s%v = %v after %v, want %v", name, labels, metricValue(t, d, name, labels), within, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func mustParse(t *testing.T, content string) *region.Topology {
	t.Helper()
	topo, err := region.Parse("t.yml", []byte(content))
	if err != nil {
		t.Fatal(err)
	}
	return topo
}

// TestTopologyAddRegionHandover: regions a and b on generation 1 {a, b},
// c started on generation 2 {a, b, c}; a's and b's files replaced by
// generation 2 effective a few seconds ahead. Checks of many pinned keys
// through a and b, in rounds, each decision attributed to the region whose
// Redis counted it: before effective_at the keys that move are decided in
// their old home only, after it in c only, and the time during which two
// regions decided the same key is at most one poll interval.
func TestTopologyAddRegionHandover(t *testing.T) {
	const poll = 500 * time.Millisecond
	s := newTopoStackWith(t, poll, func(addrs map[string]string) map[string]string {
		return map[string]string{
			"a": topoYAML(1, time.Time{}, addrs, "a", "b"),
			"b": topoYAML(1, time.Time{}, addrs, "a", "b"),
			"c": topoYAML(2, time.Time{}, addrs, "a", "b", "c"),
		}
	})
	gen1 := mustParse(t, topoYAML(1, time.Time{}, s.addrs, "a", "b"))
	gen2 := mustParse(t, topoYAML(2, time.Time{}, s.addrs, "a", "b", "c"))
	var keys, moved []string
	for i := range 60 {
		k := fmt.Sprintf("user-%d", i)
		keys = append(keys, k)
		if gen2.Home(k, nil) == "c" {
			moved = append(moved, k)
		}
	}
	if len(moved) == 0 {
		t.Fatal("no key moves to c")
	}
	at := time.Now().Add(3 * time.Second)
	for _, n := range []string{"a", "b"} {
		replaceFile(t, s.regions[n].file, topoYAML(2, at, s.addrs, "a", "b", "c"))
	}
	for _, n := range []string{"a", "b"} {
		waitGauge(t, s.regions[n].d, "limiter_topology_generation", map[string]string{"state": "pending"}, 2, 2*poll+time.Second)
		if g := metricValue(t, s.regions[n].d, "limiter_topology_generation", map[string]string{"state": "active"}); g != 1 {
			t.Fatalf("%s: active generation %v while 2 is pending, want 1", n, g)
		}
	}

	counts := newCounts()
	var rounds []round
	sent := 0
	for time.Now().Before(at.Add(3 * time.Second)) {
		rounds = append(rounds, s.runRound(keys, []string{"a", "b"}, counts))
		sent += 2
	}
	for _, n := range []string{"a", "b"} {
		if g := metricValue(t, s.regions[n].d, "limiter_topology_generation", map[string]string{"state": "active"}); g != 2 {
			t.Fatalf("%s: active generation %v after effective_at, want 2", n, g)
		}
		if metricValue(t, s.regions[n].d, "limiter_topology_generation", map[string]string{"state": "pending"}) != 0 {
			t.Errorf("%s: pending generation still exported after the switch", n)
		}
		if r := metricValue(t, s.regions[n].d, "limiter_topology_regions", nil); r != 3 {
			t.Errorf("%s: limiter_topology_regions = %v, want 3", n, r)
		}
	}

	isMoved := map[string]bool{}
	for _, k := range moved {
		isMoved[k] = true
	}
	var window time.Duration // the longest time two regions decided one key
	straddled := 0
	for _, k := range keys {
		old, next := gen1.Home(k, nil), gen2.Home(k, nil)
		var lastOld, firstNew time.Time
		for _, r := range rounds {
			for _, dec := range r.deciders[k] {
				switch {
				case dec == old && (!isMoved[k] || r.start.Before(at.Add(poll))):
					if isMoved[k] {
						lastOld = r.end
					}
				case dec == next && isMoved[k] && r.end.After(at):
					if firstNew.IsZero() {
						firstNew = r.start
					}
				default:
					t.Fatalf("key %s (home %s, then %s) decided in %s in the round %v to %v (effective_at %v)",
						k, old, next, dec, r.start.Format(time.StampMilli), r.end.Format(time.StampMilli), at.Format(time.StampMilli))
				}
			}
			if len(r.deciders[k]) > 1 {
				straddled++
			}
		}
		total := s.count("a", k) + s.count("b", k) + s.count("c", k)
		if total != sent {
			t.Errorf("key %s: %d decisions counted over the regions, %d checks sent", k, total, sent)
		}
		if !isMoved[k] {
			continue
		}
		if firstNew.IsZero() {
			t.Fatalf("moved key %s never decided in c", k)
		}
		if d := lastOld.Sub(firstNew); d > window {
			window = d
		}
	}
	if window > poll {
		t.Errorf("two regions decided the same key for %v, more than one poll interval (%v)", window, poll)
	}
	t.Logf("%d rounds (%v each on average), %d keys of %d moved to c; longest two-homes window observed %v (rounds whose check counts two regions: %d; bounded by a round's length)",
		len(rounds), rounds[len(rounds)-1].end.Sub(rounds[0].start)/time.Duration(len(rounds)), len(moved), len(keys), window, straddled)
}

// TestTopologyLateFile: b gets generation 2 several seconds after its
// effective_at. Meanwhile a (switched) refuses b's forwards of the keys
// that moved to c as stale: b reads its file again, finds nothing newer,
// and the rule's on_failure (open) decides; b's refusals are counted.
// Once the file lands, b switches within one poll (or on the first forward
// refused as stale), and its checks of the moved keys are decided in c.
func TestTopologyLateFile(t *testing.T) {
	// A long poll, so that the catch-ups on a forward are seen before it.
	const poll = 2 * time.Second
	s := newTopoStackWith(t, poll, func(addrs map[string]string) map[string]string {
		return map[string]string{
			"a": topoYAML(1, time.Time{}, addrs, "a", "b"),
			"b": topoYAML(1, time.Time{}, addrs, "a", "b"),
			"c": topoYAML(2, time.Time{}, addrs, "a", "b", "c"),
		}
	})
	gen1 := mustParse(t, topoYAML(1, time.Time{}, s.addrs, "a", "b"))
	gen2 := mustParse(t, topoYAML(2, time.Time{}, s.addrs, "a", "b", "c"))
	// Keys that move to c and whose old home is a: b forwards them to a.
	var keys []string
	for i := 0; len(keys) < 10; i++ {
		k := fmt.Sprintf("late-%d", i)
		if gen1.Home(k, nil) == "a" && gen2.Home(k, nil) == "c" {
			keys = append(keys, k)
		}
	}
	at := time.Now().Add(3 * time.Second)
	replaceFile(t, s.regions["a"].file, topoYAML(2, at, s.addrs, "a", "b", "c"))
	waitGauge(t, s.regions["a"].d, "limiter_topology_generation", map[string]string{"state": "active"}, 2, 3*time.Second+2*poll)

	counts := newCounts()
	r := s.runRound(keys, []string{"b"}, counts)
	for _, k := range keys {
		if fmt.Sprint(r.deciders[k]) != "[b]" {
			t.Fatalf("key %s checked through b before b has generation 2: decided in %v, want b (a refused it as stale, on_failure open)", k, r.deciders[k])
		}
	}
	b := s.regions["b"].d
	if n := metricValue(t, b, "limiter_topology_stale_total", map[string]string{"peer": "a"}); n != float64(len(keys)) {
		t.Fatalf("limiter_topology_stale_total{peer=a} = %v on b, want %d", n, len(keys))
	}
	if n := metricValue(t, b, "limiter_decisions_total", map[string]string{"rule": "pin", "result": "allowed"}); n != float64(len(keys)) {
		t.Fatalf("b decided %v checks of pin itself, want %d (on_failure open)", n, len(keys))
	}

	// The file lands 3 s after its effective_at, and b's checks of the
	// moved keys go on: the first forward a refuses makes b read its file,
	// switch, and route the check again, to c.
	time.Sleep(time.Until(at.Add(3 * time.Second)))
	replaceFile(t, s.regions["b"].file, topoYAML(2, at, s.addrs, "a", "b", "c"))
	landed := time.Now()
	r = s.runRound(keys[:1], []string{"b"}, counts)
	switched := time.Since(landed)
	if g := metricValue(t, b, "limiter_topology_generation", map[string]string{"state": "active"}); g != 2 {
		t.Fatalf("b on generation %v after a forward refused as stale with its file there, want 2", g)
	}
	if fmt.Sprint(r.deciders[keys[0]]) != "[c]" {
		t.Fatalf("the check that found b stale: decided in %v, want c (routed again)", r.deciders[keys[0]])
	}
	r = s.runRound(keys, []string{"b"}, counts)
	for _, k := range keys {
		if fmt.Sprint(r.deciders[k]) != "[c]" {
			t.Fatalf("key %s checked through b after the switch: decided in %v, want c", k, r.deciders[k])
		}
	}
	if n := metricValue(t, b, "limiter_topology_stale_total", map[string]string{"peer": "a"}); n != float64(len(keys)+1) {
		t.Errorf("limiter_topology_stale_total{peer=a} = %v on b, want %d (one more: the check routed again)", n, len(keys)+1)
	}

	// A home behind its sender catches up on the first forward: generation
	// 3 (same regions) put in a's and then b's file; a's check of a key
	// homed in b carries 3, and b reads its file at once, not at its poll.
	replaceFile(t, s.regions["a"].file, topoYAML(3, time.Time{}, s.addrs, "a", "b", "c"))
	waitGauge(t, s.regions["a"].d, "limiter_topology_generation", map[string]string{"state": "active"}, 3, 2*poll+time.Second)
	replaceFile(t, s.regions["b"].file, topoYAML(3, time.Time{}, s.addrs, "a", "b", "c"))
	landed3 := time.Now()
	var homedInB string
	for i := 0; homedInB == ""; i++ {
		if k := fmt.Sprintf("b-%d", i); gen2.Home(k, nil) == "b" {
			homedInB = k
		}
	}
	r = s.runRound([]string{homedInB}, []string{"a"}, counts)
	caughtUp := time.Since(landed3)
	if fmt.Sprint(r.deciders[homedInB]) != "[b]" {
		t.Fatalf("key %s homed in b, checked through a: decided in %v", homedInB, r.deciders[homedInB])
	}
	if g := metricValue(t, b, "limiter_topology_generation", map[string]string{"state": "active"}); g != 3 {
		t.Fatalf("b on generation %v right after a forward of generation 3 (%v after its file landed; poll %v), want 3", g, caughtUp, poll)
	}
	t.Logf("late file: b in generation 2 %v after it landed, on its first forward refused as stale; in generation 3 %v after it landed, on the first forward of generation 3 (poll %v)",
		switched, caughtUp, poll)
}

// TestTopologyBadFileAtRunTime: a file with a syntax error, a lower
// generation, without this region, or removing a region the rules'
// home_keys name is refused: the daemon keeps answering under the topology
// in force, and each refusal is counted; a good file after them is taken.
func TestTopologyBadFileAtRunTime(t *testing.T) {
	dir := t.TempDir()
	rulesFile := filepath.Join(dir, "rules.yml")
	if err := os.WriteFile(rulesFile, []byte(pinRules+"    home_keys: {vip: b}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	addrs := map[string]string{"a": "127.0.0.1:1", "b": "127.0.0.1:2", "c": "127.0.0.1:3"}
	file := filepath.Join(dir, "topology.yml")
	if err := os.WriteFile(file, []byte(topoYAML(2, time.Time{}, addrs, "a", "b")), 0o644); err != nil {
		t.Fatal(err)
	}
	const poll = 50 * time.Millisecond
	d := startDaemon(t, nil, func(o *Options) {
		o.Region.Name, o.Region.TopologyFile, o.Region.TopologyPoll, o.Region.PeerSecretFile, o.Rules.File = "a", file, poll, testenv.SecretFile(t), rulesFile
	})
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	var local string // a key homed here
	for i := 0; local == ""; i++ {
		if k := fmt.Sprintf("k%d", i); d.topo.Active().Home(k, nil) == "a" {
			local = k
		}
	}
	tests := []struct {
		name, content, field string
	}{
		{"syntax error", "generation: 3\nregions: [\n", "yaml:"},
		{"lower generation", topoYAML(1, time.Time{}, addrs, "a", "b", "c"), "generation: 1 is lower than 2"},
		{"own region missing", topoYAML(3, time.Time{}, addrs, "b", "c"), "--region is not in it"},
		{"home_keys name a removed region", topoYAML(3, time.Time{}, addrs, "a", "c"), `rule "pin"`},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			replaceFile(t, file, tt.content)
			waitGauge(t, d, "limiter_topology_reload_failures_total", nil, float64(i+1), 2*time.Second)
			time.Sleep(3 * poll) // read again, not counted again
			if n := metricValue(t, d, "limiter_topology_reload_failures_total", nil); n != float64(i+1) {
				t.Fatalf("reload failures = %v, want %d", n, i+1)
			}
			if err := d.topo.LastError(); err == nil || !strings.Contains(err.Error(), file) || !strings.Contains(err.Error(), tt.field) {
				t.Fatalf("refusal %v: want it to name %s and %q", err, file, tt.field)
			}
			if g := metricValue(t, d, "limiter_topology_generation", map[string]string{"state": "active"}); g != 2 {
				t.Fatalf("active generation %v, want 2 still", g)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "pin", Key: local}); err != nil || !resp.GetAllowed() {
				t.Fatalf("check under the topology in force: %v, %v", resp, err)
			}
		})
	}
	replaceFile(t, file, topoYAML(3, time.Time{}, addrs, "a", "b", "c"))
	waitGauge(t, d, "limiter_topology_generation", map[string]string{"state": "active"}, 3, 2*time.Second)
	if r := metricValue(t, d, "limiter_topology_regions", nil); r != 3 {
		t.Fatalf("limiter_topology_regions = %v, want 3", r)
	}
	if d.engine.Topology().Generation() != 3 {
		t.Fatalf("engine routes with generation %d, want 3", d.engine.Topology().Generation())
	}
}
