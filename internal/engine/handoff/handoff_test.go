package handoff

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

func pinned(t *testing.T, homes string) *rules.Rule {
	t.Helper()
	set, err := rules.Parse("rules.yml", []byte(fmt.Sprintf(`rules:
  - id: vip
    capacity: 10
    refill_per_second: 0.001
    home: pinned
    home_keys: {%s}
`, homes)))
	if err != nil {
		t.Fatal(err)
	}
	return set.Get("vip")
}

// TestRehomed: a change of a pinned rule's home_keys starts a rehoming
// named by the new home_keys; a change keeping them keeps the one running.
func TestRehomed(t *testing.T) {
	old := pinned(t, "acme: eu")
	moved := pinned(t, "acme: us")
	rh := Rehomed(old, nil, moved)
	if rh == nil || rh.Origin != Origin(map[string]string{"acme": "us"}) || rh.Prev["acme"] != "eu" {
		t.Fatalf("rehoming of acme from eu to us: %+v", rh)
	}
	if !strings.HasPrefix(rh.Origin, "homes-") || len(rh.Origin) != len("homes-")+16 {
		t.Fatalf("origin %q, want homes- and 16 hex digits", rh.Origin)
	}
	if got := Rehomed(moved, rh, pinned(t, "acme: us")); got != rh {
		t.Fatalf("a change keeping home_keys: %+v, want the rehoming running", got)
	}
	if Origin(map[string]string{"a": "us", "b": "eu"}) != Origin(map[string]string{"b": "eu", "a": "us"}) {
		t.Fatal("the origin of one home_keys map depends on its order")
	}
}

// TestSetUsed: an old home's counts are taken only when there is one per
// key, each finite, not below 0 and not above what a bucket holds.
func TestSetUsed(t *testing.T) {
	lim := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 1}
	moves := func() []Move {
		return []Move{{Seed: bucket.Seed{Rule: "vip", Key: "a", Limit: lim}}, {Seed: bucket.Seed{Rule: "vip", Key: "b", Limit: lim}}}
	}
	for _, used := range [][]float64{{1}, {1, -1}, {1, math.NaN()}, {1, math.Inf(1)}, {1, lim.MostUsed() + 1}} {
		if err := SetUsed(moves(), used); err == nil {
			t.Errorf("SetUsed(%v) took the answer", used)
		}
	}
	mvs := moves()
	if err := SetUsed(mvs, []float64{0, lim.MostUsed()}); err != nil || mvs[0].Seed.Used != 0 || mvs[1].Seed.Used != lim.MostUsed() {
		t.Fatalf("SetUsed of counts in range: %v, %+v", err, mvs)
	}
}

// TestSeededBound: at most MaxKeys keys are remembered as seeded.
func TestSeededBound(t *testing.T) {
	var s Seeded
	for i := range MaxKeys + 10 {
		s.Add("vip", fmt.Sprint("k", i))
	}
	if s.Len() != MaxKeys || !s.Has("vip", "k0") || s.Has("vip", fmt.Sprint("k", MaxKeys)) {
		t.Fatalf("%d keys remembered, want the first %d", s.Len(), MaxKeys)
	}
}
