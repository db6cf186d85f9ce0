package request

import (
	"testing"
	"time"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestFallbackSharesByTime: a fleet larger than a rule's limit shares it
// by time while the store is down: each instance admits a request per
// longer window, so the fleet together keeps the limit's rate, instead of
// one request per instance per window.
func TestFallbackSharesByTime(t *testing.T) {
	tests := []struct {
		name  string
		lim   bucket.Limit
		n     int
		cost  float64
		until time.Duration // the share admits cost once in this long
		least float64       // of the limit's rate, at least
	}{
		{"sliding log 3 a minute, 10 instances", bucket.Limit{Algorithm: bucket.SlidingLog, Capacity: 3, Window: time.Minute}, 10, 1, 200 * time.Second, 0.9},
		{"fixed window 5 an hour, 20 instances, cost 2", bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 5, Window: time.Hour}, 20, 2, 16 * time.Hour, 0.9},
		// A sliding window holding its capacity admits again once the
		// previous window weighs nothing: half the rate, the safe side.
		{"sliding window 4 a second, 8 instances", bucket.Limit{Algorithm: bucket.SlidingWindow, Capacity: 4, Window: time.Second}, 8, 1, 2 * time.Second, 0.45},
		{"token bucket 5 at 1/s, 10 instances", bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 5, RefillPerSecond: 1}, 10, 1, 10 * time.Second, 0.9},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sh := Share(tt.lim, tt.n, tt.cost)
			if err := sh.Validate(); err != nil && sh.Algorithm != bucket.SlidingLog {
				t.Fatalf("share %+v: %v", sh, err)
			}
			if _, err := sh.NormalizeCost(tt.cost); err != nil {
				t.Fatalf("share %+v refuses a cost of %v: %v", sh, tt.cost, err)
			}
			// Over a long span the fleet admits the limit's rate.
			var st bucket.State
			span := 500 * tt.until
			start := (time.Now().UnixMicro()/time.Hour.Microseconds() + 1) * time.Hour.Microseconds()
			admitted := 0
			step := tt.until / 20
			for at := time.Duration(0); at < span; at += step {
				if sh.Take(&st, start+at.Microseconds(), tt.cost).Allowed {
					admitted++
				}
			}
			fleet := float64(admitted) * tt.cost * float64(tt.n)
			want := SustainedRate(tt.lim) * span.Seconds()
			if fleet > want*1.05+float64(tt.n)*tt.lim.Capacity || fleet < want*tt.least {
				t.Fatalf("%d instances of share %+v admit %v in %v, want about %v (the limit's rate)", tt.n, sh, fleet, span, want)
			}
		})
	}
}
