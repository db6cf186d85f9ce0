package demo

import (
	"math"
	"strings"
	"testing"
	"time"
)

const ms = time.Millisecond

// every returns n instants from first, step apart.
func every(first, step time.Duration, n int) []time.Duration {
	out := make([]time.Duration, n)
	for i := range out {
		out[i] = first + time.Duration(i)*step
	}
	return out
}

func TestMaxInWindow(t *testing.T) {
	tests := []struct {
		name string
		ts   []time.Duration
		w    time.Duration
		want int
	}{
		{name: "none", ts: nil, w: time.Second, want: 0},
		{name: "one", ts: []time.Duration{5 * time.Second}, w: time.Second, want: 1},
		{name: "window is half-open", ts: []time.Duration{0, 500 * ms, time.Second, 1500 * ms}, w: time.Second, want: 2},
		{name: "just inside", ts: []time.Duration{0, 999 * ms, time.Second}, w: time.Second, want: 2},
		{name: "same instant", ts: []time.Duration{time.Second, time.Second, time.Second}, w: time.Millisecond, want: 3},
		{name: "20 per second", ts: every(0, 50*ms, 200), w: time.Second, want: 20},
		{name: "burst in the middle", ts: append(append(every(0, time.Second, 5), every(5*time.Second, ms, 30)...), every(6*time.Second, time.Second, 5)...), w: time.Second, want: 30},
		{name: "window longer than the run", ts: every(0, 50*ms, 15), w: 2 * time.Second, want: 15},
		{name: "empty window", ts: every(0, 50*ms, 15), w: 0, want: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := MaxInWindow(tt.ts, tt.w); got != tt.want {
				t.Errorf("MaxInWindow = %d, want %d", got, tt.want)
			}
		})
	}
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

func TestResultArithmetic(t *testing.T) {
	tests := []struct {
		name                        string
		res                         Result
		total                       int
		limit, overshoot, intervals float64
		remote                      int
		peak                        float64
		peakAt                      time.Duration
	}{
		{
			name: "nothing admitted",
			res: Result{Capacity: 100, RefillPerSecond: 1, Elapsed: 20 * time.Second, GossipInterval: time.Second,
				Regions: []RegionResult{{Region: "us-east", Sent: 400}, {Region: "eu-west", Sent: 400}}},
			total: 0, limit: 120, overshoot: -120, remote: 0, intervals: 0, peak: 0, peakAt: 0,
		},
		{
			// 15 + 10 admitted in the first 0.7 s of a 1 s run of a bucket
			// of 10 refilling 2/s: the peak is at the last admission.
			name: "burst",
			res: Result{Capacity: 10, RefillPerSecond: 2, Elapsed: time.Second, GossipInterval: time.Second,
				Regions: []RegionResult{
					{Region: "us-east", Sent: 20, Admitted: every(0, 50*ms, 15)},
					{Region: "eu-west", Sent: 20, Admitted: every(25*ms, 50*ms, 10)},
				}},
			total: 25, limit: 12, overshoot: 13, remote: 15, intervals: 13.0 / 15, peak: 25 - 10 - 1.4, peakAt: 700 * ms,
		},
		{
			// The excess of the burst paid back by the end: the overshoot
			// over the run is below the peak.
			name: "paid back",
			res: Result{Capacity: 10, RefillPerSecond: 1, Elapsed: 10 * time.Second, GossipInterval: 500 * ms,
				Regions: []RegionResult{
					{Region: "us-east", Admitted: every(0, 100*ms, 8)},
					{Region: "eu-west", Admitted: every(50*ms, 100*ms, 8)},
				}},
			total: 16, limit: 20, overshoot: -4, remote: 5, intervals: -4.0 / 5, peak: 16 - 10 - 0.75, peakAt: 750 * ms,
		},
		{
			name: "zero refill",
			res: Result{Capacity: 5, Elapsed: 3 * time.Second, GossipInterval: time.Second,
				Regions: []RegionResult{{Admitted: every(time.Second, ms, 5)}, {Admitted: every(2*time.Second, ms, 5)}}},
			total: 10, limit: 5, overshoot: 5, remote: 5, intervals: 1, peak: 5, peakAt: 2*time.Second + 4*ms,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := tt.res
			if got := r.Total(); got != tt.total {
				t.Errorf("Total = %d, want %d", got, tt.total)
			}
			if got := r.Limit(); !near(got, tt.limit) {
				t.Errorf("Limit = %v, want %v", got, tt.limit)
			}
			if got := r.Overshoot(); !near(got, tt.overshoot) {
				t.Errorf("Overshoot = %v, want %v", got, tt.overshoot)
			}
			if got := r.RemoteSpend(); got != tt.remote {
				t.Errorf("RemoteSpend = %d, want %d", got, tt.remote)
			}
			if got := r.OvershootIntervals(); !near(got, tt.intervals) {
				t.Errorf("OvershootIntervals = %v, want %v", got, tt.intervals)
			}
			peak, at := r.PeakOvershoot()
			if !near(peak, tt.peak) || at != tt.peakAt {
				t.Errorf("PeakOvershoot = %v at %v, want %v at %v", peak, at, tt.peak, tt.peakAt)
			}
		})
	}
}

func TestReportWrite(t *testing.T) {
	regions := func(us, eu []time.Duration) []RegionResult {
		return []RegionResult{
			{Region: "us-east", Address: "127.0.0.1:8081", Sent: 400, Admitted: us},
			{Region: "eu-west", Address: "127.0.0.1:8082", Sent: 400, Admitted: eu},
		}
	}
	rep := &Report{
		Key: "limiterdemo-1-00000000", Rate: 20, Duration: 20 * time.Second,
		Runs: []Result{
			{
				Rule: "global-demo", Reconciled: true, Capacity: 100, RefillPerSecond: 1,
				Elapsed: 20 * time.Second, GossipInterval: time.Second,
				// 60 and 65 in the first 3 s, 20 per second each.
				Regions: regions(every(0, 50*ms, 60), every(25*ms, 50*ms, 65)),
			},
			{
				Rule: "global-demo-unreconciled", Capacity: 100, RefillPerSecond: 1,
				Elapsed: 20 * time.Second, GossipInterval: time.Second,
				Regions: regions(every(0, 50*ms, 120), every(25*ms, 50*ms, 120)),
			},
		},
	}
	var b strings.Builder
	if err := rep.Write(&b); err != nil {
		t.Fatal(err)
	}
	want := `key limiterdemo-1-00000000: 20 checks/s to each region (us-east 127.0.0.1:8081, eu-west 127.0.0.1:8082) for 20s per rule

global-demo (reconciled across the regions)
  admitted    us-east 60 of 400, eu-west 65 of 400
  total       125
  limit       120.0 = capacity 100 + refill 1/s x T 20.0s
  overshoot   +5.0 = +0.25 x one gossip interval of remote spending (20: the most admitted in 1s by every region but one)
  peak        +21.8 at t=3.2s = +1.09 x one gossip interval of remote spending (admitted by t - capacity - refill*t)

global-demo-unreconciled (not reconciled: each region on its own)
  admitted    us-east 120 of 400, eu-west 120 of 400
  total       240
  limit       120.0 = capacity 100 + refill 1/s x T 20.0s
  overshoot   +120.0 = +6.00 x one gossip interval of remote spending (20: the most admitted in 1s by every region but one)
  peak        +134.0 at t=6.0s = +6.70 x one gossip interval of remote spending (admitted by t - capacity - refill*t)

admitted / limit: 1.04 reconciled, 2.00 not reconciled
`
	if got := b.String(); got != want {
		t.Errorf("report:\n%s\nwant:\n%s", got, want)
	}
}

func TestSigned(t *testing.T) {
	tests := []struct {
		name string
		f    float64
		prec int
		want string
	}{
		{name: "positive", f: 12.34, prec: 1, want: "+12.3"},
		{name: "negative", f: -4, prec: 2, want: "-4.00"},
		{name: "tiny negative is zero", f: -0.0004, prec: 1, want: "+0.0"},
		{name: "negative zero", f: math.Copysign(0, -1), prec: 2, want: "+0.00"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := signed(tt.f, tt.prec); got != tt.want {
				t.Errorf("signed(%v, %d) = %q, want %q", tt.f, tt.prec, got, tt.want)
			}
		})
	}
}
