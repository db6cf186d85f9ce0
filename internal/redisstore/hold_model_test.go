package redisstore

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"

	"github.com/redis/go-redis/v9"
)

// holdModel is a reference of lua/hold.lua and lua/hold_record.lua in Go:
// each source's stored fields, as the scripts format them.
type holdModel map[string]*holdField

type holdField struct{ received, updated, since, lag, batch float64 }

// g6 is x as the scripts store it: string.format('%.6g').
func g6(x float64) float64 {
	v, err := strconv.ParseFloat(fmt.Sprintf("%.6g", x), 64)
	if err != nil {
		panic(err)
	}
	return v
}

func (m holdModel) record(field string, amount, seen, d, full, now float64) {
	if seen <= 0 || amount <= 0 || d < 0.25*full {
		return
	}
	const tau = 500000
	lag := math.Min(math.Max(now-seen, 0), 1000000)
	received, since, mean, batch := amount, now-100000, lag, amount
	if f := m[field]; f != nil && now-f.updated < 4*tau {
		old := f.received * math.Exp(-math.Max(now-f.updated, 0)/tau)
		received = old + amount
		since = f.since
		mean = (f.lag*old + lag*amount) / received
		batch = f.batch + (amount-f.batch)/4
	}
	m[field] = &holdField{g6(received), now, since, math.Floor(mean), g6(batch)}
}

func (m holdModel) tokens(now float64) float64 {
	total := 0.0
	for _, f := range m {
		k := math.Exp(-math.Max(now-f.updated, 0) / 500000)
		window := math.Max(500000*(1-math.Exp(-math.Max(now-f.since, 0)/500000)), 100000)
		if held := f.received*k/window*f.lag + f.batch/2*k; held > 0 {
			total += held
		}
	}
	return total
}

// TestHoldModel runs random debits from three sources into one key's hold
// (amounts, lags from -0.2 s to 1.5 s, a bucket left from 0 to 100%
// spent, gaps from 0 to 3 s, a source silent past 4 time constants) and
// reads it at random instants, against holdModel: 20 seeds of 300 steps,
// the scripts' own functions called at fixed instants on a real Redis.
func TestHoldModel(t *testing.T) {
	client := nodeClient(t)
	ctx := context.Background()
	read := func(name string) string {
		b, err := os.ReadFile("../../lua/" + name + ".lua")
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	recordScript := redis.NewScript("local EXPIRY_PAD_MS = 0\n" + read("hold_record") +
		"hold_record(KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]))\nreturn 1")
	tokensScript := redis.NewScript(read("hold") + "return tostring(hold_tokens(KEYS[1], tonumber(ARGV[1])))")
	const seeds, steps = 20, 300
	for seed := range uint64(seeds) {
		rng := rand.New(rand.NewPCG(seed, 23))
		key := fmt.Sprintf("model-%d", seed)
		m := holdModel{}
		now := float64(1_800_000_000_000_000) // µs, a fixed instant
		for step := range steps {
			now += math.Floor(rng.Float64() * rng.Float64() * 3e6)
			if rng.IntN(3) > 0 {
				field := fmt.Sprint("src", rng.IntN(3))
				amount := g6(rng.Float64() * 20)
				seen := now - math.Floor(-200000+rng.Float64()*1.7e6)
				if rng.IntN(20) == 0 {
					seen = 0 // unknown: nothing recorded
				}
				full := 1e9
				d := math.Floor(rng.Float64() * full)
				m.record(field, amount, seen, d, full, now)
				if err := recordScript.Run(ctx, client, []string{key}, field, amount, strconv.FormatFloat(seen, 'f', 0, 64),
					strconv.FormatFloat(d, 'f', 0, 64), strconv.FormatFloat(full, 'f', 0, 64), strconv.FormatFloat(now, 'f', 0, 64)).Err(); err != nil {
					t.Fatal(err)
				}
				continue
			}
			s, err := tokensScript.Run(ctx, client, []string{key}, strconv.FormatFloat(now, 'f', 0, 64)).Text()
			if err != nil {
				t.Fatal(err)
			}
			got, err := strconv.ParseFloat(s, 64)
			if err != nil {
				t.Fatal(err)
			}
			if want := m.tokens(now); math.Abs(got-want) > 1e-4*math.Max(1, want) {
				t.Fatalf("seed %d step %d: the hold is %v tokens, the model's %v (fields %+v)", seed, step, got, want, m)
			}
		}
	}
}
