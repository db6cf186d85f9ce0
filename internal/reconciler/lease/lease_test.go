package lease

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

func quiet() *slog.Logger {
	if os.Getenv("LIMITER_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func items(sources []string, partitions int) []Item {
	var out []Item
	for _, s := range sources {
		for p := range partitions {
			out = append(out, Item{s, p})
		}
	}
	return out
}

// TestAssign: every item is placed, members get as many within one, both
// of all items and of each source's (the applying of one source spreads
// whatever the others' items, the region's own relay among them), the
// placement does not depend on the order given, and a member joining
// moves few items.
func TestAssign(t *testing.T) {
	// Two sources' partitions and the relay's item, the region's own.
	all := append(items([]string{"eu-west", "ap-south"}, 8), Item{Source: "us-east"})
	for _, n := range []int{1, 2, 3, 4, 5, 16, 20} {
		var members []string
		for i := range n {
			members = append(members, fmt.Sprintf("m%d", i))
		}
		place := Assign(all, members)
		load := map[string]int{}
		for _, it := range all {
			m, ok := place[it]
			if !ok {
				t.Fatalf("%d members: %s not placed", n, it)
			}
			load[m]++
		}
		lo, hi := len(all), 0
		for _, m := range members {
			lo, hi = min(lo, load[m]), max(hi, load[m])
		}
		if want := (len(all) + n - 1) / n; hi > want || hi-lo > 1 {
			t.Errorf("%d members: loads %v, want at most %d each, within one", n, load, want)
		}
		for _, src := range []string{"eu-west", "ap-south"} {
			of := map[string]int{}
			for _, it := range all {
				if it.Source == src {
					of[place[it]]++
				}
			}
			lo, hi := len(all), 0
			for _, m := range members {
				lo, hi = min(lo, of[m]), max(hi, of[m])
			}
			if hi-lo > 1 {
				t.Errorf("%d members: %s's partitions %v, want as many within one", n, src, of)
			}
		}
		shuffled, rev := append([]Item(nil), all...), append([]string(nil), members...)
		rand.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		for i, j := 0, len(rev)-1; i < j; i, j = i+1, j-1 {
			rev[i], rev[j] = rev[j], rev[i]
		}
		again := Assign(shuffled, rev)
		for _, it := range all {
			if again[it] != place[it] {
				t.Fatalf("%d members: %s placed on %s, then %s from the same members in another order", n, it, place[it], again[it])
			}
		}
	}
	two := Assign(all, []string{"a", "b"})
	three := Assign(all, []string{"a", "b", "c"})
	moved := 0
	for _, it := range all {
		if two[it] != three[it] {
			moved++
		}
	}
	// c takes its share (5 or 6); a few more move to keep the loads even.
	if moved > 9 {
		t.Errorf("a third member moved %d of %d items", moved, len(all))
	}
	t.Logf("a third member moved %d of %d items", moved, len(all))
}

// cluster is a 3-primary Redis Cluster and a client of it.
func cluster(t *testing.T) *redis.ClusterClient {
	t.Helper()
	c := redistest.NewCluster(t, 3, 0)
	rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { rc.Close() })
	return rc
}

// redisOf is a Redis of c.
type redisOf struct{ c redis.UniversalClient }

func (r redisOf) Client() redis.UniversalClient { return r.c }

// bucket is a member's view of the region's bucket, which it stops
// reaching once cut: a member whose NATS is gone, its loops still running.
type bucket struct {
	kv  jetstream.KeyValue
	ttl time.Duration
	cut atomic.Bool
}

func (b *bucket) Bucket() (jetstream.KeyValue, time.Duration) {
	if b.cut.Load() {
		return nil, 0
	}
	return b.kv, b.ttl
}

// newBucket starts a NATS server and makes eu-west's bucket on it, with
// leases that live ttl.
func newBucket(t *testing.T, ttl time.Duration) jetstream.KeyValue {
	t.Helper()
	srv := natstest.NewServer(t)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, BucketConfig("eu-west", ttl, 1, nil))
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

// TestLeases: a lease is claimed by one member at a time, renewed and
// released by the member that wrote it last only, and expires unless
// renewed; a position moves only forward.
func TestLeases(t *testing.T) {
	const ttl = 2 * time.Second
	kv := newBucket(t, ttl)
	rc := cluster(t)
	ctx := context.Background()
	it := Item{"us-east", 3}
	newMember := func(token string) *Manager {
		return New(Options{Region: "eu-west", Token: token, TTL: ttl, PositionTTL: time.Minute, Logger: quiet()}, &bucket{kv: kv, ttl: ttl}, redisOf{rc}, nil)
	}
	a, b := newMember("a"), newMember("b")
	claim := func(m *Manager, want string) uint64 {
		t.Helper()
		rev, holder, err := m.claim(ctx, it)
		if err != nil || holder != want {
			t.Fatalf("%s claims: holder %q, %v; want %q", m.Token(), holder, err, want)
		}
		return rev
	}
	holder := func(want string) {
		t.Helper()
		if got, err := a.holder(ctx, it); got != want || err != nil {
			t.Fatalf("holder %q, %v; want %q", got, err, want)
		}
	}
	holder("")
	rev := claim(a, "a")
	claim(b, "a")
	if again := claim(a, "a"); again <= rev {
		t.Errorf("a's claim of its own lease wrote revision %d, after %d", again, rev)
	} else {
		rev = again
	}
	if _, err := b.renew(ctx, &Held{Item: it, rev: rev - 1}); !errors.Is(err, errTaken) {
		t.Errorf("a renewal at an old revision: %v, want errTaken", err)
	}
	if err := b.release(ctx, &Held{Item: it, rev: rev - 1}); err == nil {
		t.Error("a release at an old revision deleted the lease")
	}
	holder("a")
	h := &Held{Item: it, rev: rev}
	if h.rev, _ = a.renew(ctx, h); h.rev <= rev {
		t.Fatalf("a's renewal wrote revision %d, after %d", h.rev, rev)
	}
	if err := a.release(ctx, h); err != nil {
		t.Fatal(err)
	}
	holder("")
	rev = claim(b, "b")
	time.Sleep(ttl + 500*time.Millisecond) // b does not renew
	holder("")
	if _, err := b.renew(ctx, &Held{Item: it, rev: rev}); !errors.Is(err, errTaken) {
		t.Errorf("a renewal of an expired lease: %v, want errTaken", err)
	}
	claim(a, "a")

	for _, c := range []struct{ seq, want uint64 }{{10, 10}, {7, 10}, {12, 12}} {
		if got, err := b.SetPosition(ctx, it, 42, c.seq); err != nil || got != c.want {
			t.Errorf("sets %d: %d, %v; want %d", c.seq, got, err, c.want)
		}
	}
	if got, err := a.Position(ctx, it, 42); got != 12 || err != nil {
		t.Errorf("position %d, %v; want 12", got, err)
	}
	if got, err := a.Position(ctx, it, 43); got != 0 || err != nil {
		t.Errorf("position of another epoch %d, %v; want 0", got, err)
	}
	if ttl := rc.PTTL(ctx, PositionKey("eu-west", it, 42)).Val(); ttl <= 50*time.Second {
		t.Errorf("a position lives %v, want about a minute", ttl)
	}
}

// writes records the writes of the members' loops, each made while its
// member counted its lease valid, and counts the overlaps: a write of an
// item while another member counted the item's lease valid at its own
// last write.
type writes struct {
	mu    sync.Mutex
	until map[Item]map[string]time.Time
	// last is the latest validity each member counted on each item.
	last    map[string]map[Item]time.Time
	by      map[string]map[Item]int
	overlap []string
}

func newWrites() *writes {
	return &writes{until: map[Item]map[string]time.Time{}, last: map[string]map[Item]time.Time{}, by: map[string]map[Item]int{}}
}

func (w *writes) write(member string, it Item, until time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := time.Now()
	if w.until[it] == nil {
		w.until[it] = map[string]time.Time{}
	}
	for other, u := range w.until[it] {
		if other != member && now.Before(u) {
			w.overlap = append(w.overlap, fmt.Sprintf("%s wrote %s while %s counted its lease valid for %v more", member, it, other, u.Sub(now)))
		}
	}
	w.until[it][member] = until
	if w.last[member] == nil {
		w.last[member] = map[Item]time.Time{}
	}
	if until.After(w.last[member][it]) {
		w.last[member][it] = until
	}
	if w.by[member] == nil {
		w.by[member] = map[Item]int{}
	}
	w.by[member][it]++
}

// end records that member's loop on it returned: it writes no more.
func (w *writes) end(member string, it Item) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.until[it], member)
}

// recent is how many items member wrote since the call before.
func (w *writes) recent(member string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := len(w.by[member])
	w.by[member] = nil
	return n
}

// loop is a member's loop on a partition: a write every 5 ms while its
// lease is valid for 50 ms more.
func (w *writes) loop(member string) func(ctx context.Context, h *Held) {
	return func(ctx context.Context, h *Held) {
		defer w.end(member, h.Item)
		for {
			until, err := h.WaitValid(ctx, 50*time.Millisecond)
			if err != nil {
				return
			}
			w.write(member, h.Item, until)
			select {
			case <-ctx.Done():
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}
}

// TestMembersSplitAndTakeOver: two members split 16 partitions evenly;
// when one is stopped the other takes them all, and when the other loses
// NATS (its loops still running) the first takes them all after the TTL;
// no partition is ever written by one member while another counts its
// lease valid, and none counts a lease valid after it expired.
func TestMembersSplitAndTakeOver(t *testing.T) {
	const ttl = 2 * time.Second
	kv := newBucket(t, ttl)
	all := items([]string{"us-east", "ap-south"}, 8)
	w := newWrites()
	start := func(token string) (*Manager, *bucket, context.CancelFunc, chan struct{}) {
		b := &bucket{kv: kv, ttl: ttl}
		m := New(Options{Region: "eu-west", Token: token, TTL: ttl, PositionTTL: time.Minute, Logger: quiet()}, b, redisOf{}, nil)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			m.Run(ctx, func() []Item { return all }, w.loop(token))
		}()
		t.Cleanup(func() { cancel(); <-done })
		return m, b, cancel, done
	}
	// settled waits until the members' loops have written want items
	// each, over a tick.
	settled := func(want map[string]int) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for {
			for m := range want {
				w.recent(m)
			}
			time.Sleep(ttl / 2)
			got := map[string]int{}
			ok := true
			for m, n := range want {
				got[m] = w.recent(m)
				ok = ok && got[m] == n
			}
			if ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("members write %v partitions, want %v", got, want)
			}
		}
	}
	start("a")
	_, _, stopB, doneB := start("b")
	settled(map[string]int{"a": 8, "b": 8})
	began := time.Now()
	stopB()
	<-doneB
	settled(map[string]int{"a": 16})
	t.Logf("a stopped member's partitions taken over in %v", time.Since(began).Round(10*time.Millisecond))

	_, bc, _, _ := start("c")
	settled(map[string]int{"a": 8, "c": 8})
	began = time.Now()
	bc.cut.Store(true) // c keeps looping, without NATS
	// When each of c's leases expires, read right after the cut: its last
	// write, on the server's clock (the same host's), and the TTL.
	expires := map[Item]time.Time{}
	for _, it := range all {
		e, err := kv.Get(context.Background(), leaseKey(it))
		if err == nil && string(e.Value()) == "c" {
			expires[it] = e.Created().Add(ttl)
		}
	}
	settled(map[string]int{"a": 16, "c": 0})
	t.Logf("a cut member's partitions taken over in %v", time.Since(began).Round(10*time.Millisecond))
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(expires) != 8 {
		t.Errorf("c held %d leases when cut, want 8", len(expires))
	}
	for it, exp := range expires {
		if u := w.last["c"][it]; !u.Before(exp) {
			t.Errorf("c counted its lease of %s valid until %v after it expired", it, u.Sub(exp))
		}
	}
	for _, o := range w.overlap {
		t.Error(o)
	}
}
