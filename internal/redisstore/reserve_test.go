package redisstore

import (
	"context"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestReserveConformance steps paced requests of one to three token
// bucket and GCRA rules of one key, at random instants and waits, with
// reservations given back (the newest, or an older one that cannot come
// back), through the Go store (bucket.Memory on a fixed clock) and the Lua
// scripts on a real cluster, and requires identical decisions, waits,
// reservations and give-backs at every step.
func TestReserveConformance(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { client.Close() })
	ctx := context.Background()
	reserve := redis.NewScript(lua.Reserve(lua.FixedClock))
	unreserve := redis.NewScript(lua.Unreserve(lua.FixedClock))

	limits := []bucket.Limit{
		{Algorithm: bucket.GCRA, Capacity: 1, RefillPerSecond: 100},
		{Algorithm: bucket.TokenBucket, Capacity: 5, RefillPerSecond: 3},
		{Algorithm: bucket.TokenBucket, Capacity: 2.5, RefillPerSecond: 0.7},
		{Algorithm: bucket.GCRA, Capacity: 1000, RefillPerSecond: 660_000},
		{Algorithm: bucket.GCRA, Capacity: 10, RefillPerSecond: 1e-3},
	}
	var total struct{ allowed, refused, waited, back, stacked int }
	for run := range 8 {
		rng := rand.New(rand.NewPCG(uint64(run), 7))
		now := time.Now().UnixMicro()
		mem := bucket.NewMemory(bucket.WithClock(func() time.Time { return time.UnixMicro(now) }))
		key := "pace-" + strconv.Itoa(run)
		var rules []bucket.Request
		for i, li := range rng.Perm(len(limits))[:1+rng.IntN(3)] {
			rules = append(rules, bucket.Request{Rule: "r" + strconv.Itoa(i), Key: key, Limit: limits[li]})
		}
		type held struct {
			req bucket.Request
			res int64
		}
		var reservations []held
		allowed, refused, waited, back := 0, 0, 0, 0
		for step := range 300 {
			switch rng.IntN(4) {
			case 0:
			case 1:
				now += rng.Int64N(2000)
			case 2:
				now += rng.Int64N(50_000)
			case 3:
				now += rng.Int64N(3_000_000)
			}
			if len(reservations) > 0 && rng.IntN(5) == 0 {
				// Give back the newest or an older reservation.
				h := reservations[len(reservations)-1]
				if rng.IntN(2) == 0 {
					h = reservations[rng.IntN(len(reservations))]
				}
				want, _ := mem.Unreserve(ctx, h.req, h.res)
				a := scriptArgs(h.req.Limit, h.req.Cost)
				res, err := unreserve.Run(ctx, client, []string{Key(h.req.Rule, h.req.Key)}, a[0], a[1], a[2],
					"-"+strconv.FormatInt(h.res, 10), strconv.FormatInt(now, 10)).Slice()
				if err != nil {
					t.Fatalf("run %d step %d: unreserve: %v", run, step, err)
				}
				if got := res[0] == int64(1); got != want {
					t.Fatalf("run %d step %d: unreserve lua %v, go %v", run, step, got, want)
				}
				if want {
					back++
				} else {
					total.stacked++
				}
				continue
			}
			maxWait := time.Duration(1+rng.Int64N(int64(2*time.Second/time.Microsecond))) * time.Microsecond
			reqs := make([]bucket.Request, len(rules))
			for i, r := range rules {
				r.Cost = []float64{1, 1, 0.5, 2}[rng.IntN(4)]
				r.Cost = min(r.Cost, r.Limit.Capacity)
				r.MaxWait = maxWait
				reqs[i] = r
			}
			want, err := mem.TakeAll(ctx, reqs)
			if err != nil {
				t.Fatal(err)
			}
			keys, args := groupArgs(reqs)
			args = append([]any{strconv.FormatInt(maxWait.Nanoseconds(), 10)}, args...)
			args = append(args, strconv.FormatInt(now, 10))
			res, err := reserve.Run(ctx, client, keys, args...).Slice()
			if err != nil {
				t.Fatalf("run %d step %d: %v", run, step, err)
			}
			got, err := parseReserveReply(res, reqs)
			if err != nil {
				t.Fatal(err)
			}
			for i := range want {
				if got[i] != want[i] {
					t.Fatalf("run %d step %d rule %d (%+v) wait %v:\n  lua %+v\n   go %+v", run, step, i, reqs[i].Limit, maxWait, got[i], want[i])
				}
			}
			if want[0].Allowed && allAllowed(want) {
				allowed++
				if want[0].Wait > 0 {
					waited++
				}
				for i := range reqs {
					reservations = append(reservations, held{reqs[i], want[i].Reservation})
				}
			} else {
				refused++
			}
		}
		t.Logf("run %d (%d rules): %d allowed (%d waited), %d refused, %d given back", run, len(rules), allowed, waited, refused, back)
		total.allowed, total.refused, total.waited, total.back = total.allowed+allowed, total.refused+refused, total.waited+waited, total.back+back
	}
	if total.allowed == 0 || total.refused == 0 || total.waited == 0 || total.back == 0 || total.stacked == 0 {
		t.Fatalf("the steps exercised too little: %+v", total)
	}
}
