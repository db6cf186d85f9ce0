package redisstore

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// conformanceCases cover every algorithm, with parameters that make
// rounding matter (rates that do not divide a second, fractional costs),
// the extremes of capacity and rate, and rules whose capacity changes under
// an active key: halfway through, the steps go on under then.
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
	{name: "token bucket 1 at 1e6", lim: bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 1, RefillPerSecond: 1e6}},
	{name: "gcra 1000 at 660000", lim: bucket.Limit{Algorithm: bucket.GCRA, Capacity: 1000, RefillPerSecond: 660_000}},
	{name: "token bucket 1e9 at 1e6", lim: bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 1e9, RefillPerSecond: 1e6}},
	{name: "token bucket 1e9 filling in 1e8 s", lim: bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 1e9, RefillPerSecond: 10}},
	{name: "gcra 100 at 1e-3", lim: bucket.Limit{Algorithm: bucket.GCRA, Capacity: 100, RefillPerSecond: 1e-3}},
	{name: "fixed window 1e9 a day", lim: bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 1e9, Window: 24 * time.Hour}},
	{name: "sliding window 3 per ms", lim: bucket.Limit{Algorithm: bucket.SlidingWindow, Capacity: 3, Window: time.Millisecond}},
	{name: "sliding log 1000 per s", lim: bucket.Limit{Algorithm: bucket.SlidingLog, Capacity: 1000, Window: time.Second}},
}

// conformance holds what one run of steps needs: the cluster, the scripts.
type conformance struct {
	ctx    context.Context
	client *redis.ClusterClient
	debit  *redis.Script
	undo   *redis.Script
	// handoff reads and seeds buckets as a key's old and new homes do.
	handoff *redis.Script
	// usage reads what a check would see, changing nothing.
	usage *redis.Script
	// settle settles an estimate with its actual cost, once.
	settle *redis.Script
	// multi checks rules all or nothing, each keeping its request's
	// reserve for higher priority classes.
	multi *redis.Script
	seq   int
}

func newConformance(t *testing.T) *conformance {
	c := redistest.NewCluster(t, 3, 0)
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { client.Close() })
	return &conformance{ctx: context.Background(), client: client, debit: redis.NewScript(lua.Debit(lua.FixedClock)),
		undo:    redis.NewScript(lua.Undo(lua.FixedClock)),
		handoff: redis.NewScript(lua.Handoff(lua.FixedClock)),
		usage:   redis.NewScript(lua.Usage(lua.FixedClock)),
		settle:  redis.NewScript(lua.Settle(lua.FixedClock)),
		multi:   redis.NewScript(lua.Multi(lua.FixedClock))}
}

// conformanceRun is what run saw.
type conformanceRun struct {
	allowed, refused, refusedAfterChange, debits, refilled, handoffs, stepsBack, undos, usages, settles, credits int
	// reserved counts refusals for a priority class's reserve only.
	reserved int
}

// conformanceKeeps are the reserves a check keeps by priority class: with
// reserve {critical: 0.2, default: 0.05}, critical keeps nothing, default
// 0.2 and sheddable 0.25 of the capacity; the last is drawn at random.
var conformanceKeeps = []float64{0, 0.2, 0.25, -1}

// run steps through one table of (time, cost) steps, and debits, against
// the Go algorithms and the Lua scripts, and fails at the first step where
// the decisions (or a debit's overshoot) differ, or a key is written
// without an expiry. Halfway through, the limit becomes then (if not nil).
// Time jumps are at most maxJump µs. Now and then the clock steps back (a
// failover to a node whose clock is behind, an NTP step), and an allowed
// spend is undone, at the instant it was spent, some steps later (across
// window boundaries too): the state each leaves is held to the same by the
// decisions that follow.
func (cf *conformance) run(t *testing.T, name string, start int64, lim bucket.Limit, then *bucket.Limit, rng *rand.Rand, steps int, maxJump int64) conformanceRun {
	t.Helper()
	scripts := map[bucket.Algorithm]*redis.Script{}
	script := func(a bucket.Algorithm) *redis.Script {
		if scripts[a] == nil {
			src, err := lua.Single(string(a), lua.FixedClock)
			if err != nil {
				t.Fatal(err)
			}
			scripts[a] = redis.NewScript(src)
		}
		return scripts[a]
	}
	ctx, client := cf.ctx, cf.client
	// The fake clock starts at start (conformanceStart: an hour ahead of
	// the real one) and only runs
	// further ahead, so real expiry never removes state the algorithm
	// needs: a fixed window expires at its end (PXAT, absolute, with no
	// pad), which a clock starting at the real one can let pass in real
	// time while the steps are still in that window (a window of a few ms,
	// steps that call Redis without moving the clock).
	now := start
	key := Key("conf-"+name, "client")
	marker := PartitionMarkerKey("client", "r-"+name, 0)
	var st bucket.State
	var run conformanceRun
	var retry int64
	// spends are allowed spends not undone yet: their instants and costs.
	type spend struct {
		at   int64
		cost float64
	}
	var spends []spend
	// classes draws each check's priority class (the reserve it keeps)
	// apart from rng, so that the steps are those of every other run.
	classes := rand.New(rand.NewPCG(uint64(start), uint64(len(name))))
	scale := lim.Capacity / lim.RefillPerSecond * 1e6 // µs to fill, or
	if lim.Window > 0 {
		scale = float64(lim.Window.Microseconds())
	}
	for step := range steps {
		if step == steps/2 && then != nil {
			lim = *then
		}
		switch rng.IntN(6) {
		case 0: // same instant
		case 1:
			now += rng.Int64N(1000)
		case 2:
			now += rng.Int64N(400_000)
		case 3:
			now += min(int64(rng.Float64()*scale), maxJump)
		case 4:
			now += min(int64(rng.Float64()*scale/20), maxJump)
		case 5:
			now += retry // exactly when the last refusal said
		}
		if rng.IntN(12) == 0 {
			// The clock steps back, by a few µs or up to a window (never
			// behind the real clock: real expiry must not remove state).
			back := 1 + rng.Int64N(5)
			if rng.IntN(2) == 0 {
				back = min(int64(rng.Float64()*scale), 2_000_000)
			}
			now -= back
			run.stepsBack++
		}
		if len(spends) > 0 && rng.IntN(10) == 0 {
			// An all-or-nothing check refused elsewhere: its spend here
			// given back, at the instant it was spent.
			sp := spends[rng.IntN(len(spends))]
			if rng.IntN(2) == 0 {
				// Or the spend was an estimate, settled with its actual
				// cost (below or above it), once.
				actual := math.Round(sp.cost*2*rng.Float64()*1000) / 1000
				if lim.Algorithm == bucket.SlidingLog {
					actual = math.Round(actual)
				}
				lim.Settle(&st, now, sp.at, sp.cost, actual)
				cf.seq++
				id := "s" + strconv.Itoa(cf.seq)
				a := scriptArgs(lim, sp.cost)
				act := strconv.FormatFloat(actual, 'g', -1, 64)
				for i, want := range []int64{1, 0} {
					res, err := cf.settle.Run(ctx, client, []string{key, SettleKey("client", id)}, string(lim.Algorithm), a[0], a[1], a[2],
						act, strconv.FormatInt(sp.at, 10), "60000", id, strconv.FormatInt(now, 10)).Slice()
					if err != nil || len(res) != 2 || res[0] != want || res[1] != act {
						t.Fatalf("step %d: settle #%d = %v, %v; want {%d, %s}", step, i+1, res, err, want, act)
					}
				}
				spends = slices.DeleteFunc(spends, func(x spend) bool { return x == sp })
				run.settles++
				continue
			}
			lim.Undo(&st, now, sp.at, sp.cost)
			keys, args := groupArgs([]bucket.Request{{Rule: "conf-" + name, Key: "client", Limit: lim, Cost: sp.cost}})
			keys[0] = key
			args = append(undoArgs(sp.at, args), strconv.FormatInt(now, 10))
			if err := cf.undo.Run(ctx, client, keys, args...).Err(); err != nil && !errors.Is(err, redis.Nil) {
				t.Fatalf("step %d: undo = %v", step, err)
			}
			spends = slices.DeleteFunc(spends, func(x spend) bool { return x == sp })
			run.undos++
			continue
		}
		cost := []float64{1, 1, 1, 2, 3}[rng.IntN(5)]
		if lim.Algorithm != bucket.SlidingLog {
			switch rng.IntN(4) {
			case 0:
				cost = 0.25 + float64(rng.IntN(8))/4
			case 1:
				cost = float64(1+rng.IntN(999)) / 1000
			case 2:
				cost = math.Round(lim.Capacity*rng.Float64()*1000) / 1000
			}
		}
		if cost > lim.Capacity || cost <= 0 {
			cost = min(1, lim.Capacity)
		}
		if rng.IntN(5) == 0 {
			// Another region spent some: debit both, compare the overshoots.
			amount := float64(1 + rng.IntN(int(min(2*lim.Capacity, 1e6))))
			if rng.IntN(4) == 0 {
				// Far beyond the debt bound.
				amount = (lim.Capacity + lim.RefillPerSecond*bucket.DebtHorizon.Seconds()) * 3 * float64(1+rng.IntN(100))
			}
			var wantOver float64
			// As of the spend's last admission: now, or up to two fill
			// times or windows before (so a spend refilled by now, or
			// of a window that no longer counts, comes up often).
			at := now
			if rng.IntN(2) == 0 {
				at = max(now-int64(rng.Float64()*2*scale), 1)
			}
			changed := true
			if rng.IntN(4) == 0 {
				// Or another region's settlement gave back some: a
				// negative amount, credited.
				amount = -math.Min(amount, lim.Capacity)
				lim.Credit(&st, now, -amount)
				run.credits++
			} else {
				wantOver, changed = lim.DebitAt(&st, now, at, amount)
			}
			cf.seq++
			a := scriptArgs(lim, amount)
			args := []any{strconv.Itoa(cf.seq), "60000", "7", string(lim.Algorithm), a[0], a[1], a[2], strconv.FormatInt(at, 10), "0", strconv.FormatInt(now, 10)}
			res, err := cf.debit.Run(ctx, client, []string{marker, key}, args...).Slice()
			if !changed {
				// Refilled before it arrived: nothing written, not even
				// the marker, so the same message again decides alike.
				for range 2 {
					if err != nil || len(res) != 1 || res[0] != int64(2) {
						t.Fatalf("step %d: debit of %v as of %v = %v, %v; want {2} (refilled)", step, amount, now-at, res, err)
					}
					res, err = cf.debit.Run(ctx, client, []string{marker, key}, args...).Slice()
				}
				run.refilled++
				continue
			}
			if err != nil || len(res) != 2 || res[0] != int64(1) {
				t.Fatalf("step %d: debit as of %v = %v, %v", step, now-at, res, err)
			}
			if over, _ := strconv.ParseFloat(res[1].(string), 64); over != wantOver {
				t.Fatalf("step %d: debit of %v as of %v: overshoot lua %v, go %v", step, amount, now-at, over, wantOver)
			}
			// The same message again debits nothing.
			res, err = cf.debit.Run(ctx, client, []string{marker, key}, args...).Slice()
			if err != nil || len(res) != 1 || res[0] != int64(0) {
				t.Fatalf("step %d: repeated debit = %v, %v; want {0} (duplicate)", step, res, err)
			}
			run.debits++
			continue
		}
		if rng.IntN(8) == 0 {
			// A handoff: what the bucket counts, then the bucket seeded as
			// a key's new home seeds it.
			wantUsed := lim.Used(&st, now)
			a := scriptArgs(lim, 0)
			at := strconv.FormatInt(now, 10)
			res, err := cf.handoff.Run(ctx, client, []string{key}, "used", string(lim.Algorithm), a[0], a[1], at).StringSlice()
			if err != nil || len(res) != 1 {
				t.Fatalf("step %d: handoff used = %v, %v", step, res, err)
			}
			if used, _ := strconv.ParseFloat(res[0], 64); used != wantUsed {
				t.Fatalf("step %d at %d: used lua %v, go %v", step, now, used, wantUsed)
			}
			// Seeded by another count, above or below its own: raised to
			// at least that, never lowered.
			seedUsed := math.Round(wantUsed*2*rng.Float64()*1e6) / 1e6
			lim.Raise(&st, now, seedUsed)
			cf.seq++
			gen := strconv.Itoa(cf.seq)
			seedKey := SeedKey(bucket.Seed{Rule: "conf-" + name, Key: "client"})
			a = scriptArgs(lim, seedUsed)
			for i, want := range []int64{1, 0} { // seeded once per generation
				n, err := cf.handoff.Run(ctx, client, []string{seedKey, key}, "seed", gen, "60000", string(lim.Algorithm), a[0], a[1], a[2], at).Int64Slice()
				if err != nil || len(n) != 1 || n[0] != want {
					t.Fatalf("step %d: seed #%d = %v, %v; want {%d}", step, i+1, n, err, want)
				}
			}
			run.handoffs++
			continue
		}
		a := scriptArgs(lim, cost)
		// The check's class: the reserve it keeps. A check that keeps
		// one, and now and then one that does not, runs the multi script.
		keep := conformanceKeeps[classes.IntN(len(conformanceKeeps))]
		if keep < 0 {
			keep = classes.Float64()
		}
		multi := keep > 0 || classes.IntN(4) == 0
		var read *bucket.Decision // what the usage said, when read
		if rng.IntN(3) == 0 {
			// What the check of its class would see, read twice, changing
			// nothing: the take that follows is held to the Go state Usage
			// left alone.
			want := lim.UsageKeeping(&st, now, cost, keep)
			for range 2 {
				res, err := cf.usage.Run(ctx, client, []string{key}, string(lim.Algorithm), a[0], a[1], a[2],
					strconv.FormatFloat(keep, 'g', -1, 64), strconv.FormatInt(now, 10)).Slice()
				if err != nil {
					t.Fatalf("step %d: usage: %v", step, err)
				}
				got, err := parseDecision(res, lim)
				if err != nil {
					t.Fatalf("step %d: usage: %v", step, err)
				}
				got.Reserved = reserved(got, bucket.Request{Limit: lim, Cost: cost, Keep: keep}, res[1])
				if got != want {
					t.Fatalf("step %d at %d cost %v: usage\n  lua %+v\n   go %+v", step, now, cost, got, want)
				}
			}
			read = &want
			run.usages++
		}
		want := lim.TakeKeeping(&st, now, cost, keep)
		var got bucket.Decision
		if multi {
			req := bucket.Request{Limit: lim, Cost: cost, Keep: keep}
			res, err := cf.multi.Run(ctx, client, []string{key}, string(lim.Algorithm), a[0], a[1], a[2],
				strconv.FormatFloat(keep, 'g', -1, 64), strconv.FormatInt(now, 10)).Slice()
			if err != nil {
				t.Fatalf("step %d: multi: %v", step, err)
			}
			ds, _, err := parseMultiReply(res, []bucket.Request{req})
			if err != nil {
				t.Fatalf("step %d: multi: %v", step, err)
			}
			got = ds[0]
		} else {
			res, err := script(lim.Algorithm).Run(ctx, client, []string{key}, a[0], a[1], a[2], strconv.FormatInt(now, 10)).Slice()
			if err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			if got, err = parseDecision(res, lim); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
		}
		if got != want {
			t.Fatalf("step %d at %d cost %v keep %v:\n  lua %+v\n   go %+v", step, now, cost, keep, got, want)
		}
		if got.Reserved {
			run.reserved++
		}
		// The check answers as the usage of its class just before it
		// said: whether it passes, and a refusal's figures exactly.
		if read != nil && (read.Allowed != got.Allowed || !got.Allowed && *read != got) {
			t.Fatalf("step %d at %d cost %v: usage %+v, then check %+v", step, now, cost, *read, got)
		}
		if got.Allowed {
			run.allowed++
			spends = append(spends, spend{now, cost})
			// -1: no expiry. A key of a bucket full again within a
			// millisecond may be gone already (-2) or about to go (0).
			ttl, err := client.PTTL(ctx, key).Result()
			if err != nil || ttl == -1 {
				t.Fatalf("step %d: key written without an expiry: ttl %v, %v", step, ttl, err)
			}
		} else {
			retry = got.RetryAfter.Microseconds()
			run.refused++
			if step >= steps/2 {
				run.refusedAfterChange++
			}
		}
	}
	return run
}

// TestConformance runs one table of (time, cost) steps against the Go
// algorithms and the Lua scripts on a real cluster, and requires the same
// decisions at every step (and the same count handed off to a key's new
// home), and an expiry on every key a script wrote.
func TestConformance(t *testing.T) {
	cf := newConformance(t)
	for li, tc := range conformanceCases {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(li), 42))
			run := cf.run(t, fmt.Sprint(li), conformanceStart(t), tc.lim, tc.then, rng, 400, 30*24*3600*1e6)
			if run.allowed == 0 || run.refused == 0 || run.handoffs == 0 || run.usages == 0 || run.settles == 0 || run.credits == 0 {
				t.Fatalf("steps exercised one outcome only: %d allowed, %d refused, %d handoffs, %d settles, %d credits", run.allowed, run.refused, run.handoffs, run.settles, run.credits)
			}
			if a := tc.lim.Algorithm; (a == bucket.TokenBucket || a == bucket.GCRA) && run.reserved == 0 {
				t.Fatalf("no refusal for a priority class's reserve: %+v", run)
			}
			if tc.then != nil && run.refusedAfterChange == 0 {
				t.Fatalf("no refusal after the change to %+v", *tc.then)
			}
		})
	}
}

// TestConformanceRandomLimits is TestConformance over random limits at the
// extremes the arithmetic is built for: capacities from 1 to 1e9, rates
// from 1e-3 to 1e6 per second (as Validate allows), windows from 1 ms to a
// day, whole and fractional costs, takes and debits (some far beyond the
// debt bound), at random steps.
func TestConformanceRandomLimits(t *testing.T) {
	cf := newConformance(t)
	start := conformanceStart(t)
	rounds := 1
	if v := os.Getenv("LIMITER_CONFORMANCE_ROUNDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("LIMITER_CONFORMANCE_ROUNDS=%q: want a whole number of rounds, at least 1", v)
		}
		rounds = n
	}
	for round := range rounds {
		// Each round starts 1 h 1.000001 s later: windows and buckets meet
		// the fake clock at other phases.
		at := start + int64(round)*3_601_000_001
		if rounds == 1 {
			conformanceRandomLimits(t, cf, at, "")
			continue
		}
		t.Run(fmt.Sprint("round ", round), func(t *testing.T) { conformanceRandomLimits(t, cf, at, fmt.Sprint(round, "-")) })
	}
}

// conformanceStart is where the conformance runs' fake clock starts, in
// µs: LIMITER_CONFORMANCE_START when set (a failure names the one to
// replay it), else an hour ahead of the real clock.
func conformanceStart(t *testing.T) int64 {
	t.Helper()
	start := time.Now().Add(time.Hour).UnixMicro()
	if v := os.Getenv("LIMITER_CONFORMANCE_START"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		// Redis expires keys by the real clock: a fake one behind it
		// would lose state (a failure replays within the hour).
		if now := time.Now().UnixMicro(); err != nil || n < now {
			t.Fatalf("LIMITER_CONFORMANCE_START=%q: want µs since the epoch, not before now (%d)", v, now)
		}
		start = n
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("replay: LIMITER_CONFORMANCE_START=%d go test -run '%s' ./internal/redisstore", start, t.Name())
		}
	})
	return start
}

func conformanceRandomLimits(t *testing.T, cf *conformance, start int64, prefix string) {
	rng := rand.New(rand.NewPCG(2026, 11))
	const limits, steps = 48, 250
	var total conformanceRun
	for i := 0; i < limits; {
		capacity := math.Round(math.Pow(10, rng.Float64()*9)*100) / 100
		capacity = max(capacity, 1)
		alg := bucket.Algorithms[rng.IntN(len(bucket.Algorithms))]
		lim := bucket.Limit{Algorithm: alg, Capacity: capacity}
		switch alg {
		case bucket.TokenBucket, bucket.GCRA:
			lim.RefillPerSecond = math.Round(math.Pow(10, -3+rng.Float64()*9)*1000) / 1000
		default:
			lim.Window = time.Duration(math.Pow(10, 3+rng.Float64()*8)) * time.Microsecond
			if alg == bucket.SlidingLog {
				lim.Capacity = float64(1 + rng.IntN(bucket.MaxLogCapacity))
			}
		}
		if lim.Validate() != nil {
			continue
		}
		i++
		name := fmt.Sprintf("%s %g %g %v", alg, lim.Capacity, lim.RefillPerSecond, lim.Window)
		t.Run(name, func(t *testing.T) {
			run := cf.run(t, fmt.Sprint("r", prefix, i), start, lim, nil, rng, steps, 10*24*3600*1e6)
			total.allowed += run.allowed
			total.refused += run.refused
			total.debits += run.debits
			total.refilled += run.refilled
			total.handoffs += run.handoffs
			total.stepsBack += run.stepsBack
			total.undos += run.undos
			total.reserved += run.reserved
		})
	}
	t.Logf("%d limits x %d steps: %d allowed, %d refused (%d for a class's reserve), %d debits (%d refilled before they arrived), %d handoffs, %d clock steps back, %d undos, every decision, overshoot and count handed off identical",
		limits, steps, total.allowed, total.refused, total.reserved, total.debits+total.refilled, total.refilled, total.handoffs, total.stepsBack, total.undos)
	if total.refilled == 0 || total.debits == 0 {
		t.Errorf("%d debits applied, %d refilled: the steps must try both", total.debits, total.refilled)
	}
	if total.allowed == 0 || total.refused == 0 || total.reserved == 0 || total.handoffs == 0 || total.stepsBack == 0 || total.undos == 0 {
		t.Fatalf("one outcome only: %+v", total)
	}
}

// TestStoreExpiry checks the expiry the production scripts set: a bucket
// expires the time to fill it from empty (at most bucket.KeepFull) after it
// would be full again, a fixed window at its end, a sliding window two
// windows on, a log one window after its newest entry.
func TestStoreExpiry(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
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
		// Full in 3 s; 10 s to fill, the most kept.
		{bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 100, RefillPerSecond: 10}, 30, 12900 * time.Millisecond, 13 * time.Second},
		{bucket.Limit{Algorithm: bucket.GCRA, Capacity: 100, RefillPerSecond: 10}, 5, 10400 * time.Millisecond, 10500 * time.Millisecond},
		// Full in 50 ms, kept 100 ms more: its time to fill.
		{bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 100}, 5, 140 * time.Millisecond, 150 * time.Millisecond},
		// Full in 30 min, kept 10 s more.
		{bucket.Limit{Algorithm: bucket.GCRA, Capacity: 100, RefillPerSecond: 1.0 / 60}, 30, 30*time.Minute + 9900*time.Millisecond, 30*time.Minute + 10*time.Second},
		{bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 100, Window: time.Hour}, 1, time.Millisecond, time.Hour},
		{bucket.Limit{Algorithm: bucket.SlidingWindow, Capacity: 100, Window: time.Hour}, 1, time.Hour, 2 * time.Hour},
		{bucket.Limit{Algorithm: bucket.SlidingLog, Capacity: 10, Window: time.Minute}, 1, 59 * time.Second, time.Minute},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%s %g %g", tt.lim.Algorithm, tt.lim.Capacity, tt.lim.RefillPerSecond), func(t *testing.T) {
			req := bucket.Request{Rule: fmt.Sprintf("ttl-%s-%g", tt.lim.Algorithm, tt.lim.RefillPerSecond), Key: "client{1}", Limit: tt.lim, Cost: tt.cost}
			start := time.Now()
			d, err := s.Take(ctx, req)
			if err != nil || !d.Allowed {
				t.Fatalf("Take = %+v, %v", d, err)
			}
			ttl, err := s.Client().PTTL(ctx, Key(req.Rule, req.Key)).Result()
			// The TTL runs down while the reply travels: by at most the
			// time since the check was sent (2 ms once, on a loaded machine).
			if low := tt.min - time.Since(start).Round(time.Millisecond) - time.Millisecond; err != nil || ttl < low || ttl > tt.max {
				t.Fatalf("PTTL = %v (%v), want within [%v, %v]", ttl, err, low, tt.max)
			}
		})
	}
}

// TestConformanceCorners replays, step by step, the cases the random runs
// found where the scripts and the Go algorithms parted, on a real cluster:
//   - a sliding log's spend at an instant after an undo there: its member
//     took the set's size as its number, one still in use, and the ZADD
//     added nothing (a spend admitted and never counted);
//   - a GCRA bucket an undo makes full, then a clock stepped back: the
//     script deleted the key (full), Go kept it full "at now" (a debt at
//     any earlier instant).
func TestConformanceCorners(t *testing.T) {
	cf := newConformance(t)
	type step struct {
		undo bool
		at   int64 // µs after the start; for an undo, the spend's instant
		now  int64 // an undo's instant, µs after the start
		cost float64
	}
	tests := []struct {
		name  string
		lim   bucket.Limit
		steps []step
	}{
		{name: "sliding log undo then spend at one instant",
			lim: bucket.Limit{Algorithm: bucket.SlidingLog, Capacity: 108, Window: 3 * time.Hour},
			steps: []step{
				{at: 0, cost: 1}, {at: 500, cost: 3},
				{undo: true, at: 0, now: 500, cost: 1},
				{at: 500, cost: 1}, // numbered 4 while 4 is in use
				{undo: true, at: 500, now: 500, cost: 3},
				{at: 700, cost: 3},
			}},
		{name: "gcra undone to full then the clock back",
			lim: bucket.Limit{Algorithm: bucket.GCRA, Capacity: 1000, RefillPerSecond: 100},
			steps: []step{
				{at: 0, cost: 500},
				{undo: true, at: 0, now: 4_000_000, cost: 500},
				{at: 2_500_000, cost: 1}, // 1.5 s before the undo
				{at: 2_500_000, cost: 999},
			}},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			start := conformanceStart(t)
			lim := tc.lim
			key := Key(fmt.Sprint("conf-corner-", i), "client")
			script := redis.NewScript(must(lua.Single(string(lim.Algorithm), lua.FixedClock)))
			var st bucket.State
			for n, s := range tc.steps {
				if s.undo {
					lim.Undo(&st, start+s.now, start+s.at, s.cost)
					keys, args := groupArgs([]bucket.Request{{Rule: "c", Key: "client", Limit: lim, Cost: s.cost}})
					keys[0] = key
					args = append(undoArgs(start+s.at, args), strconv.FormatInt(start+s.now, 10))
					if err := cf.undo.Run(cf.ctx, cf.client, keys, args...).Err(); err != nil && !errors.Is(err, redis.Nil) {
						t.Fatalf("step %d: undo = %v", n, err)
					}
					continue
				}
				now := start + s.at
				want := lim.Take(&st, now, s.cost)
				a := scriptArgs(lim, s.cost)
				res, err := script.Run(cf.ctx, cf.client, []string{key}, a[0], a[1], a[2], strconv.FormatInt(now, 10)).Slice()
				if err != nil {
					t.Fatalf("step %d: %v", n, err)
				}
				got, err := parseDecision(res, lim)
				if err != nil {
					t.Fatalf("step %d: %v", n, err)
				}
				if got != want {
					t.Fatalf("step %d (at +%d µs, cost %v):\n  lua %+v\n   go %+v", n, s.at, s.cost, got, want)
				}
			}
		})
	}
}

func must(s string, err error) string {
	if err != nil {
		panic(err)
	}
	return s
}
