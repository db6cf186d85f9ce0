package redisstore

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestHold holds the hold (lua/hold.lua) to its arithmetic, at fixed
// instants on a real Redis: a debit that leaves a bucket or window near
// empty records how much its source spends and how late, and a check
// near the limit leaves that much for the spends still in flight. The
// cases use a capacity of 100 at 1 token/s (a window: 100 a minute), and
// a debit whose last admission was
// 95 ms before it landed: its source spends 10 tokens per 0.1 s (the
// least window), so 9.5 tokens are in flight, and half a batch (5) waits
// there unpublished: 14.5 tokens held.
func TestHold(t *testing.T) {
	client := nodeClient(t)
	ctx := context.Background()
	s := newScriptTaker(t, client)
	debit := redis.NewScript(lua.Debit(lua.FixedClock))
	usage := redis.NewScript(lua.Usage(lua.FixedClock))
	now := (time.Now().UnixMicro()/60e6 + 1) * 60e6
	const lag = 95_000
	seq := 0
	// spend debits amount of key from the source whose marker is for src,
	// last admitted seen, at now.
	spend := func(lim bucket.Limit, key, src string, amount float64, seen, at int64) {
		t.Helper()
		seq++
		a := scriptArgs(lim, amount)
		marker := PartitionMarkerKey("c", src, 0)
		if err := debit.Run(ctx, client, []string{marker, key}, strconv.Itoa(seq), "60000", "7", string(lim.Algorithm),
			a[0], a[1], a[2], "0", strconv.FormatInt(seen, 10), strconv.FormatInt(at, 10)).Err(); err != nil {
			t.Fatal(err)
		}
	}
	held := func(key string) bool {
		t.Helper()
		n, err := client.Exists(ctx, key+"~h").Result()
		if err != nil {
			t.Fatal(err)
		}
		return n == 1
	}
	for _, alg := range []bucket.Algorithm{bucket.TokenBucket, bucket.GCRA, bucket.FixedWindow, bucket.SlidingWindow} {
		lim := bucket.Limit{Algorithm: alg, Capacity: 100, RefillPerSecond: 1}
		// refilled is what 0.8 s gives back: a window of a minute, begun
		// at now, gives back nothing.
		refilled := 1
		if alg == bucket.FixedWindow || alg == bucket.SlidingWindow {
			lim = bucket.Limit{Algorithm: alg, Capacity: 100, Window: time.Minute}
			refilled = 0
		}
		// setup spends local of a fresh bucket here, then debits each of
		// remote from its own source.
		setup := func(name string, local float64, seen int64, remote ...float64) string {
			key := Key(name+"-"+string(alg), "c")
			if d := s.take(s.single[alg], key, lim, local, []int64{now})[0]; !d.Allowed {
				t.Fatalf("%s: a local spend of %v refused", key, local)
			}
			for i, r := range remote {
				spend(lim, key, "src"+strconv.Itoa(i), r, seen, now)
			}
			return key
		}
		for _, c := range []struct {
			name   string
			local  float64
			seen   int64
			remote []float64
			at     int64 // after now
			want   int   // checks of 1 passing at now+at
			hold   bool  // whether a hold was recorded
		}{
			// 20 left, 14.5 held.
			{"one-source", 70, now - lag, []float64{10}, 0, 5, true},
			// Without the last admission, no hold: all 20.
			{"unknown-lag", 70, 0, []float64{10}, 0, 20, false},
			// Two sources of 5: 7.25 each.
			{"two-sources", 70, now - lag, []float64{5, 5}, 0, 5, true},
			// 0.8 s later: 20.8 left (a bucket; a window 20), the source
			// silent since: its hold decays to 1.47.
			{"decayed", 70, now - lag, []float64{10}, 800_000, 18 + refilled, true},
			// A second of lag and 25 tokens: 262.5 held, at most half the
			// capacity: 60 left, 10 pass.
			{"at-most-half", 15, now - 2_000_000, []float64{25}, 0, 10, true},
			// The long tail: a debit that leaves the bucket 80% full
			// records nothing, and nothing is held.
			{"long-tail", 10, now - lag, []float64{10}, 0, 80, false},
		} {
			key := setup(c.name, c.local, c.seen, c.remote...)
			if got := held(key); got != c.hold {
				t.Errorf("%s %s: hold recorded %v, want %v", alg, c.name, got, c.hold)
			}
			ds := s.take(s.single[alg], key, lim, 1, repeatInstant(now+c.at, c.want+20))
			if got := countAllowed(ds); got != c.want {
				t.Errorf("%s %s: %d checks of 1 pass, want %d", alg, c.name, got, c.want)
			}
			// A check the hold refused says when to come back: soon, and
			// never at once.
			if last := ds[len(ds)-1]; last.Allowed || last.RetryAfter <= 0 || last.RetryAfter > 2*time.Minute {
				t.Errorf("%s %s: the last check %+v, want refused with a retry within 2 minutes", alg, c.name, last)
			}
		}

		// What a check would see says the same: 5.5 of room, so 5 pass
		// and 6 do not.
		key := setup("usage", 70, now-lag, 10)
		for cost, want := range map[float64]int64{5: 1, 6: 0} {
			a := scriptArgs(lim, cost)
			res, err := usage.Run(ctx, client, []string{key}, string(alg), a[0], a[1], a[2], "0", strconv.FormatInt(now, 10)).Slice()
			if err != nil {
				t.Fatal(err)
			}
			if got, _ := res[0].(int64); got != want {
				t.Errorf("%s usage of cost %v: allowed %d, want %d", alg, cost, got, want)
			}
		}
		// The hold's key expires on its own, 2.5 s after the last debit
		// (the fixed clock's scripts add an hour to every expiry).
		if ttl := client.PTTL(ctx, key+"~h").Val() - time.Hour; ttl <= 2*time.Second || ttl > 2500*time.Millisecond {
			t.Errorf("%s hold key's TTL %v beyond the fixed clock's hour, want in (2s, 2.5s]", alg, ttl)
		}
	}
}
