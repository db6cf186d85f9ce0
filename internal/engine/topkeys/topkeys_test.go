package topkeys

import (
	"fmt"
	"hash/maphash"
	"math/rand/v2"
	"testing"
	"time"
)

var t0 = time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC).UnixNano()

// TestExactUnderCapacity: with fewer keys than counters, every count is
// exact, most first, ties by key.
func TestExactUnderCapacity(t *testing.T) {
	tr := New(64)
	for i, n := range []uint64{5, 3, 9, 3} {
		tr.Add("r", fmt.Sprint("k", i), n, t0)
	}
	got := tr.Top("r", 10, t0)
	want := []Entry{{"k2", 9, 0}, {"k0", 5, 0}, {"k1", 3, 0}, {"k3", 3, 0}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("Top = %v, want %v", got, want)
	}
	if got := tr.Top("r", 2, t0); len(got) != 2 || got[0].Key != "k2" {
		t.Fatalf("Top(2) = %v", got)
	}
	if tr.Top("other", 10, t0) != nil {
		t.Fatal("a rule that refused nothing has a top")
	}
}

// TestBoundsAgainstAModel: 12 Zipf streams of refusals against exact counts.
// For every key reported, count-error <= refusals <= count; every key
// refused more than its shard's refusals / its counters is reported; and
// no shard holds more than its counters.
func TestBoundsAgainstAModel(t *testing.T) {
	for run := range 12 {
		rng := rand.New(rand.NewPCG(uint64(run), 7))
		size := []int{8, 16, 64, 256}[run%4]
		tr := New(size)
		zipf := rand.NewZipf(rng, 1.1+float64(run%3)/2, 1, 5000)
		exact := map[string]uint64{}
		perShard := [Shards]uint64{}
		n := 2000 + rng.IntN(20000)
		for range n {
			k := fmt.Sprint("key-", zipf.Uint64())
			c := uint64(1 + rng.IntN(3))
			exact[k] += c
			perShard[maphash.String(tr.seed, k)%Shards] += c
			tr.Add("r", k, c, t0)
		}
		v, _ := tr.rules.Load("r")
		r := v.(*rule)
		for i := range r.shards {
			if c := len(r.shards[i].cur.heap); c > size/Shards {
				t.Fatalf("run %d: shard %d holds %d counters, size %d/%d", run, i, c, size, Shards)
			}
		}
		top := tr.Top("r", -1, t0)
		reported := map[string]bool{}
		for _, e := range top {
			reported[e.Key] = true
			if got := exact[e.Key]; e.Count-e.Error > got || got > e.Count {
				t.Fatalf("run %d: %s refused %d, reported %d (error %d)", run, e.Key, got, e.Count, e.Error)
			}
		}
		for k, c := range exact {
			sh := maphash.String(tr.seed, k) % Shards
			if c > perShard[sh]/uint64(size/Shards) && !reported[k] {
				t.Fatalf("run %d: %s refused %d times, more than %d/%d, not reported", run, k, c, perShard[sh], size/Shards)
			}
		}
	}
}

// TestWindows: a key's refusals count for the window they fall in and the
// next, then go.
func TestWindows(t *testing.T) {
	tr := New(16)
	tr.Add("r", "old", 7, t0)
	tr.Add("r", "new", 2, t0+int64(Window))
	got := tr.Top("r", 10, t0+int64(Window))
	if len(got) != 2 || got[0] != (Entry{"old", 7, 0}) || got[1] != (Entry{"new", 2, 0}) {
		t.Fatalf("one window on: %v, want old 7 and new 2", got)
	}
	if got := tr.Top("r", 10, t0+2*int64(Window)); len(got) != 1 || got[0].Key != "new" {
		t.Fatalf("two windows on: %v, want new alone", got)
	}
	if got := tr.Top("r", 10, t0+4*int64(Window)); got != nil {
		t.Fatalf("four windows on: %v, want none", got)
	}
	if ids := tr.Rules(t0 + 4*int64(Window)); len(ids) != 0 {
		t.Fatalf("Rules after the windows passed: %v", ids)
	}
}

// TestMemoryBound: 50,000 distinct keys, each refused once, of the
// longest length leave at most size counters per window in a rule.
func TestMemoryBound(t *testing.T) {
	tr := New(32)
	pad := make([]byte, 500)
	for i := range pad {
		pad[i] = 'x'
	}
	for i := range 50_000 {
		tr.Add("r", fmt.Sprintf("%s%06d", pad, i), 1, t0)
	}
	held := 0
	v, _ := tr.rules.Load("r")
	for i := range v.(*rule).shards {
		sh := &v.(*rule).shards[i]
		held += len(sh.cur.heap) + len(sh.prev.heap)
	}
	if held > 32 {
		t.Fatalf("%d counters held, want at most 32", held)
	}
	if got := tr.Top("r", -1, t0); len(got) != 32 {
		t.Fatalf("Top holds %d keys, want the 32 counters", len(got))
	}
}

// TestMerge: two instances' summaries add up; a key one full summary
// lacks takes that summary's least count as count and error.
func TestMerge(t *testing.T) {
	a := []Entry{{"x", 10, 0}, {"y", 4, 1}}
	b := []Entry{{"x", 5, 0}, {"z", 3, 0}}
	got := Merge(2, a, b)
	want := []Entry{{"x", 15, 0}, {"y", 7, 4}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("Merge(full) = %v, want %v", got, want)
	}
	got = Merge(8, a, b)
	want = []Entry{{"x", 15, 0}, {"y", 4, 1}, {"z", 3, 0}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("Merge(room) = %v, want %v", got, want)
	}
}

// TestOff: a nil tracker (size < 0) records and reports nothing.
func TestOff(t *testing.T) {
	tr := New(-1)
	tr.Add("r", "k", 1, t0)
	if tr.Top("r", 1, t0) != nil || tr.Size() != 0 || tr.Rules(t0) != nil {
		t.Fatal("an off tracker reported something")
	}
}

func BenchmarkAdd(b *testing.B) {
	tr := New(DefaultSize)
	keys := make([]string, 4096)
	for i := range keys {
		keys[i] = fmt.Sprint("user:", i)
	}
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			tr.Add("r", keys[i%len(keys)], 1, t0)
			i++
		}
	})
}
