package reconciler

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// replace swaps a topology file's content at once, as a ConfigMap does.
func (s *stack) replaceTopology(region, content string) {
	s.t.Helper()
	writeFile(s.t, s.dir, "topology-"+region+".yml.new", content)
	if err := renameFile(filepath.Join(s.dir, "topology-"+region+".yml.new"), s.topologyFile(region)); err != nil {
		s.t.Fatal(err)
	}
}

// waitGeneration waits until region's reconcilers and limiterd have gen in force.
func (s *stack) waitGeneration(region string, gen uint64) {
	s.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	r := s.regions[region]
	for {
		ok := r.lim.Registry() != nil
		for _, rec := range r.recs {
			ok = ok && rec.topo.Active().Generation() == gen
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("%s not on generation %d after 5s", region, gen)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestRegionAddedAtRunTime: a two-region stack (us-east, eu-west, on
// generation 1) running while ap-south starts on a topology of all three.
// When us-east and eu-west switch to generation 2 (all three), ap-south's
// spends from then on are applied in both, none of what it admitted before
// (its past is not debited); the spends between the old regions go on
// being applied exactly once (counts exact, no replay); the inbound
// streams keep the old source's configuration as it was, and source
// ap-south from the sequence of its first message since the switch. When ap-south is
// removed again (generation 3), its loops stop: its spends are no longer
// applied, and its source stays in the streams.
func TestRegionAddedAtRunTime(t *testing.T) {
	t.Parallel()
	names := []string{"us-east", "eu-west", "ap-south"}
	old := []string{"us-east", "eu-west"}
	s := buildStackTopo(t, names, map[string][]string{"us-east": old, "eu-west": old, "ap-south": names},
		quotaRules, 200*time.Millisecond, 1, func(s *stack, opts ...natstest.Option) { s.nats = natstest.NewServer(t, opts...) })
	_, js := connectJS(t, s)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	defer cancel()
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		// What the server says of each inbound stream's sources and
		// apply consumers, for the failure at hand.
		for _, r := range names {
			st, err := js.Stream(context.Background(), gossip.InStream(r))
			if err != nil {
				t.Logf("%s: %v", gossip.InStream(r), err)
				continue
			}
			info := st.CachedInfo()
			t.Logf("%s: %d msgs, subjects %v", gossip.InStream(r), info.State.Msgs, info.State.NumSubjects)
			for _, c := range info.Config.Sources {
				t.Logf("  config source %s filter %s start %v seq %d", c.Name, c.FilterSubject, c.OptStartTime, c.OptStartSeq)
			}
			for _, si := range info.Sources {
				t.Logf("  source %s lag %d active %v error %+v", si.Name, si.Lag, si.Active, si.Error)
			}
			for _, src := range names {
				if src == r {
					continue
				}
				behind, err := s.partitionsBehind(context.Background(), js, r, src)
				t.Logf("  partitions of %s behind: %v %v", src, behind, err)
			}
		}
	})
	sourceBefore := inSources(ctx, t, js, "us-east")

	s.send("ap-south", "before", 5)
	s.send("us-east", "old", 5)
	waitCount(t, s, "ap-south", "old", 5)
	s.converge("old", 5)
	if got := s.count("us-east", "before"); got != 0 {
		t.Fatalf("us-east applied ap-south's spends before it knew ap-south: %v", got)
	}

	for _, r := range old {
		s.replaceTopology(r, s.topology(2, time.Time{}, names...))
	}
	for _, r := range old {
		s.waitGeneration(r, 2)
	}
	s.send("ap-south", "after", 7)
	s.send("us-east", "old", 3)
	s.send("eu-west", "old", 4)
	s.converge("after", 7)
	s.converge("old", 12)
	for _, r := range old {
		if got := s.count(r, "before"); got != 0 {
			t.Errorf("%s debited with %v of what ap-south admitted before the switch, want 0", r, got)
		}
		rec := s.regions[r].recs[0]
		for _, src := range names {
			if src == r {
				continue
			}
			if n := testutil.ToFloat64(rec.m.apply.Replays.WithLabelValues(src)); n != 0 {
				t.Errorf("%s: limiter_spend_replays_total{source_region=%s} = %v, want 0", r, src, n)
			}
		}
		if n := testutil.ToFloat64(rec.m.apply.Applied.WithLabelValues("ap-south")); n == 0 {
			t.Errorf("%s: limiter_spends_applied_total{source_region=ap-south} = 0", r)
		}
	}
	// The source us-east had is as it was; ap-south's starts at the switch.
	after := inSources(ctx, t, js, "us-east")
	if describe(after["eu-west"]) != describe(sourceBefore["eu-west"]) {
		t.Errorf("eu-west's sources of LIMITER_IN_us-east changed: %s, were %s", describe(after["eu-west"]), describe(sourceBefore["eu-west"]))
	}
	if ap := after["ap-south"]; !fromSequence(ap) {
		t.Errorf("ap-south's source of LIMITER_IN_us-east: %+v, want one from the sequence of the switch", describe(ap))
	}

	// Removed: ap-south's spends are no longer applied in us-east.
	s.replaceTopology("us-east", s.topology(3, time.Time{}, old...))
	s.waitGeneration("us-east", 3)
	rec := s.regions["us-east"].recs[0]
	applied := testutil.ToFloat64(rec.m.apply.Applied.WithLabelValues("ap-south"))
	s.send("ap-south", "removed", 3)
	waitCount(t, s, "eu-west", "removed", 3)
	time.Sleep(5 * s.interval)
	if got := s.count("us-east", "removed"); got != 0 {
		t.Errorf("us-east applied %v of ap-south's spends after ap-south was removed, want 0", got)
	}
	if n := testutil.ToFloat64(rec.m.apply.Applied.WithLabelValues("ap-south")); n != applied {
		t.Errorf("us-east: applied from ap-south went from %v to %v after its removal", applied, n)
	}
	if len(inSources(ctx, t, js, "us-east")["ap-south"]) == 0 {
		t.Error("ap-south's source removed from LIMITER_IN_us-east; it stays")
	}
	// The old regions' spends still apply once.
	s.send("eu-west", "old", 2)
	waitCount(t, s, "us-east", "old", 14)
}

// TestRegionAddedSourcedBySequence: ap-south's spends published after the
// switch and before us-east's inbound stream gets ap-south's source are
// applied in us-east, although another region's message landed in the
// inbound stream after them. Sourced from the switch's time, nats-server
// would have started the source at the inbound stream's last message, and
// skipped them. The test holds us-east's set-up between the switch and
// the stream update until that is so.
func TestRegionAddedSourcedBySequence(t *testing.T) {
	t.Parallel()
	names := []string{"us-east", "eu-west", "ap-south"}
	old := []string{"us-east", "eu-west"}
	s := buildStackTopo(t, names, map[string][]string{"us-east": old, "eu-west": old, "ap-south": names},
		quotaRules, 200*time.Millisecond, 0, func(s *stack, opts ...natstest.Option) { s.nats = natstest.NewServer(t, opts...) })
	reached, proceed := make(chan struct{}), make(chan struct{})
	var held atomic.Bool
	s.startReconciler("us-east", func(r *Reconciler) {
		r.beforeSourceAdded = func(ctx context.Context, added []string) {
			if !slices.Contains(added, "ap-south") || held.Swap(true) {
				return
			}
			close(reached)
			select {
			case <-proceed:
			case <-ctx.Done():
			}
		}
	})
	s.startReconciler("eu-west")
	s.startReconciler("ap-south")
	s.waitReady()
	_, js := connectJS(t, s)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	defer cancel()
	s.send("eu-west", "old", 1)
	waitCount(t, s, "us-east", "old", 1)

	s.replaceTopology("us-east", s.topology(2, time.Time{}, names...))
	select {
	case <-reached:
	case <-ctx.Done():
		t.Fatal("us-east's set-up never added ap-south's source")
	}
	// ap-south's spends, in its spends stream; then eu-west's, in
	// us-east's inbound stream after them.
	lastSeq := func(stream string) uint64 {
		st, err := js.Stream(ctx, stream)
		if err != nil {
			t.Fatal(err)
		}
		return st.CachedInfo().State.LastSeq
	}
	waitGrown := func(stream string, from uint64) {
		t.Helper()
		for lastSeq(stream) == from {
			if ctx.Err() != nil {
				t.Fatalf("%s did not grow past %d", stream, from)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	apSpends, usIn := lastSeq(gossip.RegionStream("ap-south")), lastSeq(gossip.InStream("us-east"))
	s.send("ap-south", "gap", 4)
	waitGrown(gossip.RegionStream("ap-south"), apSpends)
	s.send("eu-west", "old", 1)
	waitGrown(gossip.InStream("us-east"), usIn)
	close(proceed)

	// A later spend of ap-south applied shows its source runs. The gap's
	// spends come too, all 4: "gap" and "later" may be in different
	// partitions, applied each in its own order, so "gap" may come
	// after "later". A source that started past the gap never brings them.
	s.send("ap-south", "later", 1)
	waitCount(t, s, "us-east", "later", 1)
	waitCount(t, s, "us-east", "gap", 4)
	if ap := inSources(ctx, t, js, "us-east")["ap-south"]; !fromSequence(ap) {
		t.Errorf("ap-south's source of LIMITER_IN_us-east: %+v, want one from a sequence", describe(ap))
	}
}

func connectJS(t *testing.T, s *stack) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc := s.connectAs("ops")
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// inSources are the sources of region's inbound stream, by source region.
func inSources(ctx context.Context, t *testing.T, js jetstream.JetStream, region string) map[string][]*jetstream.StreamSource {
	t.Helper()
	st, err := js.Stream(ctx, gossip.InStream(region))
	if err != nil {
		t.Fatal(err)
	}
	// A region's spends stream is sourced more than once (its partitions'
	// subjects and the rest), in an order the server may change when a
	// source is added: sorted by filter.
	out := map[string][]*jetstream.StreamSource{}
	for _, src := range st.CachedInfo().Config.Sources {
		for _, n := range []string{"us-east", "eu-west", "ap-south"} {
			if src.Name == gossip.RegionStream(n) {
				out[n] = append(out[n], src)
			}
		}
	}
	for _, srcs := range out {
		slices.SortFunc(srcs, func(a, b *jetstream.StreamSource) int { return strings.Compare(a.FilterSubject, b.FilterSubject) })
	}
	return out
}

// describe prints srcs' values (not their pointers).
func describe(srcs []*jetstream.StreamSource) string {
	var b strings.Builder
	for _, s := range srcs {
		fmt.Fprintf(&b, "%+v;", *s)
	}
	return b.String()
}

// fromSequence reports whether srcs are sources that each start from a
// sequence, not a time.
func fromSequence(srcs []*jetstream.StreamSource) bool {
	for _, s := range srcs {
		if s.OptStartTime != nil || s.OptStartSeq == 0 {
			return false
		}
	}
	return len(srcs) > 0
}

func waitCount(t *testing.T, s *stack, region, key string, want float64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for s.count(region, key) != want {
		if time.Now().After(deadline) {
			t.Fatalf("%s counts %v for %s after 20s, want %v", region, s.count(region, key), key, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSourceStartMovedOnUpdate is what a stream update that moves an
// existing source's start does on nats-server v2.15: nothing (the source
// goes on from where it is; the messages before the first start are not
// sourced). setup copies the existing sources as the server has them all
// the same, so as not to depend on it.
func TestSourceStartMovedOnUpdate(t *testing.T) {
	t.Parallel()
	srv := natstest.NewServer(t)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "X", Subjects: []string{"x"}}); err != nil {
		t.Fatal(err)
	}
	publish := func(n int) {
		for range n {
			if _, err := js.Publish(ctx, "x", []byte("m")); err != nil {
				t.Fatal(err)
			}
		}
	}
	publish(5)
	time.Sleep(10 * time.Millisecond)
	start := time.Now()
	in := jetstream.StreamConfig{Name: "IN", Sources: []*jetstream.StreamSource{{Name: "X", FilterSubject: "x", OptStartTime: &start}}}
	if _, err := js.CreateStream(ctx, in); err != nil {
		t.Fatal(err)
	}
	publish(3)
	msgs := func() uint64 {
		time.Sleep(time.Second)
		st, err := js.Stream(ctx, "IN")
		if err != nil {
			t.Fatal(err)
		}
		return st.CachedInfo().State.Msgs
	}
	if n := msgs(); n != 3 {
		t.Fatalf("IN holds %d messages, want the 3 published after its start", n)
	}
	earlier := start.Add(-time.Hour)
	in.Sources[0].OptStartTime = &earlier
	if _, err := js.UpdateStream(ctx, in); err != nil {
		t.Logf("update moving the start refused: %v", err)
		return
	}
	if n := msgs(); n != 3 {
		t.Fatalf("after an update moving the source's start an hour back, IN holds %d messages, 3 before: the source was sourced again", n)
	}
}

func renameFile(from, to string) error { return os.Rename(from, to) }
