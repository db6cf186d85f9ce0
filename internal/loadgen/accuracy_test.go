package loadgen

import (
	"math"
	"testing"
	"time"
)

func TestComputeAccuracy(t *testing.T) {
	tests := []struct {
		name        string
		keys        []KeyResult
		rate        float64
		burst, cost float64
		want        Accuracy
	}{
		{
			name: "bucket limits and traffic limits",
			// rate 10/s, burst 20: a key may admit 20 + 10*window.
			keys: []KeyResult{
				// Over the limit all the time: 20 + 10*1 = 30 expected, 30 admitted.
				{Key: "a", Sent: 100, Allowed: 30, Limited: 70, Window: time.Second},
				// Sent fewer than the bucket allows: expected is what was sent.
				{Key: "b", Sent: 10, Allowed: 10, Window: 500 * time.Millisecond},
				// Admitted 45 where 20 + 10*2 = 40 was the most: overshoot 1.125.
				{Key: "c", Sent: 200, Allowed: 45, Limited: 150, Errors: 5, Window: 2 * time.Second},
				// Never sent: skipped.
				{Key: "d"},
				// Under-admits: 20 + 10*3 = 50 expected, 25 admitted.
				{Key: "e", Sent: 60, Allowed: 25, Limited: 35, Window: 3 * time.Second},
			},
			rate: 10, burst: 20, cost: 1,
			want: Accuracy{
				Rate: 10, Burst: 20, Cost: 1,
				Keys:           4,
				Admitted:       30 + 10 + 45 + 25,
				Expected:       30 + 10 + 40 + 50,
				Ratio:          110.0 / 130.0,
				WorstOvershoot: 1.125, WorstKey: "c", WorstAdmitted: 45, WorstExpected: 40,
				OverKeys: 1,
			},
		},
		{
			name: "cost counts requests in tokens",
			// rate 4/s, burst 10, cost 2: (10 + 4*1.5)/2 = 8 requests.
			keys: []KeyResult{
				{Key: "x", Sent: 50, Allowed: 8, Limited: 42, Window: 1500 * time.Millisecond},
				{Key: "y", Sent: 3, Allowed: 3, Window: 0},
			},
			rate: 4, burst: 10, cost: 2,
			want: Accuracy{
				Rate: 4, Burst: 10, Cost: 2,
				Keys:           2,
				Admitted:       11,
				Expected:       11,
				Ratio:          1,
				WorstOvershoot: 1, WorstKey: "x", WorstAdmitted: 8, WorstExpected: 8,
			},
		},
		{
			name: "no keys",
			rate: 1, burst: 1, cost: 1,
			want: Accuracy{Rate: 1, Burst: 1, Cost: 1},
		},
	}
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-9 }
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := ComputeAccuracy(tt.keys, tt.rate, tt.burst, tt.cost)
			w := tt.want
			if got.Rate != w.Rate || got.Burst != w.Burst || got.Cost != w.Cost ||
				got.Keys != w.Keys || got.Admitted != w.Admitted || !near(got.Expected, w.Expected) ||
				!near(got.Ratio, w.Ratio) || !near(got.WorstOvershoot, w.WorstOvershoot) ||
				got.WorstKey != w.WorstKey || got.WorstAdmitted != w.WorstAdmitted ||
				!near(got.WorstExpected, w.WorstExpected) || got.OverKeys != w.OverKeys {
				t.Fatalf("ComputeAccuracy() =\n%+v\nwant\n%+v", got, w)
			}
		})
	}
}
