package redisstore

import (
	"context"
	"math"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// nodeClient starts a standalone Redis node for t and returns a client of
// it, closed when t ends.
func nodeClient(t *testing.T) *redis.Client {
	t.Helper()
	node := redistest.NewNode(t)
	client := redis.NewClient(&redis.Options{Addr: node.Addr()})
	t.Cleanup(func() { client.Close() })
	return client
}

// scriptTaker runs the check scripts of one node with the fixed clock,
// pipelined: the cases below make thousands of checks.
type scriptTaker struct {
	t      *testing.T
	client *redis.Client
	single map[bucket.Algorithm]*redis.Script
}

func newScriptTaker(t *testing.T, client *redis.Client) *scriptTaker {
	st := &scriptTaker{t: t, client: client, single: map[bucket.Algorithm]*redis.Script{}}
	for _, a := range bucket.Algorithms {
		src, err := lua.Single(string(a), lua.FixedClock)
		if err != nil {
			t.Fatal(err)
		}
		st.single[a] = redis.NewScript(src)
		if err := st.single[a].Load(context.Background(), client).Err(); err != nil {
			t.Fatal(err)
		}
	}
	return st
}

// take runs one check per instant of at, each of cost, on key, in one
// pipeline, and returns the decisions.
func (s *scriptTaker) take(script *redis.Script, key string, lim bucket.Limit, cost float64, at []int64) []bucket.Decision {
	s.t.Helper()
	ctx := context.Background()
	a := scriptArgs(lim, cost)
	out := make([]bucket.Decision, 0, len(at))
	const batch = 2000
	for i := 0; i < len(at); i += batch {
		pipe := s.client.Pipeline()
		cmds := make([]*redis.Cmd, 0, batch)
		for _, now := range at[i:min(i+batch, len(at))] {
			cmds = append(cmds, script.EvalSha(ctx, pipe, []string{key}, a[0], a[1], a[2], strconv.FormatInt(now, 10)))
		}
		if _, err := pipe.Exec(ctx); err != nil {
			s.t.Fatal(err)
		}
		for _, cmd := range cmds {
			res, err := cmd.Slice()
			if err != nil {
				s.t.Fatal(err)
			}
			d, err := parseDecision(res, lim)
			if err != nil {
				s.t.Fatal(err)
			}
			out = append(out, d)
		}
	}
	return out
}

func countAllowed(ds []bucket.Decision) int {
	n := 0
	for _, d := range ds {
		if d.Allowed {
			n++
		}
	}
	return n
}

func repeatInstant(now int64, n int) []int64 {
	at := make([]int64, n)
	for i := range at {
		at[i] = now
	}
	return at
}

// TestScriptArithmetic holds the scripts on a real Redis to the cases of
// the issue that found whole-µs spends and float window sums: bursts that
// add up to the capacity pass whole, token bucket and GCRA alike; a
// sustained rate is the rule's; 0.1 + ... + 0.1 is 3 in a window; a huge
// debit is kept up to capacity + rate*DebtHorizon.
func TestScriptArithmetic(t *testing.T) {
	client := nodeClient(t)
	s := newScriptTaker(t, client)
	// A minute ahead of the real clock, on a whole minute: window
	// boundaries are known and real expiry never takes state early.
	now := (time.Now().UnixMicro()/60e6 + 1) * 60e6

	bursts := []struct {
		capacity, rate, cost float64
		want                 int
	}{
		{10, 3, 5, 2},
		{1000, 30_000, 1, 1000},
		{1000, 800_000, 1, 1000},
		{1000, 660_000, 1, 1000},
		{1, 1_000_000, 0.1, 10},
		{1e9, 1e6, 1e6, 1000},
	}
	for _, b := range bursts {
		for _, alg := range []bucket.Algorithm{bucket.TokenBucket, bucket.GCRA} {
			lim := bucket.Limit{Algorithm: alg, Capacity: b.capacity, RefillPerSecond: b.rate}
			key := Key("burst-"+string(alg)+strconv.FormatFloat(b.capacity, 'g', -1, 64)+"-"+strconv.FormatFloat(b.rate, 'g', -1, 64), "c")
			got := countAllowed(s.take(s.single[alg], key, lim, b.cost, repeatInstant(now, b.want+10)))
			if got != b.want {
				t.Errorf("%s %g at %g/s: %d of cost %g pass at one instant, want %d", alg, b.capacity, b.rate, got, b.cost, b.want)
			}
		}
	}

	// A check per µs for 10 ms against a capacity of 2 that never fills
	// up between checks: the rate, to within 0.1%, and the Go count.
	for _, rate := range []float64{800_000, 660_000} {
		for _, alg := range []bucket.Algorithm{bucket.TokenBucket, bucket.GCRA} {
			lim := bucket.Limit{Algorithm: alg, Capacity: 2, RefillPerSecond: rate}
			at := make([]int64, 10_000)
			var st bucket.State
			goCount := 0
			for i := range at {
				at[i] = now + int64(i)
				if lim.Take(&st, at[i], 1).Allowed {
					goCount++
				}
			}
			key := Key("sustained-"+string(alg)+strconv.FormatFloat(rate, 'g', -1, 64), "c")
			got := countAllowed(s.take(s.single[alg], key, lim, 1, at))
			want := 2 + rate*0.01
			if got != goCount || math.Abs(float64(got)-want) > want*1e-3 {
				t.Errorf("%s 2 at %g/s, a check per µs for 10 ms: %d pass (Go %d), want %v within 0.1%%", alg, rate, got, goCount, want)
			}
		}
	}

	for _, alg := range []bucket.Algorithm{bucket.FixedWindow, bucket.SlidingWindow} {
		lim := bucket.Limit{Algorithm: alg, Capacity: 3, Window: time.Minute}
		ds := s.take(s.single[alg], Key("tenths-"+string(alg), "c"), lim, 0.1, repeatInstant(now, 31))
		if got := countAllowed(ds); got != 30 || ds[29].Remaining != 0 || ds[28].Remaining != 0.1 {
			t.Errorf("%s: %d of 31 checks of 0.1 pass against 3 (remaining %v, %v), want 30 (0.1, 0)", alg, got, ds[28].Remaining, ds[29].Remaining)
		}
	}

	debit := redis.NewScript(lua.Debit(lua.FixedClock))
	for _, alg := range []bucket.Algorithm{bucket.TokenBucket, bucket.GCRA} {
		lim := bucket.Limit{Algorithm: alg, Capacity: 10, RefillPerSecond: 100}
		key := Key("huge-"+string(alg), "c")
		a := scriptArgs(lim, 1e12)
		if err := debit.Run(context.Background(), client, []string{PartitionMarkerKey("c", "huge-"+string(alg), 0), key},
			"1", "60000", "7", string(alg), a[0], a[1], a[2], "0", "0", strconv.FormatInt(now, 10)).Err(); err != nil {
			t.Fatal(err)
		}
		// 10 + 100*10 tokens of debt: cost 1 waits (1 + 1010) / 100 s.
		if d := s.take(s.single[alg], key, lim, 1, []int64{now})[0]; d.Allowed || d.RetryAfter != 10110*time.Millisecond {
			t.Errorf("%s after a debit of 1e12: %+v, want refused for 10.11s", alg, d)
		}
	}
}

// previousScript is the check script of alg as released before ns state
// and millionth counts, with the fixed clock, composed as the release
// composed it: testdata/previous/lib.lua, the algorithm, single.lua.
func previousScript(t *testing.T, client *redis.Client, alg bucket.Algorithm) *redis.Script {
	var src strings.Builder
	for _, name := range []string{"lib", string(alg), "single"} {
		b, err := os.ReadFile("testdata/previous/" + name + ".lua")
		if err != nil {
			t.Fatal(err)
		}
		src.Write(b)
		if name == string(alg) {
			src.WriteString("local take = " + string(alg) + "\n")
		}
	}
	sc := redis.NewScript(src.String())
	if err := sc.Load(context.Background(), client).Err(); err != nil {
		t.Fatal(err)
	}
	return sc
}

// TestStateAcrossUpgrade: state the previous scripts wrote reads, after an
// upgrade, as the same state: a token bucket's or GCRA's whole µs instant
// as that instant, a window's float count as its whole millionths (a drift
// the float sums left is gone). After a rollback, the previous scripts
// read a new token bucket state as a full bucket (a negative instant is in
// the past), never as a debt that would lock the key out; windows keep
// one format.
func TestStateAcrossUpgrade(t *testing.T) {
	client := nodeClient(t)
	ctx := context.Background()
	s := newScriptTaker(t, client)
	now := (time.Now().UnixMicro()/60e6 + 1) * 60e6

	for _, alg := range []bucket.Algorithm{bucket.TokenBucket, bucket.GCRA} {
		t.Run(string(alg), func(t *testing.T) {
			old := previousScript(t, client, alg)
			lim := bucket.Limit{Algorithm: alg, Capacity: 10, RefillPerSecond: 4}
			key := Key("upgrade-"+string(alg), "c")
			// The previous script spends 7 at now: full again at now+1.75s.
			if got := countAllowed(s.take(old, key, lim, 1, repeatInstant(now, 7))); got != 7 {
				t.Fatalf("previous script: %d of 7 pass", got)
			}
			v, err := client.Get(ctx, key).Result()
			if err != nil || v != strconv.FormatInt(now+1_750_000, 10) {
				t.Fatalf("previous state %q (%v), want the µs instant %d", v, err, now+1_750_000)
			}
			// The same spends in Go, and half a second later both read
			// 5 tokens: 5 more pass, the 6th waits 0.25 s.
			var st bucket.State
			for range 7 {
				lim.Take(&st, now, 1)
			}
			later := now + 500_000
			got := s.take(s.single[alg], key, lim, 1, repeatInstant(later, 6))
			for i, d := range got {
				if want := lim.Take(&st, later, 1); d != want {
					t.Fatalf("check %d after the upgrade: %+v, Go from the same spends %+v", i, d, want)
				}
			}
			if countAllowed(got) != 5 || got[5].RetryAfter != 250*time.Millisecond {
				t.Fatalf("after the upgrade: %d pass, then %+v; want 5, then refused for 250ms", countAllowed(got), got[5])
			}
			v, _ = client.Get(ctx, key).Result()
			if !strings.HasPrefix(v, "-") {
				t.Fatalf("new state %q, want minus the ns instant", v)
			}
			// Rolled back: the previous script reads it as a full bucket.
			if got := countAllowed(s.take(old, key, lim, 1, repeatInstant(later, 11))); got != 10 {
				t.Fatalf("previous script on the new state: %d of 11 pass, want 10 (a full bucket)", got)
			}
		})
	}

	for _, alg := range []bucket.Algorithm{bucket.FixedWindow, bucket.SlidingWindow} {
		t.Run(string(alg), func(t *testing.T) {
			old := previousScript(t, client, alg)
			lim := bucket.Limit{Algorithm: alg, Capacity: 3, Window: time.Minute}
			key := Key("upgrade-"+string(alg), "c")
			// The previous script's float sum of 29 tenths is 2.9000000000000012:
			// a 30th would be refused.
			if got := countAllowed(s.take(old, key, lim, 0.1, repeatInstant(now, 30))); got != 29 {
				t.Fatalf("previous script: %d of 30 tenths pass, want 29 (the drift)", got)
			}
			got := s.take(s.single[alg], key, lim, 0.1, repeatInstant(now, 2))
			if !got[0].Allowed || got[1].Allowed || got[0].Remaining != 0 {
				t.Fatalf("after the upgrade: %+v, want the 30th tenth passing, with 0 left, and no 31st", got)
			}
			// Rolled back: the previous script reads the count, 3.
			if d := s.take(old, key, lim, 0.1, []int64{now})[0]; d.Allowed {
				t.Fatalf("previous script on the new state: %+v, want refused", d)
			}
		})
	}
}
