package scale

import (
	"math"
	"os"
	"testing"
)

// TestQuantile: the quantile of a cumulative histogram is interpolated
// within its bucket, the +Inf bucket gives its lower bound, and an empty
// histogram gives NaN.
func TestQuantile(t *testing.T) {
	t.Parallel()
	h := map[float64]float64{0.5: 10, 1: 90, 2: 99, math.Inf(1): 100}
	for _, tt := range []struct{ q, want float64 }{{0.05, 0.25}, {0.5, 0.75}, {0.9, 1}, {0.99, 2}, {0.995, 2}} {
		if got := quantile(tt.q, h); math.Abs(got-tt.want) > 1e-9 {
			t.Errorf("quantile(%v) = %v, want %v", tt.q, got, tt.want)
		}
	}
	if got := quantile(0.5, map[float64]float64{1: 0, math.Inf(1): 0}); !math.IsNaN(got) {
		t.Errorf("quantile of nothing = %v, want NaN", got)
	}
}

// TestProcCPU reads this process's own CPU time, which grows.
func TestProcCPU(t *testing.T) {
	t.Parallel()
	a, err := procCPU(os.Getpid())
	if err != nil {
		t.Skip("no /proc:", err)
	}
	x := 0.0
	for i := range 50_000_000 {
		x += math.Sqrt(float64(i))
	}
	b, err := procCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if b <= a || x == 0 {
		t.Fatalf("CPU time %v then %v, want it to grow", a, b)
	}
}
