package demo

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"
)

// RegionResult is what one region admitted during a run.
type RegionResult struct {
	// Region and Address name the region and its limiterd.
	Region, Address string
	// Sent is the number of checks sent.
	Sent int
	// Admitted holds, for each admitted check, when its answer came, from
	// the start of the run, in ascending order.
	Admitted []time.Duration
}

// Result is one run of one rule through every region. Its methods do the
// arithmetic of the report; the zero value has admitted nothing.
type Result struct {
	// Rule is the rule checked; Reconciled whether its spends are shared.
	Rule       string
	Reconciled bool
	// Capacity and RefillPerSecond are the rule's limits.
	Capacity, RefillPerSecond float64
	// Elapsed is the length of the run, T.
	Elapsed time.Duration
	// GossipInterval is the stack's gossip interval.
	GossipInterval time.Duration
	// Regions are the results of each region, in the order checked.
	Regions []RegionResult
}

// Total is the number of checks admitted by every region together.
func (r *Result) Total() int {
	n := 0
	for _, reg := range r.Regions {
		n += len(reg.Admitted)
	}
	return n
}

// Limit is the most the rule admits over the run: capacity + refill*T.
func (r *Result) Limit() float64 {
	return r.Capacity + r.RefillPerSecond*r.Elapsed.Seconds()
}

// Overshoot is how many checks were admitted beyond Limit; negative when
// fewer than the limit were.
func (r *Result) Overshoot() float64 { return float64(r.Total()) - r.Limit() }

// RemoteSpend is one gossip interval of remote spending: for the region it
// is largest for, the most every other region together admitted within one
// interval (with two regions, the most one region admitted in one). A
// region cannot see what the others admitted since their last flush, so a
// reconciled rule overshoots by about this much at most.
func (r *Result) RemoteSpend() int {
	n := 0
	for i := range r.Regions {
		var others []time.Duration
		for j, reg := range r.Regions {
			if j != i {
				others = append(others, reg.Admitted...)
			}
		}
		slices.Sort(others)
		n = max(n, MaxInWindow(others, r.GossipInterval))
	}
	return n
}

// OvershootIntervals is Overshoot as a multiple of RemoteSpend; 0 when
// nothing was admitted.
func (r *Result) OvershootIntervals() float64 { return intervals(r.Overshoot(), r.RemoteSpend()) }

func intervals(over float64, remote int) float64 {
	if remote == 0 {
		return 0
	}
	return over / float64(remote)
}

// PeakOvershoot is the largest overshoot at any moment of the run: over the
// admissions of every region in time order, the most by which the count
// admitted so far exceeded capacity + refill*t, and the moment t. A
// reconciled rule goes past its limit while spends are in flight, then
// pays the excess back, since a remote debit can take a bucket into debt;
// 0 when the run never went past the limit.
func (r *Result) PeakOvershoot() (float64, time.Duration) {
	var all []time.Duration
	for _, reg := range r.Regions {
		all = append(all, reg.Admitted...)
	}
	slices.Sort(all)
	peak, at := 0.0, time.Duration(0)
	for i, t := range all {
		if over := float64(i+1) - (r.Capacity + r.RefillPerSecond*t.Seconds()); over > peak {
			peak, at = over, t
		}
	}
	return peak, at
}

// MaxInWindow is the most instants of sorted (ascending) that fall in one
// half-open window [t, t+w); 0 for an empty window.
func MaxInWindow(sorted []time.Duration, w time.Duration) int {
	if w <= 0 {
		return 0
	}
	best, lo := 0, 0
	for hi, t := range sorted {
		for t-sorted[lo] >= w {
			lo++
		}
		best = max(best, hi-lo+1)
	}
	return best
}

// Report is the outcome of a demo: the same traffic on a reconciled rule
// and on an unreconciled one.
type Report struct {
	// Key is the client key both runs used.
	Key string
	// Rate is the checks per second sent to each region.
	Rate float64
	// Duration is the planned length of each run.
	Duration time.Duration
	// Runs are the results, reconciled rule first.
	Runs []Result
}

// Write prints the report.
func (rep *Report) Write(w io.Writer) error {
	var b strings.Builder
	var where []string
	if len(rep.Runs) > 0 {
		for _, reg := range rep.Runs[0].Regions {
			where = append(where, reg.Region+" "+reg.Address)
		}
	}
	fmt.Fprintf(&b, "key %s: %s checks/s to each region (%s) for %v per rule\n",
		rep.Key, num(rep.Rate), strings.Join(where, ", "), rep.Duration)
	for _, r := range rep.Runs {
		how := "reconciled across the regions"
		if !r.Reconciled {
			how = "not reconciled: each region on its own"
		}
		fmt.Fprintf(&b, "\n%s (%s)\n", r.Rule, how)
		var admitted []string
		for _, reg := range r.Regions {
			admitted = append(admitted, fmt.Sprintf("%s %d of %d", reg.Region, len(reg.Admitted), reg.Sent))
		}
		fmt.Fprintf(&b, "  admitted    %s\n", strings.Join(admitted, ", "))
		fmt.Fprintf(&b, "  total       %d\n", r.Total())
		fmt.Fprintf(&b, "  limit       %.1f = capacity %s + refill %s/s x T %.1fs\n",
			r.Limit(), num(r.Capacity), num(r.RefillPerSecond), r.Elapsed.Seconds())
		remote := r.RemoteSpend()
		fmt.Fprintf(&b, "  overshoot   %s = %s x one gossip interval of remote spending (%d: the most admitted in %v by every region but one)\n",
			signed(r.Overshoot(), 1), signed(r.OvershootIntervals(), 2), remote, r.GossipInterval)
		peak, at := r.PeakOvershoot()
		fmt.Fprintf(&b, "  peak        %s at t=%.1fs = %s x one gossip interval of remote spending (admitted by t - capacity - refill*t)\n",
			signed(peak, 1), at.Seconds(), signed(intervals(peak, remote), 2))
	}
	if i := slices.IndexFunc(rep.Runs, func(r Result) bool { return r.Reconciled }); i >= 0 {
		if j := slices.IndexFunc(rep.Runs, func(r Result) bool { return !r.Reconciled }); j >= 0 {
			rec, solo := &rep.Runs[i], &rep.Runs[j]
			fmt.Fprintf(&b, "\nadmitted / limit: %.2f reconciled, %.2f not reconciled\n",
				ratio(rec.Total(), rec.Limit()), ratio(solo.Total(), solo.Limit()))
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func ratio(n int, limit float64) float64 {
	if limit <= 0 {
		return math.NaN()
	}
	return float64(n) / limit
}

// signed prints f with a sign and prec decimals, and no "-0.0".
func signed(f float64, prec int) string {
	p := math.Pow(10, float64(prec))
	f = math.Round(f*p) / p
	if f == 0 {
		f = 0 // not -0
	}
	return fmt.Sprintf("%+.*f", prec, f)
}

// num prints a rule parameter without a needless fraction.
func num(f float64) string { return fmt.Sprintf("%g", f) }
