package reconciler

import (
	"context"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/pkg/gossip"
	"github.com/limiterd/limiterd/pkg/region"
	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// maxInWindow is the most admissions within any window of length w.
func maxInWindow(times []time.Duration, w time.Duration) int {
	best, j := 0, 0
	for i := range times {
		for times[i]-times[j] >= w {
			j++
		}
		best = max(best, i-j+1)
	}
	return best
}

// hammered is what a hammer run admitted, per rule and region, at what time.
type hammered struct {
	names    []string
	elapsed  float64
	admitted map[string]map[string][]time.Duration
	sent     map[string]int // checks sent per rule, every region together
}

func (h *hammered) total(rule string) int {
	n := 0
	for _, ts := range h.admitted[rule] {
		n += len(ts)
	}
	return n
}

// remoteWindow is, for the region it is largest for, the most every other
// region together admitted within one interval: the spending that region
// may not know of yet.
func (h *hammered) remoteWindow(rule string, interval time.Duration) int {
	m := 0
	for _, self := range h.names {
		var others []time.Duration
		for name, ts := range h.admitted[rule] {
			if name != self {
				others = append(others, ts...)
			}
		}
		slices.Sort(others)
		m = max(m, maxInWindow(others, interval))
	}
	return m
}

// peak is the largest excess at any instant of the run: admitted by t
// across the regions, minus capacity + rate*t.
func (h *hammered) peak(rule string, capacity, rate float64) (excess float64, at time.Duration) {
	var all []time.Duration
	for _, ts := range h.admitted[rule] {
		all = append(all, ts...)
	}
	slices.Sort(all)
	excess = math.Inf(-1)
	for i, t := range all {
		if e := float64(i+1) - capacity - rate*t.Seconds(); e > excess {
			excess, at = e, t
		}
	}
	return excess, at
}

// hammer checks one key under each rule through every region, one check
// per rule every period per region, for run. Checks go out on the tick
// whether or not the last one answered (up to hammerInFlight at once per
// region): on a loaded machine a slow answer must not slow the offered
// rate below the limit, or the run proves nothing.
func (s *stack) hammer(run, period time.Duration, rules ...string) *hammered {
	var mu sync.Mutex
	h := &hammered{names: s.names, admitted: map[string]map[string][]time.Duration{}, sent: map[string]int{}}
	for _, r := range rules {
		h.admitted[r] = map[string][]time.Duration{}
	}
	start := time.Now()
	var wg sync.WaitGroup
	for _, name := range s.names {
		slots := make(chan struct{}, hammerInFlight)
		wg.Go(func() {
			tick := time.NewTicker(period)
			defer tick.Stop()
			for time.Since(start) < run {
				<-tick.C
				for _, rule := range rules {
					select {
					case slots <- struct{}{}:
					default:
						continue // this region has hammerInFlight checks waiting
					}
					mu.Lock()
					h.sent[rule]++
					mu.Unlock()
					wg.Go(func() {
						defer func() { <-slots }()
						resp, err := s.check(name, rule, "hammered")
						if err != nil {
							s.t.Errorf("%s %s: %v", name, rule, err)
							return
						}
						if resp.Allowed {
							mu.Lock()
							h.admitted[rule][name] = append(h.admitted[rule][name], time.Since(start))
							mu.Unlock()
						}
					})
				}
			}
		})
	}
	wg.Wait()
	h.elapsed = time.Since(start).Seconds()
	return h
}

// hammerInFlight bounds the checks a hammer has waiting per region.
const hammerInFlight = 64

// offeredAbove fails t when the hammer sent fewer than factor times limit
// checks of rule: the run did not press the rule hard enough to judge it.
func (h *hammered) offeredAbove(t testing.TB, rule string, limit, factor float64) {
	t.Helper()
	if float64(h.sent[rule]) < factor*limit {
		t.Fatalf("the hammer sent only %d checks of %s in %.1fs, under %.0fx its limit %.0f: the machine is too slow for this run to judge the rule",
			h.sent[rule], rule, h.elapsed, factor, limit)
	}
}

// TestOvershootBounded hammers one key through both regions well above its
// rate for 10 s. With reconciliation the total admitted stays within
// capacity + refill*T + one interval of remote spending (+ a small epsilon);
// the same traffic on a rule that is not reconciled admits about twice that.
func TestOvershootBounded(t *testing.T) {
	t.Parallel()
	const capacity, rate = 50.0, 20.0
	interval := 500 * time.Millisecond
	s := newStack(t, fmt.Sprintf(`rules:
  - id: global
    capacity: %v
    refill_per_second: %v
  - id: solo
    capacity: %v
    refill_per_second: %v
    reconcile: false
`, capacity, rate, capacity, rate), interval, 1)

	h := s.hammer(10*time.Second, 10*time.Millisecond, "global", "solo")
	elapsed, admitted := h.elapsed, h.admitted
	total := h.total
	// Without reconciliation the two regions admit about twice the limit:
	// the hammer must offer well above that.
	h.offeredAbove(t, "solo", capacity+rate*elapsed, 3)
	remote := h.remoteWindow("global", interval)
	base := capacity + rate*elapsed
	// Epsilon: a spend waits up to one interval for its flush, then a few
	// milliseconds for the relay and the debit; allow a tenth of the burst.
	bound := base + float64(remote) + capacity/10
	g, solo := total("global"), total("solo")
	t.Logf("T=%.1fs: capacity+refill*T=%.0f; reconciled: %d admitted (us-east %d, eu-west %d), overshoot %.0f = %.2f x one interval of remote spending (%d); not reconciled: %d",
		elapsed, base, g, len(admitted["global"]["us-east"]), len(admitted["global"]["eu-west"]), float64(g)-base, (float64(g)-base)/float64(remote), remote, solo)
	if float64(g) > bound {
		t.Errorf("reconciled rule admitted %d, above the bound %.0f", g, bound)
	}
	// Both regions' first bursts necessarily overshoot, and each region
	// sees it when it applies the other's spends.
	time.Sleep(2 * interval)
	for _, name := range stackRegions {
		mfs, err := s.regions[name].recs[0].Registry().Gather()
		if err != nil {
			t.Fatal(err)
		}
		var seen bool
		for _, mf := range mfs {
			if mf.GetName() != "limiter_overshoot_tokens" {
				continue
			}
			for _, m := range mf.GetMetric() {
				h := m.GetHistogram()
				rule := m.GetLabel()[0].GetValue()
				t.Logf("%s: rule %s: %d debits, overshoot %.1f tokens on average", name, rule, h.GetSampleCount(), h.GetSampleSum()/float64(h.GetSampleCount()))
				if rule == "solo" {
					t.Errorf("%s: overshoot reported for a rule that is not reconciled", name)
				}
				seen = seen || (rule == "global" && h.GetSampleSum() > 0)
			}
		}
		if !seen {
			t.Errorf("%s: no overshoot reported for the hammered rule", name)
		}
	}
	if float64(solo) < 1.5*base {
		t.Errorf("rule without reconciliation admitted %d, expected about twice %.0f", solo, base)
	}
	if float64(g) < base-capacity {
		t.Errorf("reconciled rule admitted %d, far below its limit %.0f: debits applied twice?", g, base)
	}
}

// quotaRules counts every admission exactly: a huge fixed window, so the
// stored count is the sum of local admissions and applied debits.
const quotaRules = `rules:
  - id: quota
    algorithm: fixed_window
    limit: 1000000000
    window: 8760h
`

// count reads the quota's stored count for key in region.
func (s *stack) count(region, key string) float64 {
	s.t.Helper()
	v, err := s.regions[region].redis.Get(context.Background(), redisstore.Key("quota", key)).Result()
	if err != nil {
		return 0
	}
	f := strings.Fields(v)
	if len(f) != 2 {
		s.t.Fatalf("quota state %q", v)
	}
	n, err := strconv.ParseFloat(f[1], 64)
	if err != nil {
		s.t.Fatal(err)
	}
	return n
}

// waitSpendsFlow checks one new key of rule in each region and waits until
// every other region has applied it: spends flow between every pair of
// regions, not only are the streams made (a stream source starts reading
// some time after it is made). Arrival is read from each reconciler's
// counters of clients applied and refilled, not from the key in Redis: a
// small spend of a fast-refilling bucket may have refilled by the time it
// arrives (then nothing is written) or expire before a poll sees it.
func (s *stack) waitSpendsFlow(rule string) time.Duration {
	s.t.Helper()
	start := time.Now()
	applied := func(to, from string) float64 {
		var n float64
		for _, rec := range s.regions[to].recs {
			n += testutil.ToFloat64(rec.m.apply.Applied.WithLabelValues(from))
			n += testutil.ToFloat64(rec.m.apply.Refilled.WithLabelValues(from))
		}
		return n
	}
	for _, from := range s.names {
		before := map[string]float64{}
		for _, to := range s.names {
			before[to] = applied(to, from)
		}
		key := "flowing-" + from
		if resp, err := s.check(from, rule, key); err != nil || !resp.Allowed {
			s.t.Fatalf("%s: %v, %v", from, resp, err)
		}
		for _, to := range s.names {
			for to != from && applied(to, from) <= before[to] {
				if time.Since(start) > 30*time.Second {
					s.t.Fatalf("a spend of %s in %s not applied in %s after 30s; %s", rule, from, to, s.streamReport(to))
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
	}
	return time.Since(start)
}

// streamReport describes region's inbound stream, its sources and its
// apply consumers, for a test that waited in vain for a spend.
func (s *stack) streamReport(region string) string {
	nc := s.connectAsIn("ops", region)
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err.Error()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var b strings.Builder
	st, err := js.Stream(ctx, gossip.InStream(region))
	if err != nil {
		return fmt.Sprintf("stream %s: %v", gossip.InStream(region), err)
	}
	info := st.CachedInfo()
	fmt.Fprintf(&b, "%s: %d messages, last seq %d", info.Config.Name, info.State.Msgs, info.State.LastSeq)
	for _, src := range info.Sources {
		fmt.Fprintf(&b, "; source %s lag %d active %v", src.Name, src.Lag, src.Active)
		if src.Error != nil {
			fmt.Fprintf(&b, " error %v", src.Error)
		}
	}
	for _, from := range s.names {
		if from == region {
			continue
		}
		if behind, err := s.partitionsBehind(ctx, js, region, from); err != nil {
			fmt.Fprintf(&b, "; partitions of %s: %v", from, err)
		} else {
			fmt.Fprintf(&b, "; partitions of %s behind: %v", from, behind)
		}
		if src, err := js.Stream(ctx, gossip.RegionStream(from)); err != nil {
			fmt.Fprintf(&b, "; stream %s: %v", gossip.RegionStream(from), err)
		} else {
			fmt.Fprintf(&b, "; stream %s: %d messages", gossip.RegionStream(from), src.CachedInfo().State.Msgs)
		}
	}
	return b.String()
}

// send makes n checks of the quota for key through region; all must pass.
func (s *stack) send(region, key string, n int) {
	s.t.Helper()
	for range n {
		resp, err := s.check(region, "quota", key)
		if err != nil || !resp.Allowed {
			s.t.Fatalf("%s: %v, %v", region, resp, err)
		}
	}
}

// converge waits until every region's count for key is want, then makes
// sure it stays there (nothing applied twice).
func (s *stack) converge(key string, want float64) {
	s.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ok := true
		for _, name := range s.names {
			if got := s.count(name, key); got != want {
				ok = false
				if got > want {
					s.t.Fatalf("%s counts %v for %s, more than the %v admitted: a spend applied twice", name, got, key, want)
				}
			}
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			var got []string
			for _, name := range s.names {
				got = append(got, fmt.Sprintf("%s %v", name, s.count(name, key)))
			}
			s.t.Fatalf("after 30s: %s; want %v", strings.Join(got, ", "), want)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(3*s.interval + 2*time.Second)
	for _, name := range s.names {
		if got := s.count(name, key); got != want {
			s.t.Fatalf("%s counts %v for %s later, want %v", name, got, key, want)
		}
	}
}

// TestNATSOutage: with NATS gone for 5 s both regions keep answering; when
// it returns every spend is applied once in the other region.
func TestNATSOutage(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)
	s.send("us-east", "k", 20)
	s.send("eu-west", "k", 30)
	s.converge("k", 50)

	s.nats.Shutdown()
	sent := map[string]int{}
	end := time.Now().Add(5 * time.Second)
	for time.Now().Before(end) {
		for _, name := range stackRegions {
			s.send(name, "k", 1)
			sent[name]++
		}
		time.Sleep(50 * time.Millisecond)
	}
	s.nats.Restart(t)
	s.send("us-east", "k", 5)
	s.send("eu-west", "k", 7)
	want := float64(50 + sent["us-east"] + sent["eu-west"] + 12)
	t.Logf("sent during the outage: %v; converging on %v", sent, want)
	s.converge("k", want)
}

// TestReconcilerDies: a reconciler dies after applying a message and before
// storing its position; another (a second one in the same region) takes
// its partitions, reads the message again and skips it; a reconciler
// stopped and replaced mid-stream loses nothing. The counts end exact.
func TestReconcilerDies(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 0)
	var died atomic.Bool
	var victim atomic.Int64 // which of eu-west's two died
	s.startReconciler("us-east")
	// The first of eu-west's two reconcilers to finish a message dies
	// then: the other one shares the work, and takes its partitions.
	die := func(i int) func(*Reconciler) {
		return func(r *Reconciler) {
			r.beforeDone = func(src string, seq uint64) bool {
				if died.Load() && victim.Load() == int64(i) {
					return false // dead
				}
				if died.CompareAndSwap(false, true) {
					victim.Store(int64(i))
					go r.Stop()
					return false
				}
				return true
			}
		}
	}
	eu := []*Reconciler{s.startReconciler("eu-west", die(0)), s.startReconciler("eu-west", die(1))}
	s.waitReady()

	var wg sync.WaitGroup
	stop := make(chan struct{})
	sent := map[string]*atomic.Int64{"us-east": {}, "eu-west": {}}
	for _, name := range stackRegions {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				resp, err := s.check(name, "quota", "k")
				if err != nil || !resp.Allowed {
					t.Errorf("%s: %v, %v", name, resp, err)
					return
				}
				sent[name].Add(1)
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
	time.Sleep(2 * time.Second)
	// us-east's only reconciler goes mid-stream; a new one takes over.
	s.regions["us-east"].recs[0].Stop()
	time.Sleep(time.Second)
	s.startReconciler("us-east")
	time.Sleep(2 * time.Second)
	close(stop)
	wg.Wait()
	if !died.Load() {
		t.Fatal("no eu-west reconciler ever finished a message")
	}
	want := float64(sent["us-east"].Load() + sent["eu-west"].Load())
	s.converge("k", want)
	second := eu[1-victim.Load()]
	dups := testutil.ToFloat64(second.m.apply.Duplicates.WithLabelValues("us-east"))
	t.Logf("sent %v + %v; duplicates skipped by the surviving reconciler: %v", sent["us-east"].Load(), sent["eu-west"].Load(), dups)
	if dups < 1 {
		t.Errorf("the message the dead reconciler applied was not caught as a duplicate by the other (duplicates %v)", dups)
	}
}

// TestPinned: a pinned rule decides every key in its home region only, so
// traffic through both regions admits exactly the limit; with the home
// region down, on_failure decides.
func TestPinned(t *testing.T) {
	t.Parallel()
	s := newStack(t, `rules:
  - id: hard
    capacity: 10
    refill_per_second: 0.000001
    home: pinned
    on_failure: open
  - id: hard-closed
    capacity: 10
    refill_per_second: 0.000001
    home: pinned
    on_failure: closed
`, 200*time.Millisecond, 1)
	topo, err := region.Load(filepath.Join(s.dir, "topology.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for i := range 40 {
		wg.Go(func() {
			resp, err := s.check(stackRegions[i%2], "hard", "tenant")
			if err != nil {
				t.Error(err)
				return
			}
			if resp.Allowed {
				admitted.Add(1)
			}
		})
	}
	wg.Wait()
	if admitted.Load() != 10 {
		t.Fatalf("pinned rule admitted %d of 40 through both regions, want exactly 10", admitted.Load())
	}

	// A key homed in us-east, checked from eu-west with us-east down.
	key := ""
	for i := 0; key == ""; i++ {
		if k := fmt.Sprint("user-", i); topo.Home(k, nil) == "us-east" {
			key = k
		}
	}
	s.regions["us-east"].lim.Stop(context.Background())
	allowed := 0
	for range 8 {
		resp, err := s.check("eu-west", "hard", key)
		if err != nil {
			t.Fatalf("fail-open pinned rule with its home down: %v", err)
		}
		if resp.Allowed {
			allowed++
		}
	}
	if allowed != 5 {
		t.Errorf("with the home region down, eu-west admitted %d of 8, want its share 10/2 = 5", allowed)
	}
	if _, err := s.check("eu-west", "hard-closed", key); status.Code(err) != codes.Unavailable {
		t.Errorf("fail-closed pinned rule with its home down: %v, want Unavailable", err)
	}
}

// TestMalformedMessages: garbage and a batch on another region's subject
// (local, or a partition's) are counted and terminated, a batch's invalid
// entry is counted and skipped; the streams move on and valid spends still
// apply exactly once.
func TestMalformedMessages(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)
	// Each subject's own publisher sends the bad messages: nobody else may.
	publishers := map[string]jetstream.JetStream{}
	// Partition 0 of each region, whichever partition k is in.
	usEast, euWest := gossip.PartitionSubject("us-east", 0), gossip.PartitionSubject("eu-west", 0)
	for subject, name := range map[string]string{
		usEast:                         "reconciler-us-east",
		euWest:                         "reconciler-eu-west",
		gossip.LocalSubject("us-east"): "limiterd-us-east",
	} {
		js, err := jetstream.New(s.connectAs(name))
		if err != nil {
			t.Fatal(err)
		}
		publishers[subject] = js
	}
	ctx := context.Background()
	misaddressed, _ := gossip.Split(gossip.Header{Region: "eu-west", Instance: "x", Sequence: 1, FirstAdmitted: 1, Flushed: 1},
		[]gossip.Spend{{Rule: "quota", Key: "k", Cost: 1000}}, gossip.DefaultMaxMessageBytes)
	invalid, _ := proto.Marshal(&gossipv1.SpendBatch{Region: "eu-west", Instance: "x", Parts: 1, FirstAdmittedUnixMicros: 1,
		FlushedUnixMicros: 1, Spends: []*gossipv1.Spend{{RuleId: "quota", Key: "k", Cost: math.Inf(1)}}})
	for subject, data := range map[string][]byte{
		usEast:                         []byte("not a protobuf \xff\xff"),
		euWest:                         invalid,
		gossip.LocalSubject("us-east"): misaddressed[0],
	} {
		if _, err := publishers[subject].Publish(ctx, subject, data); err != nil {
			t.Fatalf("publish to %s: %v", subject, err)
		}
	}
	// The misaddressed batch again, on a partition of us-east's spends.
	if _, err := publishers[usEast].Publish(ctx, usEast, misaddressed[0]); err != nil {
		t.Fatal(err)
	}
	s.send("us-east", "k", 3)
	s.send("eu-west", "k", 4)
	s.converge("k", 7)
	rejected := func() float64 {
		n := 0.0
		for _, name := range stackRegions {
			n += testutil.ToFloat64(s.regions[name].recs[0].m.apply.Rejected)
		}
		return n
	}
	invalidSkipped := func() float64 {
		return testutil.ToFloat64(s.regions["us-east"].recs[0].m.apply.Invalid.WithLabelValues("eu-west"))
	}
	// The bad messages on partition 0 are read in order with k's spends
	// only when k is in partition 0.
	testenv.WaitFor(t, "the bad messages read", func() bool { return rejected() >= 3 && invalidSkipped() >= 1 })
	// The batch with one infinite cost is not refused whole: that entry is.
	if got := rejected(); got != 3 {
		t.Fatalf("%v messages rejected, want 3", got)
	}
	if got := invalidSkipped(); got != 1 {
		t.Fatalf("%v invalid entries skipped in us-east, want 1", got)
	}
}

func TestReconcilerMetricsLint(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)
	s.send("us-east", "k", 1)
	s.converge("k", 1)
	for _, name := range stackRegions {
		rec := s.regions[name].recs[0]
		mfs, err := rec.Registry().Gather()
		if err != nil {
			t.Fatal(err)
		}
		testenv.Lint(t, mfs)
	}
	// eu-west applied us-east's spend, and measured its lag.
	rec := s.regions["eu-west"].recs[0]
	if got := testutil.ToFloat64(rec.m.apply.Applied.WithLabelValues("us-east")); got != 1 {
		t.Errorf("applied = %v, want 1", got)
	}
	if n := testutil.CollectAndCount(rec.m.apply.Lag); n != 1 {
		t.Errorf("lag histogram has %d series, want 1", n)
	}
}

func TestBadOptions(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	writeFile(t, dir, "rules.yml", quotaRules)
	writeFile(t, dir, "topology.yml", "regions:\n  - name: us-east\n    limiter_address: 127.0.0.1:1\n")
	good := func() Options {
		o := DefaultOptions()
		o.Region, o.TopologyFile, o.RulesFile = "us-east", filepath.Join(dir, "topology.yml"), filepath.Join(dir, "rules.yml")
		o.NATSURL, o.Redis, o.Logger = "nats://127.0.0.1:1", redisstore.Conn{Addrs: []string{"127.0.0.1:1"}}, quiet()
		return o
	}
	if _, err := New(good()); err != nil {
		t.Fatalf("good options: %v", err)
	}
	tests := []struct {
		name   string
		mutate func(*Options)
		flag   string
	}{
		{"no region", func(o *Options) { o.Region = "" }, "--region"},
		{"region not in topology", func(o *Options) { o.Region = "eu-west" }, "--region"},
		{"no nats", func(o *Options) { o.NATSURL = "" }, "--nats.url"},
		{"no redis", func(o *Options) { o.Redis.Addrs = nil }, "--redis.addrs"},
		{"interval too short", func(o *Options) { o.Interval = time.Millisecond }, "--gossip.interval"},
		{"missing rules", func(o *Options) { o.RulesFile = filepath.Join(dir, "none.yml") }, "--rules.file"},
		{"missing topology", func(o *Options) { o.TopologyFile = filepath.Join(dir, "none.yml") }, "--region.topology-file"},
		{"tiny stream", func(o *Options) { o.StreamMaxBytes = 10 }, "--stream.max-bytes"},
		{"nats creds and seed", func(o *Options) { o.NATSAuth = natsconn.Auth{CredsFile: "a", NkeySeedFile: "b"} }, "--nats.creds-file and --nats.nkey-seed-file"},
		{"nats half client cert", func(o *Options) { o.NATSAuth = natsconn.Auth{TLSKeyFile: "k.pem"} }, "--nats.tls-cert-file and --nats.tls-key-file"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := good()
			tt.mutate(&o)
			_, err := New(o)
			if err == nil || !strings.Contains(err.Error(), tt.flag) {
				t.Fatalf("New = %v, want an error naming %s", err, tt.flag)
			}
		})
	}
}
