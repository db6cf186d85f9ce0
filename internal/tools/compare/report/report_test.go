package report

import (
	"math"
	"testing"

	"github.com/limiterd/limiterd/internal/tools/compare/load"
)

// TestPerRound: a ratio is taken within each round where both rows
// counted, and its median reported.
func TestPerRound(t *testing.T) {
	res := make(Results)
	for round, v := range [][2]float64{{200, 100}, {300, 100}, {900, 0}, {150, 100}} {
		a, b := load.Sample{RPS: v[0]}, load.Sample{RPS: v[1]}
		if v[1] == 0 {
			b.Failed = "codes: Unavailable 1"
		}
		res.Add(1, round, map[int]load.Sample{64: a})
		res.Add(3, round, map[int]load.Sample{64: b})
	}
	got := res.perRound(1, 3, 64, func(x, y load.Sample) float64 { return x.RPS / y.RPS })
	if got != 2 {
		t.Errorf("perRound: %v, want the median of 2, 3 and 1.5: 2", got)
	}
	if got := res.perRound(1, 5, 64, func(x, y load.Sample) float64 { return 1 }); !math.IsNaN(got) {
		t.Errorf("perRound with a row not run: %v, want NaN", got)
	}
}
