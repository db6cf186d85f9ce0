package loadgen

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
)

// Result is what a load run measured. The headline counts and the latency
// cover the measured part of the run only; PerKey and Accuracy also count the
// warmup, whose requests spend tokens too. A Result is not safe for
// concurrent modification.
type Result struct {
	// Options are the options of the run.
	Options Options
	// Seed is the seed of the key choice (0 in health mode).
	Seed uint64
	// Elapsed is the wall time of the measured part, from the end of the
	// warmup to the last answer.
	Elapsed time.Duration
	// Total is Allowed + Limited + Errors: the measured requests answered.
	Total           int64
	Allowed         int64
	Limited         int64
	Errors          int64
	ChecksPerSecond float64
	// ErrorsByCode counts Errors by gRPC code name (such as "Unavailable"),
	// and health answers other than SERVING under CodeNotServing.
	ErrorsByCode map[string]int64
	// Unsent counts the open-loop requests due in the measured part that
	// no worker was free to send before the end: above 0, the target rate
	// was not reached and more workers are needed.
	Unsent int64
	// Latency summarizes Histogram.
	Latency Latency
	// Histogram holds the latency of every measured request in
	// microseconds. In open-loop mode latency counts from the time the
	// request was due.
	Histogram *hdrhistogram.Histogram
	// PerKey has one entry per key sent at least one request, in key order
	// (nil in health mode).
	PerKey []KeyResult
	// Accuracy is set when Options.ExpectRate is above 0.
	Accuracy *Accuracy
	// Interrupted is set when the caller's context ended the run early.
	Interrupted bool
}

// Latency is a summary of a latency histogram, at microsecond resolution.
type Latency struct {
	P50, P90, P99, P999, Max, Mean time.Duration
}

func latencyOf(h *hdrhistogram.Histogram) Latency {
	if h.TotalCount() == 0 {
		return Latency{}
	}
	us := func(v int64) time.Duration { return time.Duration(v) * time.Microsecond }
	return Latency{
		P50:  us(h.ValueAtPercentile(50)),
		P90:  us(h.ValueAtPercentile(90)),
		P99:  us(h.ValueAtPercentile(99)),
		P999: us(h.ValueAtPercentile(99.9)),
		Max:  us(h.Max()),
		Mean: time.Duration(h.Mean() * float64(time.Microsecond)),
	}
}

// sortedCodes returns the codes of m, most frequent first.
func sortedCodes(m map[string]int64) []string {
	return slices.SortedFunc(maps.Keys(m), func(a, b string) int {
		if c := cmp.Compare(m[b], m[a]); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
}

func percent(n, total int64) float64 {
	if total == 0 {
		return 0
	}
	return 100 * float64(n) / float64(total)
}

func ms(d time.Duration) string { return fmt.Sprintf("%.3f ms", float64(d)/float64(time.Millisecond)) }

// WriteTable writes r as a table for people to read.
func (r *Result) WriteTable(w io.Writer) error {
	o := &r.Options
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(label, format string, args ...any) {
		fmt.Fprintf(tw, "%s\t"+format+"\n", append([]any{label}, args...)...)
	}
	switch o.Mode {
	case ModeHealth:
		row("target", "%s, grpc.health.v1.Health/Check", o.Target)
	default:
		row("target", "%s, limiter.v1.Limiter/Check rule %q cost %g", o.Target, o.Rule, o.Cost)
	}
	loop := "closed loop"
	if o.Rate > 0 {
		loop = fmt.Sprintf("open loop at %g/s", o.Rate)
	}
	row("load", "%s, %d workers, %d connections", loop, o.Concurrency, o.Conns)
	if o.Mode == ModeCheck {
		dist := string(o.KeyDist)
		if o.KeyDist == Zipf {
			dist = fmt.Sprintf("zipf s=%g", o.ZipfS)
		}
		row("keys", "%d %s, %q to %q, seed %d", o.Keys, dist, o.KeyPrefix+"0", o.KeyPrefix+strconv.Itoa(o.Keys-1), r.Seed)
	}
	row("elapsed", "%.3fs, after %s of warmup not counted", r.Elapsed.Seconds(), o.Warmup)
	if r.Interrupted {
		row("interrupted", "yes: partial results")
	}
	row("checks", "%d", r.Total)
	row("checks/s", "%.1f", r.ChecksPerSecond)
	if o.Rate > 0 {
		row("unsent", "%d due but no worker free", r.Unsent)
	}
	row("allowed", "%d (%.2f%%)", r.Allowed, percent(r.Allowed, r.Total))
	row("limited", "%d (%.2f%%)", r.Limited, percent(r.Limited, r.Total))
	row("errors", "%d (%.2f%%)", r.Errors, percent(r.Errors, r.Total))
	for _, code := range sortedCodes(r.ErrorsByCode) {
		row("  "+code, "%d", r.ErrorsByCode[code])
	}
	row("latency p50", "%s", ms(r.Latency.P50))
	row("latency p90", "%s", ms(r.Latency.P90))
	row("latency p99", "%s", ms(r.Latency.P99))
	row("latency p99.9", "%s", ms(r.Latency.P999))
	row("latency max", "%s", ms(r.Latency.Max))
	if a := r.Accuracy; a != nil {
		row("accuracy", "rate %g/s burst %g per key, %d keys, warmup included", a.Rate, a.Burst, a.Keys)
		row("  admitted", "%d of %.1f expected (ratio %.3f)", a.Admitted, a.Expected, a.Ratio)
		row("  worst key", "%s: %d of %.1f expected (overshoot %.3f)", a.WorstKey, a.WorstAdmitted, a.WorstExpected, a.WorstOvershoot)
		row("  over keys", "%d admitted more than expected", a.OverKeys)
	}
	return tw.Flush()
}

// jsonResult is the JSON form of a Result, with its units in the names.
type jsonResult struct {
	Mode            Mode             `json:"mode"`
	Target          string           `json:"target"`
	Rule            string           `json:"rule,omitempty"`
	Cost            float64          `json:"cost,omitempty"`
	Concurrency     int              `json:"concurrency"`
	Conns           int              `json:"conns"`
	Rate            float64          `json:"rate"`
	Keys            int              `json:"keys,omitempty"`
	KeyDist         KeyDist          `json:"key_dist,omitempty"`
	ZipfS           float64          `json:"zipf_s,omitempty"`
	KeyPrefix       string           `json:"key_prefix,omitempty"`
	Seed            uint64           `json:"seed,omitempty"`
	WarmupSeconds   float64          `json:"warmup_seconds"`
	ElapsedSeconds  float64          `json:"elapsed_seconds"`
	Interrupted     bool             `json:"interrupted"`
	Checks          int64            `json:"checks"`
	ChecksPerSecond float64          `json:"checks_per_second"`
	Unsent          int64            `json:"unsent"`
	Allowed         int64            `json:"allowed"`
	Limited         int64            `json:"limited"`
	Errors          int64            `json:"errors"`
	ErrorsByCode    map[string]int64 `json:"errors_by_code"`
	LatencyMicros   jsonLatency      `json:"latency_us"`
	Accuracy        *jsonAccuracy    `json:"accuracy,omitempty"`
}

type jsonLatency struct {
	P50  int64   `json:"p50"`
	P90  int64   `json:"p90"`
	P99  int64   `json:"p99"`
	P999 int64   `json:"p99_9"`
	Max  int64   `json:"max"`
	Mean float64 `json:"mean"`
}

type jsonAccuracy struct {
	Rate           float64 `json:"rate"`
	Burst          float64 `json:"burst"`
	Keys           int     `json:"keys"`
	Admitted       int64   `json:"admitted"`
	Expected       float64 `json:"expected"`
	Ratio          float64 `json:"ratio"`
	WorstOvershoot float64 `json:"worst_overshoot"`
	WorstKey       string  `json:"worst_key"`
	WorstAdmitted  int64   `json:"worst_admitted"`
	WorstExpected  float64 `json:"worst_expected"`
	OverKeys       int     `json:"over_keys"`
}

// WriteJSON writes r as one JSON object: durations in seconds, latencies in
// microseconds, no per-key counts.
func (r *Result) WriteJSON(w io.Writer) error {
	o := &r.Options
	j := jsonResult{
		Mode:            o.Mode,
		Target:          o.Target,
		Concurrency:     o.Concurrency,
		Conns:           o.Conns,
		Rate:            o.Rate,
		Seed:            r.Seed,
		WarmupSeconds:   o.Warmup.Seconds(),
		ElapsedSeconds:  r.Elapsed.Seconds(),
		Interrupted:     r.Interrupted,
		Checks:          r.Total,
		ChecksPerSecond: r.ChecksPerSecond,
		Unsent:          r.Unsent,
		Allowed:         r.Allowed,
		Limited:         r.Limited,
		Errors:          r.Errors,
		ErrorsByCode:    r.ErrorsByCode,
		LatencyMicros: jsonLatency{
			P50:  r.Latency.P50.Microseconds(),
			P90:  r.Latency.P90.Microseconds(),
			P99:  r.Latency.P99.Microseconds(),
			P999: r.Latency.P999.Microseconds(),
			Max:  r.Latency.Max.Microseconds(),
			Mean: float64(r.Latency.Mean) / float64(time.Microsecond),
		},
	}
	if j.ErrorsByCode == nil {
		j.ErrorsByCode = map[string]int64{}
	}
	if o.Mode == ModeCheck {
		j.Rule, j.Cost = o.Rule, o.Cost
		j.Keys, j.KeyDist, j.KeyPrefix = o.Keys, o.KeyDist, o.KeyPrefix
		if o.KeyDist == Zipf {
			j.ZipfS = o.ZipfS
		}
	}
	if a := r.Accuracy; a != nil {
		j.Accuracy = &jsonAccuracy{
			Rate: a.Rate, Burst: a.Burst, Keys: a.Keys,
			Admitted: a.Admitted, Expected: a.Expected, Ratio: a.Ratio,
			WorstOvershoot: a.WorstOvershoot, WorstKey: a.WorstKey,
			WorstAdmitted: a.WorstAdmitted, WorstExpected: a.WorstExpected,
			OverKeys: a.OverKeys,
		}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(j)
}
