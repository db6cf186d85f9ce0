package soak

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc/codes"

	"github.com/limiterd/limiterd/internal/reconciler"
	"github.com/limiterd/limiterd/internal/reconciler/lease"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/spendpub"
	"github.com/limiterd/limiterd/pkg/gossip"
	"github.com/limiterd/limiterd/pkg/region"
)

var (
	flagDuration = flag.Duration("soak.duration", 35*time.Second, "how long the soak sends traffic and injects faults (make soak: 3m)")
	flagSeed     = flag.Uint64("soak.seed", 0, "seed of the traffic and the faults (0: from the clock; printed, to replay a run)")
	flagRate     = flag.Int("soak.rate", 450, "checks per second, over the three regions")
	flagInterval = flag.Duration("soak.gossip-interval", 250*time.Millisecond, "--gossip.interval of the daemons")
	flagMaxDefer = flag.Duration("soak.max-defer", spendpub.DefaultMaxDefer, "--gossip.max-defer of the limiterds")
	flagWAN      = flag.String("soak.wan", defaultWAN, `one-way delays between the regions, on their NATS gateways and forwarded checks: a/b=duration pairs, one duration for all, or "0" for none`)
	flagFaults   = flag.Bool("soak.faults", true, "inject faults (false: traffic only, to compare)")
	flagDir      = flag.String("soak.dir", "", "directory for the daemons' files and logs, kept after the run (default: a temporary one, removed)")
	flagBreak    = flag.String("soak.break", "", `break an invariant on purpose, to see the audit catch it: "replay" publishes a flush again under a new message id, its flush records deleted; "unreconciled" runs the slow and fast shapes with reconcile: false`)
)

// drainTimeout bounds the wait, after the soak, for every stream to be
// applied.
const drainTimeout = 2 * time.Minute

// TestSoak is the chaos soak: three regions under Zipf traffic while
// faults are injected at random, then an audit of the regions' own
// records (see "Chaos soak" in docs/multi-region.md). It fails on a broken invariant,
// naming the seed and the key.
func TestSoak(t *testing.T) {
	rules := soakRules
	switch *flagBreak {
	case "", "replay":
	case "unreconciled":
		// Each region then enforces the whole limit alone: about three
		// times it over the regions, which the bound must refuse.
		rules = strings.Replace(soakRules, "    refill_per_second: 20\n", "    refill_per_second: 20\n    reconcile: false\n", 1)
		rules = strings.Replace(rules, "    refill_per_second: 100\n", "    refill_per_second: 100\n    reconcile: false\n", 1)
	default:
		t.Fatalf("-soak.break=%q: replay or unreconciled", *flagBreak)
	}
	seed := *flagSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	dur := *flagDuration
	delays, err := parseWAN(*flagWAN)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("soak: duration %v, seed %d (replay with -soak.seed=%d), WAN %v", dur, seed, seed, delays)
	began := time.Now()
	s := newStack(t, rules, *flagInterval, *flagMaxDefer, delays)
	t.Logf("stack up in %v", time.Since(began).Round(100*time.Millisecond))

	start := time.Now()
	rec := &recorder{began: start, log: make([][]answer, len(regions))}
	pr := newProbes(start)
	d := &driver{s: s, began: start, rng: rand.New(rand.NewPCG(seed, 0)), scale: min(1, dur.Seconds()/180),
		scrapes: map[string][]string{}}

	ctx, cancel := context.WithTimeout(context.Background(), dur)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() { s.runTraffic(ctx, rec, seed, *flagRate/len(regions)) })
	wg.Go(func() { pr.run(ctx, s) })
	if *flagFaults {
		wg.Go(func() { d.run(ctx) })
	}
	wg.Wait()
	soaked := time.Since(start)
	t.Logf("traffic stopped after %v, faults healed", soaked.Round(100*time.Millisecond))
	if t.Failed() {
		t.FailNow()
	}

	drained, why := s.drain(t)
	if !drained {
		t.Errorf("streams not drained %v after the soak: %s", drainTimeout, why)
	}
	if *flagBreak == "replay" {
		s.replay(t)
		if ok, why := s.drain(t); !ok {
			t.Errorf("not drained after the replay: %s", why)
		}
	}

	in := auditInput{interval: *flagInterval, maxDefer: *flagMaxDefer, delay: delays.longest(), answers: rec.all(), faults: d.faults, probes: pr}
	topo, err := region.Load(filepath.Join(s.dir, "topology.yml"))
	if err != nil {
		t.Fatal(err)
	}
	in.home = func(key string) string { return topo.Home(key, nil) }
	// The JetStream API may still be electing leaders after the last
	// fault (a stream's leader in a region whose server was killed late):
	// tries for up to two minutes.
	for deadline := time.Now().Add(2 * time.Minute); ; {
		flushLog = nil
		err := s.readRecords(t, &in, pr)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("read the records: %v", err)
		}
		t.Logf("read the records: %v; again in 2 s", err)
		time.Sleep(2 * time.Second)
	}
	for _, name := range regions {
		r := s.regions[name]
		d.scrape(r.rec.name, r.rec.httpAddr)
		d.scrape(r.lim.name, r.lim.httpAddr)
	}
	lag := mergeHistograms(d.scrapes, "reconciler-", "limiter_reconcile_lag_seconds")
	lag50, lag99 := quantileBound(lag, 0.5), quantileBound(lag, 0.99)
	decisions := counterByLabels(d.scrapes, "limiterd-", "limiter_decisions_total", "rule", "result")
	in.closedUnstored = decisions["closed/fallback_allowed"] + decisions["closed/uncertain_allowed"]

	res := audit(in)
	var b strings.Builder
	report(&b, soaked, seed, in, res, lag50, lag99, lag.GetSampleCount())
	var notStore []string
	for _, k := range sortedKeys(decisions) {
		rule, result, _ := strings.Cut(k, "/")
		if decisions[k] != 0 && (strings.HasPrefix(result, "fallback") || result == "uncertain_allowed" || result == "error") {
			notStore = append(notStore, fmt.Sprintf("%s %s %.0f", rule, result, decisions[k]))
		}
	}
	fmt.Fprintf(&b, "not by store %s (limiter_decisions_total, every limiterd run)\n", strings.Join(notStore, ", "))
	injected := map[string]bool{}
	for _, f := range d.faults {
		t.Logf("fault: %s", f)
		injected[f.kind] = true
		if f.kind == faultSwitch && f.err != "" {
			t.Errorf("topology switch: %s", f.err)
		}
	}
	for _, k := range faultKinds {
		if *flagFaults && !injected[k] {
			t.Logf("no %s in this run: too short for it after the others (the order of the first faults comes from the seed)", k)
		}
	}
	byFault, outside := errorsByFault(in.answers, d.faults, in.home)
	t.Logf("errors, by code and by the fault active in their region (or a pinned key's home) when they were sent: %s", byFault)
	t.Logf("errors outside every fault, by region and 10 s of the run: %s", outside)
	t.Logf("flushes in the spends streams: %s", strings.Join(flushLog, "; "))
	fmt.Println(b.String())

	if *flagBreak != "" {
		if len(res.failures) == 0 {
			t.Fatalf("-soak.break=%s: the audit found nothing broken", *flagBreak)
		}
		t.Logf("-soak.break=%s: the audit caught it, as it should:\n%s", *flagBreak, strings.Join(res.failures, "\n"))
		return
	}
	for _, f := range res.failures {
		t.Errorf("seed %d: %s", seed, f)
	}
	if t.Failed() {
		t.Logf("daemon logs in %s (kept: -test.count=1 with TMPDIR set; or see the tails below)", s.dir)
		for _, name := range regions {
			r := s.regions[name]
			t.Logf("--- %s\n%s\n--- %s\n%s", r.lim.name, tail(r.lim.logPath), r.rec.name, tail(r.rec.logPath))
		}
	}
}

// drain waits until every region has applied everything: the limiterds'
// held keys published (they are not to be seen from outside: max-defer
// after the traffic stopped, each has), their backlogs published, the
// local streams relayed, the inbound streams caught up with their sources
// and read, the retry streams empty; twice in a row, a second apart.
func (s *stack) drain(t *testing.T) (bool, string) {
	time.Sleep(3*s.interval + s.maxDefer)
	nc, err := s.ops(regions[0])
	if err != nil {
		return false, err.Error()
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return false, err.Error()
	}
	deadline := time.Now().Add(drainTimeout)
	calm := 0
	var why string
	for calm < 2 {
		if time.Now().After(deadline) {
			return false, why
		}
		time.Sleep(time.Second)
		why = s.pending(js)
		if why == "" {
			calm++
		} else {
			calm = 0
		}
	}
	return true, ""
}

// pending says what is not applied yet, "" when nothing.
func (s *stack) pending(js jetstream.JetStream) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, name := range regions {
		r := s.regions[name]
		if v := metricValue(scrape(r.lim.httpAddr), "limiter_spend_backlog_messages"); v != 0 {
			return fmt.Sprintf("%s: backlog %v", r.lim.name, v)
		}
		for _, st := range []string{gossip.LocalStream(name), gossip.RetryStream(name)} {
			info, err := streamInfo(ctx, js, st)
			if err != nil {
				return err.Error()
			}
			if info.State.Msgs != 0 {
				return fmt.Sprintf("%s holds %d messages", st, info.State.Msgs)
			}
		}
		// Every message of the others' spends streams has reached this
		// region's inbound stream (a source's lag says nothing of a source
		// that has not found its stream yet).
		in, err := js.Stream(ctx, gossip.InStream(name))
		if err != nil {
			return err.Error()
		}
		info, err := in.Info(ctx, jetstream.WithSubjectFilter(gossip.RelaySubjectPrefix+">"))
		if err != nil {
			return err.Error()
		}
		for _, src := range regions {
			if src == name {
				continue
			}
			spends, err := streamInfo(ctx, js, gossip.RegionStream(src))
			if err != nil {
				return err.Error()
			}
			var got uint64 // its partitions'
			for subject, n := range info.State.Subjects {
				if strings.HasPrefix(subject, gossip.RelaySubjectPrefix+src+".") {
					got += n
				}
			}
			if got < spends.State.Msgs {
				return fmt.Sprintf("%s holds %d of the %d messages of %s", gossip.InStream(name), got, spends.State.Msgs, gossip.RegionStream(src))
			}
		}
		// Every partition (the reconcilers run with the default
		// --apply.partitions) is applied up to its last message: the
		// position its reconciler stored is there.
		epoch := max(info.Created.UnixMicro(), 1)
		for _, src := range regions {
			if src == name {
				continue
			}
			for p := range reconciler.DefaultPartitions {
				last, err := in.GetLastMsgForSubject(ctx, gossip.PartitionSubject(src, p))
				if errors.Is(err, jetstream.ErrMsgNotFound) {
					continue
				}
				if err != nil {
					return fmt.Sprintf("%s, last of %s: %v", gossip.InStream(name), gossip.PartitionSubject(src, p), err)
				}
				pos, err := lease.ReadPosition(ctx, r.rc, name, lease.Item{Source: src, Partition: p}, epoch)
				if err != nil {
					return fmt.Sprintf("%s: %v", name, err)
				}
				if pos < last.Sequence {
					return fmt.Sprintf("%s: partition %d of %s applied up to %d of %d", name, p, src, pos, last.Sequence)
				}
			}
		}
	}
	return ""
}

func streamInfo(ctx context.Context, js jetstream.JetStream, name string) (*jetstream.StreamInfo, error) {
	st, err := js.Stream(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", name, err)
	}
	return st.CachedInfo(), nil
}

// flushLog says, per instance, what its flushes in the spends streams are.
var flushLog []string

// flushName names a flush part: instance, flush number, part.
type flushName struct {
	instance string
	seq      uint64
	part     uint32
	// subject is the partition's: the relay splits one part of a flush
	// into a message per partition, each with the part's name.
	subject string
}

// readSpends reads src's whole spends stream: the ledger rule's tokens by
// key over the distinct flushes, their count, and how many messages named
// a flush already seen.
func readSpends(ctx context.Context, js jetstream.JetStream, src string, each func(seq uint64, subject string, data []byte)) (map[string]float64, int, int, error) {
	info, err := streamInfo(ctx, js, gossip.RegionStream(src))
	if err != nil {
		return nil, 0, 0, err
	}
	last := info.State.LastSeq
	tokens := map[string]float64{}
	seen := map[flushName]bool{}
	ranges := map[string]*[3]uint64{}
	defer func() {
		for inst, r := range ranges {
			flushLog = append(flushLog, fmt.Sprintf("%s: %d messages, flushes %d..%d", inst, r[2], r[0], r[1]))
		}
	}()
	replays := 0
	if info.State.Msgs == 0 {
		return tokens, 0, 0, nil
	}
	cons, err := js.OrderedConsumer(ctx, gossip.RegionStream(src), jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy})
	if err != nil {
		return nil, 0, 0, fmt.Errorf("ordered consumer of %s: %w", gossip.RegionStream(src), err)
	}
	for {
		batch, err := cons.Fetch(500, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return nil, 0, 0, fmt.Errorf("fetch from %s: %w", gossip.RegionStream(src), err)
		}
		n := 0
		done := false
		for msg := range batch.Messages() {
			n++
			meta, err := msg.Metadata()
			if err != nil {
				return nil, 0, 0, err
			}
			b, err := gossip.Decode(msg.Data(), 1<<20)
			if err != nil {
				return nil, 0, 0, fmt.Errorf("%s message %d: %w", gossip.RegionStream(src), meta.Sequence.Stream, err)
			}
			if each != nil {
				each(meta.Sequence.Stream, msg.Subject(), msg.Data())
			}
			name := flushName{b.GetInstance(), b.GetSequence(), b.GetPart(), msg.Subject()}
			if r := ranges[b.GetInstance()]; r == nil {
				ranges[b.GetInstance()] = &[3]uint64{b.GetSequence(), b.GetSequence(), 1}
			} else {
				r[0], r[1], r[2] = min(r[0], b.GetSequence()), max(r[1], b.GetSequence()), r[2]+1
			}
			if seen[name] {
				replays++
			} else {
				seen[name] = true
				for _, sp := range b.GetSpends() {
					if sp.GetRuleId() == ruleIDs[ruleLedger] {
						tokens[sp.GetKey()] += sp.GetCost()
					}
				}
			}
			if meta.Sequence.Stream >= last {
				done = true
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return nil, 0, 0, fmt.Errorf("fetch from %s: %w", gossip.RegionStream(src), err)
		}
		if done {
			return tokens, len(seen), replays, nil
		}
		if n == 0 {
			return nil, 0, 0, fmt.Errorf("%s: stopped short of message %d", gossip.RegionStream(src), last)
		}
	}
}

// readSpendsIn is readSpends of src's spends stream through src's own
// NATS servers.
func (s *stack) readSpendsIn(ctx context.Context, src string) (map[string]float64, int, int, error) {
	nc, err := s.ops(src)
	if err != nil {
		return nil, 0, 0, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, 0, 0, err
	}
	return readSpends(ctx, js, src, nil)
}

// readRecords reads what the regions recorded: every spends stream, and
// the ledger and fail-closed counts in every region's Redis.
func (s *stack) readRecords(t *testing.T, in *auditInput, pr *probes) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	in.published, in.flushes, in.replays = map[string]map[string]float64{}, map[string]int{}, map[string]int{}
	ledgerKeys := map[string]bool{}
	for _, src := range regions {
		// Each region's spends stream is read in its own region, as an
		// operator there would: read from us-east, eu-west's met "no
		// responders" on every pull for two minutes after one run's
		// faults (seed 1796582928294590433), while the reconcilers
		// sourced it.
		tokens, n, replays, err := s.readSpendsIn(ctx, src)
		if err != nil {
			return err
		}
		in.published[src], in.flushes[src], in.replays[src] = tokens, n, replays
		for k := range tokens {
			ledgerKeys[k] = true
		}
		for i := range numKeys {
			ledgerKeys[keyName(ruleLedger, src, i)] = true
		}
	}
	for si := range regions {
		for th := range 3 {
			for _, tk := range pr.admitted[si][th] {
				ledgerKeys[tk.key] = true
			}
		}
	}
	in.counts, in.closedCounts = map[string]map[string]float64{}, map[string]map[string]float64{}
	closedKeys := map[string]bool{}
	for i := range numKeys {
		closedKeys[keyName(ruleClosed, "", i)] = true
	}
	for _, name := range regions {
		rc := s.regions[name].rc
		var err error
		if in.counts[name], err = windowCounts(ctx, rc, ruleIDs[ruleLedger], ledgerKeys); err != nil {
			return err
		}
		if in.closedCounts[name], err = windowCounts(ctx, rc, ruleIDs[ruleClosed], closedKeys); err != nil {
			return err
		}
	}
	return nil
}

// windowCounts reads the count of each key of a fixed window rule
// ("index count"), leaving out the keys that have none.
func windowCounts(ctx context.Context, rc *redis.ClusterClient, rule string, keys map[string]bool) (map[string]float64, error) {
	names := sortedKeys(keys)
	out := map[string]float64{}
	for len(names) > 0 {
		n := min(len(names), 500)
		pipe := rc.Pipeline()
		cmds := make([]*redis.StringCmd, n)
		for i, k := range names[:n] {
			cmds[i] = pipe.Get(ctx, redisstore.Key(rule, k))
		}
		_, _ = pipe.Exec(ctx)
		for i, cmd := range cmds {
			v, err := cmd.Result()
			if errors.Is(err, redis.Nil) {
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("get %s: %w", redisstore.Key(rule, names[i]), err)
			}
			f := strings.Fields(v)
			if len(f) != 2 {
				return nil, fmt.Errorf("%s: state %q", redisstore.Key(rule, names[i]), v)
			}
			c, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				return nil, fmt.Errorf("%s: state %q: %w", redisstore.Key(rule, names[i]), v, err)
			}
			out[names[i]] = c
		}
		names = names[n:]
	}
	return out, nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func sortedFloat[V any](m map[float64]V) []float64 {
	keys := make([]float64, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// replay breaks the exactly-once invariant on purpose: it takes one flush
// of us-east's spends stream that carries ledger spends, deletes its flush
// records in eu-west's Redis and publishes it again under a new message
// id, as a relay replaying an old flush would. eu-west then applies it a
// second time; the ledger must say so.
func (s *stack) replay(t *testing.T) {
	src, dst := regions[0], regions[1]
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	nc, err := s.ops(src)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var data []byte
	var subject string
	if _, _, _, err := readSpends(ctx, js, src, func(_ uint64, subj string, d []byte) {
		if data != nil {
			return
		}
		b, err := gossip.Decode(d, 1<<20)
		if err != nil {
			return
		}
		for _, sp := range b.GetSpends() {
			if sp.GetRuleId() == ruleIDs[ruleLedger] {
				data, subject = d, subj
				return
			}
		}
	}); err != nil {
		t.Fatal(err)
	}
	if data == nil {
		t.Fatal("replay: no flush with ledger spends")
	}
	b, _ := gossip.Decode(data, 1<<20)
	rc := s.regions[dst].rc
	// The records of the flush part: the partition's (its source is
	// "region.p", the subject's last token).
	p, ok := strings.CutPrefix(subject, gossip.RelaySubjectPrefix+src+".")
	if !ok {
		t.Fatalf("replay: flush read on %s, not a partition's subject of %s", subject, src)
	}
	rs := src + "." + p
	keys := []string{redisstore.MessageKey(rs, b.GetInstance(), b.GetSequence(), b.GetPart())}
	for i := 1; i <= 32; i++ {
		keys = append(keys, redisstore.MessageKey(rs, b.GetInstance()+"/"+strconv.Itoa(i), b.GetSequence(), b.GetPart()))
	}
	for _, k := range keys {
		if err := rc.Del(ctx, k).Err(); err != nil {
			t.Fatal(err)
		}
	}
	// On the subject it was read from: its partition's consumer, markers
	// and records.
	if _, err := js.Publish(ctx, subject, data, jetstream.WithMsgID("soak-replay")); err != nil {
		t.Fatal(err)
	}
	t.Logf("replay: flush %s-%d-%d of %s published again, its records in %s deleted", b.GetInstance(), b.GetSequence(), b.GetPart(), src, dst)
}

// mergeHistograms sums the histogram name over every scrape of the
// daemons whose names start with prefix.
func mergeHistograms(scrapes map[string][]string, prefix, name string) *dto.Histogram {
	bounds := map[float64]uint64{}
	var count uint64
	var sum float64
	for daemon, texts := range scrapes {
		if !strings.HasPrefix(daemon, prefix) {
			continue
		}
		for _, text := range texts {
			mf := parse(text)[name]
			if mf == nil {
				continue
			}
			for _, m := range mf.GetMetric() {
				h := m.GetHistogram()
				count += h.GetSampleCount()
				sum += h.GetSampleSum()
				for _, bk := range h.GetBucket() {
					bounds[bk.GetUpperBound()] += bk.GetCumulativeCount()
				}
			}
		}
	}
	h := &dto.Histogram{SampleCount: &count, SampleSum: &sum}
	for _, ub := range sortedFloat(bounds) {
		c := bounds[ub]
		h.Bucket = append(h.Bucket, &dto.Bucket{UpperBound: &ub, CumulativeCount: &c})
	}
	return h
}

// counterByLabels sums the counter name over every scrape of the daemons
// whose names start with prefix, by the values of labels joined by "/".
func counterByLabels(scrapes map[string][]string, prefix, name string, labels ...string) map[string]float64 {
	out := map[string]float64{}
	for daemon, texts := range scrapes {
		if !strings.HasPrefix(daemon, prefix) {
			continue
		}
		for _, text := range texts {
			mf := parse(text)[name]
			if mf == nil {
				continue
			}
			for _, m := range mf.GetMetric() {
				var vals []string
				for _, l := range labels {
					for _, lp := range m.GetLabel() {
						if lp.GetName() == l {
							vals = append(vals, lp.GetValue())
						}
					}
				}
				out[strings.Join(vals, "/")] += m.GetCounter().GetValue()
			}
		}
	}
	return out
}

// metricValue is the value of an unlabelled gauge or counter, -1 if absent.
func metricValue(text, name string) float64 {
	mf := parse(text)[name]
	if mf == nil || len(mf.GetMetric()) == 0 {
		return -1
	}
	m := mf.GetMetric()[0]
	if m.GetGauge() != nil {
		return m.GetGauge().GetValue()
	}
	return m.GetCounter().GetValue()
}

func parse(text string) map[string]*dto.MetricFamily {
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, _ := p.TextToMetricFamilies(strings.NewReader(text))
	return mfs
}

// quantileBound is the upper bound of the histogram bucket holding the
// quantile q.
func quantileBound(h *dto.Histogram, q float64) string {
	target := q * float64(h.GetSampleCount())
	for _, b := range h.GetBucket() {
		if float64(b.GetCumulativeCount()) >= target {
			return fmt.Sprintf("%gs", b.GetUpperBound())
		}
	}
	return "+Inf"
}

// afterFault is how long after a fault's end errors count as after it.
const afterFault = 5 * time.Second

// errorsByFault counts the answers that are errors by code and by the
// kinds of fault active in their region (or across it, for a cut) when
// they were sent, or in the home region of a pinned key (home), which
// decides it; else of the faults that ended there within afterFault;
// "none" outside every fault, by rule.
// The second result counts the errors outside every fault by region and
// 10 s slot of the run, to tell a burst from a trickle.
func errorsByFault(answers []answer, faults []*fault, home func(key string) string) (string, string) {
	n := map[string]int{}
	outside := map[string]int{}
	for _, a := range answers {
		if a.code == 0 {
			continue
		}
		in := []string{regions[a.region]}
		if int(a.rule) == rulePinned {
			if h := home(keyName(rulePinned, regions[a.region], int(a.key))); h != in[0] {
				in = append(in, h)
			}
		}
		var kinds []string
		for _, f := range faults {
			if (slices.Contains(in, f.region) || slices.Contains(in, f.other)) && a.sent >= f.start && a.sent <= f.end && !slices.Contains(kinds, f.kind) {
				kinds = append(kinds, f.kind)
			}
		}
		if len(kinds) == 0 {
			// Within afterFault of a fault's end: clients reconnect, a
			// cluster's map is read again.
			for _, f := range faults {
				if (slices.Contains(in, f.region) || slices.Contains(in, f.other)) && a.sent > f.end && a.sent <= f.end+afterFault.Nanoseconds() &&
					!slices.Contains(kinds, "after "+f.kind) {
					kinds = append(kinds, "after "+f.kind)
				}
			}
		}
		if len(kinds) == 0 {
			// Outside every fault: by rule, to tell where to look.
			kinds = []string{"none, rule " + ruleIDs[a.rule]}
			slot := a.sent / int64(10*time.Second) * 10
			outside[fmt.Sprintf("%s %03d-%03ds", regions[a.region], slot, slot+10)]++
		}
		slices.Sort(kinds)
		n[codes.Code(a.code).String()+" during "+strings.Join(kinds, "+")]++
	}
	var out, slots []string
	for _, k := range sortedKeys(n) {
		out = append(out, fmt.Sprintf("%s: %d", k, n[k]))
	}
	for _, k := range sortedKeys(outside) {
		slots = append(slots, fmt.Sprintf("%s: %d", k, outside[k]))
	}
	return strings.Join(out, "; "), strings.Join(slots, "; ")
}
