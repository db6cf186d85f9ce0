package redisstore

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// migratingPair finds two client keys served by one primary, and returns
// them with migrate, which puts the slot of the first in the migrating
// state towards another primary: a script naming keys of that slot of
// which some are missing is then answered TRYAGAIN (nothing ran).
func migratingPair(t *testing.T, c *redistest.Cluster, prefix string) (a, b string, migrate func() (stable func())) {
	t.Helper()
	ctx := context.Background()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { cc.Close() })
	owner := func(key string) string {
		n, err := cc.MasterForKey(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		return n.Options().Addr
	}
	a = prefix + "-a"
	addr := owner(a)
	for i := 0; ; i++ {
		b = fmt.Sprintf("%s-b%d", prefix, i)
		if owner(b) == addr && Slot(b) != Slot(a) {
			break
		}
	}
	var target string
	for _, p := range c.PrimaryAddrs() {
		if p != addr {
			id, err := redis.NewClient(&redis.Options{Addr: p}).ClusterMyID(ctx).Result()
			if err != nil {
				t.Fatal(err)
			}
			target = id
			break
		}
	}
	primary := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { primary.Close() })
	return a, b, func() func() {
		if err := primary.Do(ctx, "cluster", "setslot", strconv.Itoa(Slot(a)), "migrating", target).Err(); err != nil {
			t.Fatal(err)
		}
		stable := func() { primary.Do(context.Background(), "cluster", "setslot", strconv.Itoa(Slot(a)), "stable") }
		t.Cleanup(stable)
		return stable
	}
}

// TestUndoSentOnce: an undo of two clients on one primary, the first
// answered TRYAGAIN (its slot is migrating and one of its keys is missing),
// gives the second back exactly its cost. A cluster pipeline that re-sends
// the node's whole batch after the first command's TRYAGAIN runs the
// second undo once per attempt.
func TestUndoSentOnce(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	s, _ := newTestStore(t, Options{Addrs: c.Addrs()})
	ctx := context.Background()
	a, b, migrate := migratingPair(t, c, "undo-once")
	if err := s.Load(ctx); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		mustTake(t, s, b, 1)
	}
	// a's bucket of rule r exists, of rule r2 not: a script of both keys
	// is refused TRYAGAIN while the slot migrates.
	mustTake(t, s, a, 1)
	migrate()
	reqs := []bucket.Request{
		{Rule: "r", Key: a, Limit: testLimit, Cost: 1},
		{Rule: "r2", Key: a, Limit: testLimit, Cost: 1},
		{Rule: "r", Key: b, Limit: testLimit, Cost: 1},
	}
	err := s.Undo(ctx, reqs, time.Now())
	if !redis.IsTryAgainError(err) {
		t.Fatalf("undo of a client whose slot is migrating = %v, want its TRYAGAIN", err)
	}
	if got := peekTokens(t, s, b); got != 6 {
		// (b's slot is not migrating: the check reads it.)
		t.Fatalf("after an undo of 1 the bucket of %s holds %v tokens, want 6 (5 left + 1 given back)", b, got)
	}
}

// peekTokens is what the token bucket of key under rule r holds, read
// by a check of almost nothing.
func peekTokens(t *testing.T, s *Store, key string) float64 {
	t.Helper()
	d, err := s.Take(context.Background(), bucket.Request{Rule: "r", Key: key, Limit: testLimit, Cost: 1e-6})
	if err != nil {
		t.Fatal(err)
	}
	return float64(int(d.Remaining + 0.5))
}

// TestTryAgainSentAgain: a check of two rules of a client whose slot is
// being migrated, one of its keys already moved, is answered TRYAGAIN;
// sent again after a short pause, it is decided by the store once the
// slot is in one place, instead of failing over to the rule's on_failure.
func TestTryAgainSentAgain(t *testing.T) {
	pauses := pipeline.TryAgainPauses
	pipeline.TryAgainPauses = []time.Duration{200 * time.Millisecond, 400 * time.Millisecond}
	t.Cleanup(func() { pipeline.TryAgainPauses = pauses })
	c := redistest.NewCluster(t, 3, 0)
	s, reg := newTestStore(t, Options{Addrs: c.Addrs()})
	ctx := context.Background()
	a, _, migrate := migratingPair(t, c, "try-again")
	if err := s.Load(ctx); err != nil {
		t.Fatal(err)
	}
	mustTake(t, s, a, 1)
	stable := migrate()
	time.AfterFunc(50*time.Millisecond, stable)
	reqs := []bucket.Request{
		{Rule: "r", Key: a, Limit: testLimit, Cost: 1},
		{Rule: "r2", Key: a, Limit: testLimit, Cost: 1},
	}
	ds, err := s.TakeAll(ctx, reqs)
	if err != nil || !ds[0].Allowed || !ds[1].Allowed {
		t.Fatalf("check during a slot migration = %+v, %v; want decided by the store once the slot is stable", ds, err)
	}
	if got := testenv.MetricValue(t, reg, "limiter_store_try_again_total"); got < 1 {
		t.Fatalf("limiter_store_try_again_total = %v, want at least 1", got)
	}
}

// TestUndoAtTheStoresInstant: a decision carries the instant the store's
// clock decided it at, and an undo naming it gives a sliding log's spend
// back (the undo script removes entries at exactly that instant: an undo
// at limiterd's own clock found none).
func TestUndoAtTheStoresInstant(t *testing.T) {
	s, _ := newTestStore(t, Options{Addrs: []string{redistest.NewNode(t).Addr()}})
	ctx := context.Background()
	lim := bucket.Limit{Algorithm: bucket.SlidingLog, Capacity: 2, Window: time.Hour}
	for _, multi := range []bool{false, true} {
		key := fmt.Sprintf("log-%v", multi)
		reqs := []bucket.Request{{Rule: "log", Key: key, Limit: lim, Cost: 1}}
		if multi {
			reqs = append(reqs, bucket.Request{Rule: "log2", Key: key, Limit: lim, Cost: 1})
		}
		take := func() ([]bucket.Decision, error) {
			if !multi {
				// The single script.
				d, err := s.Take(ctx, reqs[0])
				return []bucket.Decision{d}, err
			}
			return s.TakeAll(ctx, reqs)
		}
		var ds []bucket.Decision
		var err error
		for range 2 {
			if ds, err = take(); err != nil || !ds[0].Allowed {
				t.Fatalf("multi %v: %+v, %v", multi, ds, err)
			}
		}
		if ds[0].At == 0 {
			t.Fatalf("multi %v: decision without the store's instant", multi)
		}
		if err := s.Undo(ctx, reqs, time.UnixMicro(ds[0].At)); err != nil {
			t.Fatal(err)
		}
		if ds, err = take(); err != nil || !ds[0].Allowed {
			t.Fatalf("multi %v: after an undo of one of 2 = %+v, %v; want allowed", multi, ds, err)
		}
	}
}
