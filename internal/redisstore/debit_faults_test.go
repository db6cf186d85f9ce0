package redisstore

import (
	"context"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// faultLimits are a limit of every algorithm that the test's debits never
// reach, so that what a bucket counts is what was debited: the token
// buckets refill 0.001 a second (under 0.1 over the test), the windows
// last 1,000 hours.
var faultLimits = map[string]bucket.Limit{
	"tb":   {Algorithm: bucket.TokenBucket, Capacity: 1e6, RefillPerSecond: 1e-3},
	"gcra": {Algorithm: bucket.GCRA, Capacity: 1e6, RefillPerSecond: 1e-3},
	"sw":   {Algorithm: bucket.SlidingWindow, Capacity: 1e9, Window: 1000 * time.Hour},
	"fw":   {Algorithm: bucket.FixedWindow, Capacity: 1e9, Window: 1000 * time.Hour},
	"sl":   {Algorithm: bucket.SlidingLog, Capacity: 1e6, Window: 1000 * time.Hour},
}

// TestApplyDebitsFaults applies random messages through ApplyDebits to a
// 3-primary cluster with a replica each, while it pauses primaries
// (CLIENT PAUSE WRITE, longer than a call's deadline) and kills primaries
// so that their replicas take over, and holds every bucket to a model:
// each message debited once per client. Messages of two source regions
// carry random clients (of 200), rules and whole amounts; some are sent
// twice at once, some delivered again later. As a reconciler does, the
// clients of a failed apply are applied again, with the same position,
// until they succeed, before the next message. A primary is killed only
// after WAIT has its replica hold every write: an acknowledged write lost
// by a failover is Redis's asynchronous replication, not the debits'.
// DEBIT_FAULTS_SEED replays a run.
func TestApplyDebitsFaults(t *testing.T) {
	t.Parallel() // its own cluster; the package's two longest tests overlap
	c := redistest.NewCluster(t, 3, 1)
	s, reg := newTestStore(t, Options{Addrs: c.Addrs(), Timeout: time.Second})
	seed := time.Now().UnixNano()
	if v := os.Getenv("DEBIT_FAULTS_SEED"); v != "" {
		seed, _ = strconv.ParseInt(v, 10, 64)
	}
	rng := rand.New(rand.NewPCG(uint64(seed), 1))
	messages := 240
	if testing.Short() {
		messages = 80
	}
	rules := []string{"tb", "gcra", "sw", "fw", "sl"}
	type sent struct {
		pos     Position
		clients []ClientDebits
	}
	sources := []string{"eu", "ap"}
	seqs := map[string]uint64{}
	history := map[string][]sent{}
	model := map[[2]string]float64{} // (client, rule): debited
	var stats struct {
		applies, failedApplies, retries, doubles, redeliveries, pauses, failovers int
	}

	// apply applies clients at pos until each succeeded, and returns how
	// many the store reported applied.
	apply := func(src string, pos Position, clients []ClientDebits) int {
		t.Helper()
		applied := 0
		deadline := time.Now().Add(60 * time.Second)
		for len(clients) > 0 {
			if time.Now().After(deadline) {
				t.Fatalf("%s %v: %d clients still failing after 60 s", src, pos, len(clients))
			}
			ctx, cancel := context.WithTimeout(context.Background(), 250*time.Millisecond)
			res, err := s.ApplyDebits(ctx, src, pos, time.Hour, clients)
			cancel()
			stats.applies++
			applied += res.Applied
			if got := res.Applied + res.Duplicates + len(res.Failed); got != len(clients) {
				t.Fatalf("%s %v: %+v for %d clients", src, pos, res, len(clients))
			}
			if err == nil {
				break
			}
			stats.failedApplies++
			stats.retries += len(res.Failed)
			again := make([]ClientDebits, len(res.Failed))
			for k, i := range res.Failed {
				again[k] = clients[i]
			}
			clients = again
			time.Sleep(50 * time.Millisecond)
		}
		return applied
	}

	var unpaused chan struct{} // closed when the current pause ends
	pause := func() {
		primaries := c.PrimaryAddrs()
		addr := primaries[rng.IntN(len(primaries))]
		unpause := redistest.Pause(t, addr)
		stats.pauses++
		done := make(chan struct{})
		unpaused = done
		time.AfterFunc(time.Duration(150+rng.IntN(500))*time.Millisecond, func() {
			unpause()
			close(done)
		})
	}
	waitUnpaused := func() {
		if unpaused != nil {
			<-unpaused
			unpaused = nil
		}
	}
	failover := func(m int) {
		waitUnpaused()
		primaries := c.PrimaryAddrs()
		addr := primaries[rng.IntN(len(primaries))]
		rc := redis.NewClient(&redis.Options{Addr: addr})
		n, err := rc.Wait(context.Background(), 1, 5*time.Second).Result()
		rc.Close()
		if err != nil || n < 1 {
			t.Fatalf("WAIT on %s: %d replicas, %v", addr, n, err)
		}
		for _, node := range c.Nodes() {
			if node.Addr() == addr {
				node.Stop()
				stats.failovers++
				t.Logf("message %d: killed primary %s", m, addr)
				return
			}
		}
		t.Fatalf("no node at %s", addr)
	}
	// restart brings the killed nodes back as replicas, before the next
	// kill; nothing is applied while the old primaries rejoin.
	restart := func() {
		for _, node := range c.Nodes() {
			node.Start()
		}
		c.WaitHealthy(t)
	}

	for m := range messages {
		switch {
		case m%20 == 10:
			pause()
		case m == messages/3 || m == 2*messages/3:
			failover(m)
		case m == messages/3+messages/6 || m == messages-1:
			waitUnpaused()
			restart()
		}
		src := sources[rng.IntN(len(sources))]
		if h := history[src]; len(h) > 0 && rng.IntN(10) == 0 {
			old := h[rng.IntN(len(h))]
			stats.redeliveries++
			if n := apply(src, old.pos, old.clients); n != 0 {
				t.Fatalf("%s %v delivered again: %d clients applied, want none", src, old.pos, n)
			}
			continue
		}
		seqs[src] += uint64(1 + rng.IntN(3)) // gaps, as other partitions' messages leave
		pos := Position{Epoch: 7, Seq: seqs[src]}
		clients := make([]ClientDebits, 0, 150)
		for _, i := range rng.Perm(200)[:1+rng.IntN(150)] {
			cl := ClientDebits{Key: "f-" + strconv.Itoa(i)}
			for _, r := range rng.Perm(len(rules))[:1+rng.IntN(3)] {
				cl.Debits = append(cl.Debits, Debit{Rule: rules[r], Limit: faultLimits[rules[r]], Amount: float64(1 + rng.IntN(5))})
			}
			clients = append(clients, cl)
		}
		apply(src, pos, clients)
		for _, cl := range clients {
			for _, d := range cl.Debits {
				model[[2]string{cl.Key, d.Rule}] += d.Amount
			}
		}
		if rng.IntN(8) == 0 {
			stats.doubles++
			if n := apply(src, pos, clients); n != 0 {
				t.Fatalf("%s %v sent twice: %d clients applied the second time, want none", src, pos, n)
			}
		}
		history[src] = append(history[src], sent{pos, clients})
	}
	waitUnpaused()

	var reqs []bucket.Request
	var want []float64
	for k, v := range model {
		reqs = append(reqs, bucket.Request{Rule: k[1], Key: k[0], Limit: faultLimits[k[1]]})
		want = append(want, v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Read in chunks, each retried: the store sheds a call that waited
	// too long in a node's queue (ErrOverloaded), which a whole model read
	// at once on a loaded machine can be; the counts are what is checked.
	var used []float64
	for lo := 0; lo < len(reqs); lo += 64 {
		part := reqs[lo:min(lo+64, len(reqs))]
		for {
			u, err := s.Used(ctx, part)
			if err == nil {
				used = append(used, u...)
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("read the counts: %v", err)
			}
			t.Logf("read the counts again: %v", err)
			time.Sleep(100 * time.Millisecond)
		}
	}
	bad := 0
	for i, u := range used {
		// A token bucket refills under 0.1 over the test; a debit is 1
		// at least.
		if math.Abs(u-want[i]) > 0.25 {
			bad++
			if bad <= 10 {
				t.Errorf("%s of %s counts %v, want %v", reqs[i].Rule, reqs[i].Key, u, want[i])
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d buckets differ from the model (seed %d)", bad, len(used), seed)
	}
	t.Logf("seed %d: %d messages, %d buckets checked; %d apply calls, %d of them failed (%d client retries); %d messages sent twice, %d delivered again; %d pauses, %d failovers; %v batched calls fell back",
		seed, messages, len(used), stats.applies, stats.failedApplies, stats.retries, stats.doubles, stats.redeliveries,
		stats.pauses, stats.failovers, testenv.MetricValue(t, reg, "limiter_store_debit_fallbacks_total"))
}
