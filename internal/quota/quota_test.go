package quota

import (
	"math"
	"testing"
	"time"
)

func TestRoundings(t *testing.T) {
	for _, c := range []struct {
		f    float64
		want int64
	}{{-1, 0}, {math.NaN(), 0}, {0, 0}, {0.99, 0}, {1, 1}, {41.7, 41}, {math.Inf(1), math.MaxInt64}, {1e300, math.MaxInt64}} {
		if got := FloorInt(c.f); got != c.want {
			t.Errorf("FloorInt(%v) = %d, want %d", c.f, got, c.want)
		}
	}
	for _, c := range []struct{ ms, want int64 }{{-5, 0}, {0, 0}, {1, 1}, {999, 1}, {1000, 1}, {1001, 2}, {60_000, 60}} {
		if got := CeilSeconds(c.ms); got != c.want {
			t.Errorf("CeilSeconds(%d) = %d, want %d", c.ms, got, c.want)
		}
	}
	at := time.Unix(1_800_000_000, 0)
	if got := UnixCeil(at); got != 1_800_000_000 {
		t.Errorf("UnixCeil(whole second) = %d", got)
	}
	if got := UnixCeil(at.Add(time.Nanosecond)); got != 1_800_000_001 {
		t.Errorf("UnixCeil(a ns past) = %d", got)
	}
}
