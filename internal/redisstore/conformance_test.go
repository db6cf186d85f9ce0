package redisstore

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// conformanceCases cover every algorithm, with parameters that make
// rounding matter (rates that do not divide a second, fractional costs), and
// rules whose capacity changes under an active key: halfway through, the
// steps go on under then.
var conformanceCases = []struct {
	name string
	lim  bucket.Limit
	then *bucket.Limit
}{
	{name: "token bucket", lim: bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 3}},
	{name: "token bucket fractional", lim: bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 2.5, RefillPerSecond: 0.7}},
	{name: "gcra", lim: bucket.Limit{Algorithm: bucket.GCRA, Capacity: 5, RefillPerSecond: 7}},
	{name: "sliding window", lim: bucket.Limit{Algorithm: bucket.SlidingWindow, Capacity: 12, Window: 3 * time.Second}},
	{name: "sliding log", lim: bucket.Limit{Algorithm: bucket.SlidingLog, Capacity: 6, Window: 2 * time.Second}},
	{name: "fixed window", lim: bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 8, Window: time.Second}},
	{name: "token bucket capacity lowered",
		lim:  bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 1000, RefillPerSecond: 1},
		then: &bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 1}},
	{name: "token bucket capacity raised",
		lim:  bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 1},
		then: &bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 1000, RefillPerSecond: 1}},
	{name: "gcra capacity lowered",
		lim:  bucket.Limit{Algorithm: bucket.GCRA, Capacity: 1000, RefillPerSecond: 1},
		then: &bucket.Limit{Algorithm: bucket.GCRA, Capacity: 10, RefillPerSecond: 1}},
	{name: "gcra rate raised",
		lim:  bucket.Limit{Algorithm: bucket.GCRA, Capacity: 100, RefillPerSecond: 0.5},
		then: &bucket.Limit{Algorithm: bucket.GCRA, Capacity: 100, RefillPerSecond: 20}},
}

// TestConformance runs one table of (time, cost) steps against the Go
// algorithms and the Lua scripts on a real cluster, and requires the same
// decisions at every step, and an expiry on every key a script wrote.
func TestConformance(t *testing.T) {
	c := testenv.RedisCluster(t, 3, 0)
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { client.Close() })
	ctx := context.Background()

	for li, tc := range conformanceCases {
		t.Run(tc.name, func(t *testing.T) {
			lim := tc.lim
			src, err := lua.Single(string(lim.Algorithm), lua.FixedClock)
			if err != nil {
				t.Fatal(err)
			}
			script := redis.NewScript(src)
			debit := redis.NewScript(lua.Debit(lua.FixedClock))
			seq := 0
			rng := rand.New(rand.NewPCG(uint64(li), 42))
			// The fake clock starts at the real one and only runs ahead of
			// it, so real expiry never removes state the algorithm needs.
			now := time.Now().UnixMicro()
			key := Key(fmt.Sprintf("conf%d", li), "client")
			var st bucket.State
			allowed, refused, refusedAfterChange := 0, 0, 0
			const steps = 400
			for step := range steps {
				if step == steps/2 && tc.then != nil {
					lim = *tc.then
				}
				switch rng.IntN(4) {
				case 0: // same instant
				case 1:
					now += rng.Int64N(1000)
				case 2:
					now += rng.Int64N(400_000)
				case 3:
					now += rng.Int64N(3_000_000)
				}
				cost := []float64{1, 1, 1, 2, 3}[rng.IntN(5)]
				if lim.Algorithm != bucket.SlidingLog && rng.IntN(4) == 0 {
					cost = 0.25 + float64(rng.IntN(8))/4
				}
				if cost > lim.Capacity {
					cost = 1
				}
				if rng.IntN(5) == 0 {
					// Another region spent some: debit both, compare later.
					amount := float64(1 + rng.IntN(int(2*lim.Capacity)))
					wantOver := lim.Debit(&st, now, amount)
					seq++
					a := scriptArgs(lim, amount)
					res, err := debit.Run(ctx, client, []string{StreamMarkerKey("client", fmt.Sprint("r", li)), key},
						strconv.Itoa(seq), "60000", "7", string(lim.Algorithm), a[0], a[1], a[2], strconv.FormatInt(now, 10)).Slice()
					if err != nil || len(res) != 2 || res[0] != int64(1) {
						t.Fatalf("step %d: debit = %v, %v", step, res, err)
					}
					if over, _ := strconv.ParseFloat(res[1].(string), 64); over != wantOver {
						t.Fatalf("step %d: debit of %v: overshoot lua %v, go %v", step, amount, over, wantOver)
					}
					// The same message again debits nothing.
					res, err = debit.Run(ctx, client, []string{StreamMarkerKey("client", fmt.Sprint("r", li)), key},
						strconv.Itoa(seq), "60000", "7", string(lim.Algorithm), a[0], a[1], a[2], strconv.FormatInt(now, 10)).Slice()
					if err != nil || len(res) != 1 || res[0] != int64(0) {
						t.Fatalf("step %d: repeated debit = %v, %v; want {0} (duplicate)", step, res, err)
					}
					continue
				}
				want := lim.Take(&st, now, cost)
				a := scriptArgs(lim, cost)
				res, err := script.Run(ctx, client, []string{key}, a[0], a[1], a[2], strconv.FormatInt(now, 10)).Slice()
				if err != nil {
					t.Fatalf("step %d: %v", step, err)
				}
				got, err := parseDecision(res, lim.Capacity)
				if err != nil {
					t.Fatalf("step %d: %v", step, err)
				}
				if got != want {
					t.Fatalf("step %d at %d cost %v:\n  lua %+v\n   go %+v", step, now, cost, got, want)
				}
				if got.Allowed {
					allowed++
					ttl, err := client.PTTL(ctx, key).Result()
					if err != nil || ttl <= 0 {
						t.Fatalf("step %d: key written without an expiry: ttl %v, %v", step, ttl, err)
					}
				} else {
					refused++
					if step >= steps/2 {
						refusedAfterChange++
					}
				}
			}
			if allowed == 0 || refused == 0 {
				t.Fatalf("steps exercised one outcome only: %d allowed, %d refused", allowed, refused)
			}
			if tc.then != nil && refusedAfterChange == 0 {
				t.Fatalf("no refusal after the change to %+v", *tc.then)
			}
		})
	}
}

// TestStoreExpiry checks the expiry the production scripts set against
// DESIGN: a bucket expires when it would be full again, a fixed window at its
// end, a sliding window two windows on, a log one window after its newest entry.
func TestStoreExpiry(t *testing.T) {
	c := testenv.RedisCluster(t, 3, 0)
	ctx := context.Background()
	s, err := New(ctx, Options{Addrs: c.Addrs(), Timeout: time.Second}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	tests := []struct {
		lim      bucket.Limit
		cost     float64
		min, max time.Duration
	}{
		{bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 100, RefillPerSecond: 10}, 30, 2900 * time.Millisecond, 3 * time.Second},
		{bucket.Limit{Algorithm: bucket.GCRA, Capacity: 100, RefillPerSecond: 10}, 5, 400 * time.Millisecond, 500 * time.Millisecond},
		{bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 100, Window: time.Hour}, 1, time.Millisecond, time.Hour},
		{bucket.Limit{Algorithm: bucket.SlidingWindow, Capacity: 100, Window: time.Hour}, 1, time.Hour, 2 * time.Hour},
		{bucket.Limit{Algorithm: bucket.SlidingLog, Capacity: 10, Window: time.Minute}, 1, 59 * time.Second, time.Minute},
	}
	for _, tt := range tests {
		t.Run(string(tt.lim.Algorithm), func(t *testing.T) {
			req := bucket.Request{Rule: "ttl-" + string(tt.lim.Algorithm), Key: "client{1}", Limit: tt.lim, Cost: tt.cost}
			d, err := s.Take(ctx, req)
			if err != nil || !d.Allowed {
				t.Fatalf("Take = %+v, %v", d, err)
			}
			ttl, err := s.Client().PTTL(ctx, Key(req.Rule, req.Key)).Result()
			if err != nil || ttl < tt.min || ttl > tt.max {
				t.Fatalf("PTTL = %v (%v), want within [%v, %v]", ttl, err, tt.min, tt.max)
			}
		})
	}
}
