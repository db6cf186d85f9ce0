package reconciler

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limiterd/limiterd/internal/reconciler/apply"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// modelRuns is how many seeds TestPartitionsModel runs:
// $LIMITER_MODEL_RUNS, 2 by default.
func modelRuns(t *testing.T) int {
	if v := os.Getenv("LIMITER_MODEL_RUNS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("LIMITER_MODEL_RUNS=%q: want a count", v)
		}
		return n
	}
	return 2
}

// TestPartitionsModel: us-east's spends, random flushes over a few hundred
// keys, flow into eu-west, applied by two reconcilers, while faults come
// in an order drawn from the seed: one of eu-west's reconcilers dies in
// the middle of a batch (between applying it and storing its position; a
// new one starts a second later), a Redis primary of eu-west is paused
// (CLIENT PAUSE WRITE, 1 to 3 s), and the NATS server is restarted. At the
// end each key's count in eu-west is what a reference model of the flushes
// published says, exactly: no debit lost, none applied twice; and no two
// reconcilers ever applied a batch of one partition at once.
// LIMITER_MODEL_RUNS=N runs N seeds.
func TestPartitionsModel(t *testing.T) {
	for seed := range modelRuns(t) {
		t.Run(fmt.Sprintf("seed=%d", seed+1), func(t *testing.T) { modelRun(t, uint64(seed+1)) })
	}
}

func modelRun(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 23))
	s := newStack(t, quotaRules, 100*time.Millisecond, 0)
	s.startReconciler("us-east")
	// dieNext makes the next reconciler of eu-west to finish a message
	// die there, its batch applied and its position not stored.
	var dieNext atomic.Bool
	dying := make(chan *Reconciler, 1)
	// applying is, per partition, the reconcilers in a batch of it now:
	// never two at once.
	var amu sync.Mutex
	applying := map[int]map[*Reconciler]bool{}
	var overlaps atomic.Int64
	mortal := func(r *Reconciler) {
		r.beforeApply = func(_ context.Context, src apply.Source) {
			amu.Lock()
			defer amu.Unlock()
			if applying[src.Partition] == nil {
				applying[src.Partition] = map[*Reconciler]bool{}
			}
			if len(applying[src.Partition]) > 0 && overlaps.Add(1) == 1 {
				t.Errorf("seed %d: two reconcilers apply partition %d at once", seed, src.Partition)
			}
			applying[src.Partition][r] = true
		}
		r.afterApply = func(src apply.Source) {
			amu.Lock()
			defer amu.Unlock()
			delete(applying[src.Partition], r)
		}
		var dead atomic.Bool
		r.beforeDone = func(string, uint64) bool {
			if dead.Load() {
				return false
			}
			if dieNext.CompareAndSwap(true, false) {
				dead.Store(true)
				dying <- r
				return false
			}
			return true
		}
	}
	s.startReconciler("eu-west", mortal)
	s.startReconciler("eu-west", mortal)
	s.waitReady()

	// The reference model: what each key was spent, by flush published.
	var mu sync.Mutex
	want := map[string]float64{}
	js, err := jetstream.New(s.connectAs("limiterd-us-east"))
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var traffic sync.WaitGroup
	trng := rand.New(rand.NewPCG(seed, 1))
	traffic.Go(func() {
		for f := 0; ; f++ {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(5+trng.IntN(20)) * time.Millisecond):
			}
			spends := make([]gossip.Spend, 1+trng.IntN(60))
			for i := range spends {
				spends[i] = gossip.Spend{Rule: "quota", Key: "m-" + strconv.Itoa(trng.IntN(400)), Cost: float64(1 + trng.IntN(5))}
			}
			data := batchOf(t, "us-east", "model", uint64(f+1), spends...)
			// Published once: again under the same id until the stream
			// says it has it (a NATS restart in between; a publish whose
			// ack was lost may be stored already, so it is not given up).
			for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				_, err := js.Publish(ctx, gossip.LocalSubject("us-east"), data, jetstream.WithMsgID(fmt.Sprintf("model-%d", f)))
				cancel()
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Errorf("flush %d not published within 30s: %v", f, err)
					return
				}
			}
			mu.Lock()
			for _, sp := range spends {
				want[sp.Key] += sp.Cost
			}
			mu.Unlock()
		}
	})

	faults := []string{"reconciler", "redis", "nats"}
	rng.Shuffle(len(faults), func(i, j int) { faults[i], faults[j] = faults[j], faults[i] })
	for _, f := range faults {
		time.Sleep(time.Duration(500+rng.IntN(1500)) * time.Millisecond)
		began := time.Now()
		switch f {
		case "reconciler":
			dieNext.Store(true)
			select {
			case r := <-dying:
				crash(r)
				time.Sleep(time.Second)
				s.startReconciler("eu-west", mortal)
			case <-time.After(20 * time.Second):
				t.Fatal("no reconciler of eu-west finished a message within 20s")
			}
		case "redis":
			primaries := s.regions["eu-west"].cluster.PrimaryAddrs()
			unpause := redistest.Pause(t, primaries[rng.IntN(len(primaries))])
			time.Sleep(time.Duration(1000+rng.IntN(2000)) * time.Millisecond)
			unpause()
		case "nats":
			s.nats.Shutdown()
			time.Sleep(time.Duration(200+rng.IntN(800)) * time.Millisecond)
			s.nats.Restart(t)
		}
		t.Logf("seed %d: %s fault, %v", seed, f, time.Since(began).Round(10*time.Millisecond))
	}
	time.Sleep(time.Second)
	close(stop)
	traffic.Wait()
	mu.Lock()
	defer mu.Unlock()
	var total float64
	for _, v := range want {
		total += v
	}
	t.Logf("seed %d: %d keys, %v tokens published", seed, len(want), total)
	s.exact(t, "eu-west", want)
}
