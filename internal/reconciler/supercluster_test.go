package reconciler

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// The reference deployment: three regions, each its own NATS cluster of
// three servers (so the streams have three replicas), joined by gateways.
var superRegions = []string{"us-east", "eu-west", "ap-south"}

const superServers = 3

// TestSupercluster runs three regions, each with its Redis Cluster,
// limiterd and reconciler connected to its own NATS cluster of a
// supercluster, and checks what the design promises of it: every spend
// applied once in every other region, streams in their region's cluster;
// a cut gateway delays only the spends that cross it; a NATS server of a
// region may die without a spend being lost.
func TestSupercluster(t *testing.T) {
	t.Parallel()
	began := time.Now()
	s := newSuperStack(t, superRegions, superServers, quotaRules, 200*time.Millisecond)
	t.Logf("stack up in %v", time.Since(began).Round(10*time.Millisecond))
	t.Run("applied_everywhere_once", func(t *testing.T) {
		s.t = t
		superAppliedEverywhere(t, s)
		t.Log("steady state:")
		s.logLag(t)
	})
	t.Run("gateway_cut", func(t *testing.T) { s.t = t; superGatewayCut(t, s) })
	t.Run("server_down", func(t *testing.T) { s.t = t; superServerDown(t, s) })
	s.t = t
	t.Log("over the whole test, the cut and the dead server included:")
	s.logLag(t)
}

// superAppliedEverywhere: spends admitted in each region are applied in
// every other region exactly once, and every stream of a region is placed
// in its own cluster with a replica on each of its servers.
func superAppliedEverywhere(t *testing.T, s *stack) {
	want := map[string]float64{"shared": 0}
	for i, r := range s.names {
		n := 20 + 10*i
		s.send(r, "from-"+r, n)
		s.send(r, "shared", 5)
		want["from-"+r] = float64(n)
		want["shared"] += 5
	}
	took := s.convergeAll(want)
	t.Logf("every spend applied in every region %v after the last check", took.Round(time.Millisecond))

	js := s.opsJetStream(t, s.names[0])
	for _, r := range s.names {
		servers := map[string]bool{}
		for _, srv := range s.super.Servers(r) {
			servers[srv.Name()] = true
		}
		for _, name := range []string{gossip.LocalStream(r), gossip.RegionStream(r), gossip.InStream(r), gossip.RetryStream(r)} {
			st, err := js.Stream(t.Context(), name)
			if err != nil {
				t.Fatalf("stream %s: %v", name, err)
			}
			c := st.CachedInfo().Cluster
			if c == nil || c.Name != r {
				t.Errorf("stream %s is placed in cluster %v, want %s", name, c, r)
				continue
			}
			peers := []string{c.Leader}
			for _, p := range c.Replicas {
				peers = append(peers, p.Name)
			}
			for _, p := range peers {
				if !servers[p] {
					t.Errorf("stream %s has a replica on %s, not a server of %s", name, p, r)
				}
			}
			if len(peers) != s.replicas {
				t.Errorf("stream %s has %d replicas (%v), want %d", name, len(peers), peers, s.replicas)
			}
		}
	}

	// Admission to debit, one check at a time, from each region to the
	// others.
	for _, src := range s.names {
		var lags []time.Duration
		for i := range 8 {
			key := fmt.Sprintf("lag-%s-%d", src, i)
			start := time.Now()
			s.send(src, key, 1)
			for _, dst := range s.names {
				for dst != src && s.count(dst, key) != 1 {
					if time.Since(start) > 30*time.Second {
						t.Fatalf("spend of %s not applied in %s after 30s", key, dst)
					}
					time.Sleep(5 * time.Millisecond)
				}
			}
			lags = append(lags, time.Since(start))
		}
		slices.Sort(lags)
		t.Logf("admission in %s to debit in both other regions: median %v, max %v (8 checks, interval %v)",
			src, lags[len(lags)/2].Round(time.Millisecond), lags[len(lags)-1].Round(time.Millisecond), s.interval)
	}
}

// superGatewayCut cuts the gateways between us-east and eu-west for 10 s
// under steady traffic in all three regions. Across the cut nothing is
// applied; every other pair keeps flowing, and ap-south keeps receiving
// from both sides. After the heal the delayed spends are applied, none
// twice.
//
// What it catches: if the regions shared one stream, or one region's
// cluster held what another region applies, the spends of one side of the
// cut would stop reaching ap-south too (or stop being relayed at all), and
// the "keeps flowing" checks fail. (Placing every region's spends stream
// in us-east's cluster makes it fail so: ap-south then applies none of
// eu-west's spends during the cut, and eu-west none of ap-south's.)
func superGatewayCut(t *testing.T, s *stack) {
	tr := s.startTraffic(50 * time.Millisecond)
	defer tr.stop()
	s.waitFlowing(tr)

	a, b, c := "us-east", "eu-west", "ap-south"
	s.super.Cut(a, b)
	cutAt := time.Now()
	type pair struct{ dst, src string }
	across := []pair{{a, b}, {b, a}}
	// Spends already in the inbound streams when the gateway went are
	// applied first: a fixed wait for them was too short on a busy machine.
	time.Sleep(time.Second)
	for _, p := range across {
		s.waitDrained(p.dst, p.src, 30*time.Second)
	}
	flowing := []pair{{c, a}, {c, b}, {a, c}, {b, c}}
	before := map[pair]float64{}
	for _, p := range append(across, flowing...) {
		before[p] = s.count(p.dst, tr.key(p.src))
	}
	sentBefore := tr.snapshot()
	time.Sleep(8 * time.Second)
	sentDuring := tr.snapshot()
	for _, p := range across {
		if got := s.count(p.dst, tr.key(p.src)); got != before[p] {
			t.Errorf("%s applied %v of %s's spends while the gateway between them was cut (%v before): they crossed the cut", p.dst, got-before[p], p.src, before[p])
		}
	}
	for _, p := range flowing {
		got := s.count(p.dst, tr.key(p.src)) - before[p]
		sent := sentDuring[p.src] - sentBefore[p.src]
		t.Logf("during the cut %s applied %v of the %v spends %s admitted in the same 8 s", p.dst, got, sent, p.src)
		// A loaded machine may take longer than 8 s to carry a spend
		// (the traffic itself then makes a tenth of its checks): wait
		// up to 30 s more, the gateway still cut. A cut that stopped
		// this pair applies nothing however long it waits.
		for deadline := time.Now().Add(30 * time.Second); got <= 0 && time.Now().Before(deadline); {
			time.Sleep(200 * time.Millisecond)
			got = s.count(p.dst, tr.key(p.src)) - before[p]
		}
		if got <= 0 {
			t.Errorf("%s applied none of %s's spends during the cut of %s-%s: a cut it is not part of stopped it", p.dst, p.src, a, b)
		}
	}
	want := tr.stop()
	healAt := time.Now()
	s.super.Heal(a, b)
	t.Logf("gateway %s-%s cut for %v", a, b, healAt.Sub(cutAt).Round(10*time.Millisecond))
	for _, p := range across {
		k := tr.key(p.src)
		deadline := healAt.Add(2 * time.Minute)
		for s.count(p.dst, k) < want[k] {
			if time.Now().After(deadline) {
				s.logSource(t, p.dst, p.src)
				t.Fatalf("%s: %v of %s's %v spends applied 2 minutes after the heal", p.dst, s.count(p.dst, k), p.src, want[k])
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Logf("heal to every delayed spend of %s applied in %s: %v", p.src, p.dst, time.Since(healAt).Round(10*time.Millisecond))
	}
	s.convergeAll(want)
}

// superServerDown kills the NATS server leading eu-west's spends stream
// under steady traffic: the streams it led elect a leader among their
// other replicas, the daemons connected to it move to the region's other
// servers, and every spend is applied once. The server is then started
// again.
//
// The other regions read eu-west's spends stream through an ephemeral
// consumer that nats-server keeps on the stream's leader; after the leader
// dies, a sourcing stream notices only when it has heard nothing for
// sourceHealthCheckInterval (10 s in nats-server v2.15), so those spends
// resume a little later than eu-west's own applying: the time is logged.
func superServerDown(t *testing.T, s *stack) {
	const r = "eu-west"
	tr := s.startTraffic(50 * time.Millisecond)
	defer tr.stop()
	s.waitFlowing(tr)
	js := s.opsJetStream(t, "ap-south")
	st, err := js.Stream(t.Context(), gossip.RegionStream(r))
	if err != nil {
		t.Fatal(err)
	}
	victimName := st.CachedInfo().Cluster.Leader
	var victim *natstest.Server
	for _, srv := range s.super.Servers(r) {
		if srv.Name() == victimName {
			victim = srv
		}
	}
	if victim == nil {
		t.Fatalf("the leader of %s, %q, is not a server of %s", gossip.RegionStream(r), victimName, r)
	}
	var led []string
	for _, name := range []string{gossip.LocalStream(r), gossip.RegionStream(r), gossip.InStream(r), gossip.RetryStream(r)} {
		if st, err := js.Stream(t.Context(), name); err == nil && st.CachedInfo().Cluster.Leader == victimName {
			led = append(led, name)
		}
	}
	onIt := []string{}
	if s.regions[r].recs[0].nc.ConnectedServerName() == victimName {
		onIt = append(onIt, "eu-west's reconciler")
	}
	killedAt := time.Now()
	sentAtKill := tr.snapshot()
	victim.Kill()
	t.Logf("killed %s, leader of %v; connected to it: %v", victimName, led, onIt)

	// eu-west goes on applying the others' spends, and theirs reach it.
	for _, src := range s.names {
		if src == r {
			continue
		}
		s.waitApplied(r, tr.key(src), tr, src, killedAt, 60*time.Second)
	}
	// eu-west's own spends, admitted since the kill, reach the others.
	for _, dst := range s.names {
		if dst == r {
			continue
		}
		k := tr.key(r)
		deadline := killedAt.Add(60 * time.Second)
		for s.count(dst, k) <= sentAtKill[r] {
			if time.Now().After(deadline) {
				t.Fatalf("%s applied none of eu-west's spends admitted after %s died, 60 s on", dst, victimName)
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Logf("kill to the first spend of eu-west admitted since applied in %s: %v", dst, time.Since(killedAt).Round(10*time.Millisecond))
	}
	want := tr.stop()
	victim.Restart(t)
	s.super.WaitReady(t)
	t.Logf("%s down for %v, restarted", victimName, time.Since(killedAt).Round(10*time.Millisecond))
	took := s.convergeAll(want)
	t.Logf("every spend applied %v after the traffic stopped", took.Round(time.Millisecond))
}

// waitApplied waits until dst has applied a spend of src admitted after
// since (more than src had admitted then), and logs how long it took.
func (s *stack) waitApplied(dst, key string, tr *traffic, src string, since time.Time, limit time.Duration) {
	s.t.Helper()
	// What src had admitted at since is at most what it has admitted now.
	floor := tr.snapshot()[src]
	deadline := since.Add(limit)
	for s.count(dst, key) <= floor {
		if time.Now().After(deadline) {
			s.t.Fatalf("%s applied none of %s's latest spends within %v", dst, src, limit)
		}
		time.Sleep(20 * time.Millisecond)
	}
	s.t.Logf("kill to a spend of %s admitted since applied in %s: %v", src, dst, time.Since(since).Round(10*time.Millisecond))
}

// waitDrained waits until dst's reconcilers have applied every spend of
// src that has reached dst: each partition's stored position is at its
// last message in the inbound stream, and dst's retry consumer of src has
// nothing pending and nothing unacknowledged.
func (s *stack) waitDrained(dst, src string, limit time.Duration) {
	s.t.Helper()
	js := s.opsJetStream(s.t, dst)
	deadline := time.Now().Add(limit)
	for {
		left, err := s.undrained(js, dst, src)
		if err == nil && len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("%s has not applied what it holds of %s's spends after %v: %v %v", dst, src, limit, left, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// undrained lists what dst has not applied of src's spends: the partitions
// whose stored position is behind their last message, and the retry
// consumer with entries pending or unacknowledged.
func (s *stack) undrained(js jetstream.JetStream, dst, src string) ([]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	left, err := s.partitionsBehind(ctx, js, dst, src)
	if err != nil {
		return nil, err
	}
	st, err := js.Stream(ctx, gossip.RetryStream(dst))
	if err != nil {
		return nil, err
	}
	l := st.ListConsumers(ctx)
	for ci := range l.Info() {
		if !strings.Contains(ci.Name, "-from-"+src) {
			continue
		}
		if ci.NumPending > 0 || ci.NumAckPending > 0 {
			left = append(left, fmt.Sprintf("%s: %d pending, %d unacknowledged", ci.Name, ci.NumPending, ci.NumAckPending))
		}
	}
	if err := l.Err(); err != nil {
		return nil, err
	}
	return left, nil
}

// traffic sends one check of the quota per period through each region's
// limiterd, on a key of its own, until stopped.
type traffic struct {
	s      *stack
	id     string
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	sent   map[string]float64 // by region
}

var trafficRuns atomic.Int64

func (s *stack) startTraffic(period time.Duration) *traffic {
	ctx, cancel := context.WithCancel(context.Background())
	tr := &traffic{s: s, id: fmt.Sprint(trafficRuns.Add(1)), cancel: cancel, sent: map[string]float64{}}
	for _, r := range s.names {
		tr.wg.Go(func() {
			tick := time.NewTicker(period)
			defer tick.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				resp, err := s.check(r, "quota", tr.key(r))
				if err != nil || !resp.Allowed {
					s.t.Errorf("check in %s: %v, %v", r, resp, err)
					return
				}
				tr.mu.Lock()
				tr.sent[r]++
				tr.mu.Unlock()
			}
		})
	}
	return tr
}

// key is the key region's traffic checks.
func (tr *traffic) key(region string) string { return "traffic-" + tr.id + "-" + region }

func (tr *traffic) snapshot() map[string]float64 {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	out := map[string]float64{}
	for r, n := range tr.sent {
		out[r] = n
	}
	return out
}

// stop ends the traffic and returns, by key, how many checks were admitted.
func (tr *traffic) stop() map[string]float64 {
	tr.cancel()
	tr.wg.Wait()
	want := map[string]float64{}
	for r, n := range tr.snapshot() {
		want[tr.key(r)] = n
	}
	return want
}

// waitFlowing waits until every region has applied some of every other
// region's traffic.
func (s *stack) waitFlowing(tr *traffic) {
	s.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for _, src := range s.names {
		for _, dst := range s.names {
			for dst != src && s.count(dst, tr.key(src)) == 0 {
				if time.Now().After(deadline) {
					s.t.Fatalf("%s applied none of %s's traffic after 30s", dst, src)
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
	}
}

// convergeAll waits until every region counts want[key] for every key
// (nothing more: a count above it is a spend applied twice), returns how
// long that took, then makes sure the counts stay.
func (s *stack) convergeAll(want map[string]float64) time.Duration {
	s.t.Helper()
	return s.convergeIn(s.names, want)
}

// convergeIn is convergeAll in regions only.
func (s *stack) convergeIn(regions []string, want map[string]float64) time.Duration {
	s.t.Helper()
	start := time.Now()
	deadline := start.Add(60 * time.Second)
	var took time.Duration
	for {
		var off []string
		for k, n := range want {
			for _, r := range regions {
				got := s.count(r, k)
				if got > n {
					s.t.Fatalf("%s counts %v for %s, more than the %v admitted: a spend applied twice", r, got, k, n)
				}
				if got != n {
					off = append(off, fmt.Sprintf("%s %s=%v", r, k, got))
				}
			}
		}
		if len(off) == 0 {
			took = time.Since(start)
			break
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("after 60s: %s; want %v", strings.Join(off, ", "), want)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(3*s.interval + 2*time.Second)
	for k, n := range want {
		for _, r := range regions {
			if got := s.count(r, k); got != n {
				s.t.Fatalf("%s counts %v for %s later, want %v", r, got, k, n)
			}
		}
	}
	return took
}

// opsJetStream is JetStream as the test's operator, connected to region.
func (s *stack) opsJetStream(t testing.TB, region string) jetstream.JetStream {
	t.Helper()
	nc := s.connectAsIn("ops", region)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// logSource logs, for a test that failed waiting on dst to apply src's
// spends, where they stopped: src's spends stream, dst's inbound stream
// and its source of src as the server reports them, and dst's
// reconcilers' counts of that source's stalls and resets.
func (s *stack) logSource(t *testing.T, dst, src string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	js := s.opsJetStream(t, dst)
	if st, err := js.Stream(ctx, gossip.RegionStream(src)); err != nil {
		t.Logf("%s's spends stream, read from %s: %v", src, dst, err)
	} else {
		i := st.CachedInfo()
		t.Logf("%s's spends stream: %d messages, sequences %d to %d, %d consumers, leader %q",
			src, i.State.Msgs, i.State.FirstSeq, i.State.LastSeq, i.State.Consumers, leaderOf(i))
	}
	st, err := js.Stream(ctx, gossip.InStream(dst))
	if err != nil {
		t.Logf("%s's inbound stream: %v", dst, err)
		return
	}
	i := st.CachedInfo()
	t.Logf("%s's inbound stream: %d messages, last sequence %d, leader %q", dst, i.State.Msgs, i.State.LastSeq, leaderOf(i))
	for _, si := range i.Sources {
		t.Logf("  source %s (filter %s): lag %d, active %v, error %v", si.Name, si.FilterSubject, si.Lag, si.Active, si.Error)
	}
	for n, rec := range s.regions[dst].recs {
		t.Logf("  %s's reconciler %d: source %s stalled %v times, reset %v times", dst, n,
			src, testutil.ToFloat64(rec.m.sourceStalls.WithLabelValues(src)), testutil.ToFloat64(rec.m.sourceResets.WithLabelValues(src)))
	}
}

// leaderOf is the server leading the stream of i, "" when not clustered.
func leaderOf(i *jetstream.StreamInfo) string {
	if i.Cluster == nil {
		return ""
	}
	return i.Cluster.Leader
}

// logLag logs each reconciler's limiter_reconcile_lag_seconds, by source.
func (s *stack) logLag(t *testing.T) {
	for _, r := range s.names {
		mfs, err := s.regions[r].recs[0].Registry().Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != "limiter_reconcile_lag_seconds" {
				continue
			}
			for _, m := range mf.GetMetric() {
				h := m.GetHistogram()
				if h.GetSampleCount() == 0 {
					continue
				}
				t.Logf("limiter_reconcile_lag_seconds in %s from %s: %d debits, mean %.3fs, p50 <= %s, p99 <= %s",
					r, label(m, "source_region"), h.GetSampleCount(), h.GetSampleSum()/float64(h.GetSampleCount()),
					quantileBound(h, 0.5), quantileBound(h, 0.99))
			}
		}
	}
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
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
