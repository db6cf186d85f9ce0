package main

import (
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// results are the samples by row, then concurrency, then round.
type results map[int]map[int][]sample

func (res results) add(row, round int, samples map[int]sample) {
	if res[row] == nil {
		res[row] = make(map[int][]sample)
	}
	for c, s := range samples {
		for len(res[row][c]) <= round {
			res[row][c] = append(res[row][c], sample{failed: "not run"})
		}
		res[row][c][round] = s
	}
}

// ok are the samples of row at c that count.
func (res results) ok(row, c int) []sample {
	var out []sample
	for _, s := range res[row][c] {
		if s.failed == "" {
			out = append(out, s)
		}
	}
	return out
}

// median of the values of f over the samples that count; NaN when none.
func (res results) median(row, c int, f func(sample) float64) float64 {
	var v []float64
	for _, s := range res.ok(row, c) {
		v = append(v, f(s))
	}
	return median(v)
}

func median(v []float64) float64 {
	v = slices.DeleteFunc(slices.Clone(v), math.IsNaN)
	if len(v) == 0 {
		return math.NaN()
	}
	slices.Sort(v)
	if n := len(v); n%2 == 0 {
		return (v[n/2-1] + v[n/2]) / 2
	}
	return v[len(v)/2]
}

// perRound is the median over rounds of f of the samples of rows a and b
// at c in the same round, over the rounds where both count: a ratio of
// two systems measured minutes apart, under the same load of the machine.
func (res results) perRound(a, b, c int, f func(x, y sample) float64) float64 {
	xs, ys := res[a][c], res[b][c]
	var v []float64
	for i := range min(len(xs), len(ys)) {
		if xs[i].failed == "" && ys[i].failed == "" {
			v = append(v, f(xs[i], ys[i]))
		}
	}
	return median(v)
}

// header describes the run above the table.
type header struct {
	limiterd    string
	rounds      int
	duration    time.Duration
	concurrency []int
	took        time.Duration
	cores       int
	// pinned is the CPUs of the servers when ghz had CPU 0 to itself
	// (--pin); "" when they shared every CPU.
	pinned string
}

// report prints the table of medians, the per-command Redis costs, the
// ratios against their targets and the failed runs, as markdown.
func report(w io.Writer, h header, selected []row, res results) {
	hi := h.concurrency[len(h.concurrency)-1]
	fmt.Fprintf(w, "\n## make compare\n\n")
	cpus := "load tool and servers on the same ones"
	if h.pinned != "" {
		cpus = fmt.Sprintf("ghz on CPU 0, the servers and their Redis on CPU %s (--pin)", h.pinned)
	}
	fmt.Fprintf(w, "limiterd: %s. ghz %s, envoy ratelimit %s, Gubernator %s. %d round(s) of %s per run, "+
		"one connection, a new key per request; medians over rounds; %d cores, %s; took %s.\n\n",
		h.limiterd, ghzTool.version, envoyRatelimit.version, gubernator.version, h.rounds, h.duration, h.cores, cpus, h.took)

	cols := []string{"row", "system", "API"}
	for _, c := range h.concurrency {
		cols = append(cols, fmt.Sprintf("req/s c=%d", c))
	}
	cols = append(cols, fmt.Sprintf("p99 c=%d", hi), fmt.Sprintf("server µs/call c=%d", hi), fmt.Sprintf("Redis µs/call c=%d", hi),
		fmt.Sprintf("ghz µs/call c=%d", hi))
	fmt.Fprintf(w, "| %s |\n|%s\n", strings.Join(cols, " | "), strings.Repeat("---|", len(cols)))
	for _, r := range selected {
		cells := []string{strconv.Itoa(r.n), r.system, r.api.name}
		for _, c := range h.concurrency {
			cells = append(cells, res.cell(r.n, c, func(v float64) string { return thousands(v) }, func(s sample) float64 { return s.rps }))
		}
		cells = append(cells,
			res.cell(r.n, hi, func(v float64) string { return fmt.Sprintf("%.2f ms", v) }, func(s sample) float64 { return float64(s.p99) / 1e6 }),
			res.cell(r.n, hi, func(v float64) string { return fmt.Sprintf("%.1f", v) }, func(s sample) float64 { return s.serverUs }),
			res.cell(r.n, hi, us, func(s sample) float64 { return s.redisUs }),
			res.cell(r.n, hi, func(v float64) string { return fmt.Sprintf("%.1f", v) }, func(s sample) float64 { return s.clientUs }))
		fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
	}

	fmt.Fprintf(w, "\nRedis time per call by command at c=%d: INFO commandstats `usec`, summed over the nodes, "+
		"divided by ghz's calls; calls per call in brackets; commands under 1 per 1,000 calls left out. "+
		"A command a script runs (redis.call) is listed on its own too, its time also inside the script's.\n\n", hi)
	fmt.Fprintf(w, "| row | system | API | µs per call by command |\n|---|---|---|---|\n")
	for _, r := range selected {
		if r.store == storeNone {
			continue
		}
		fmt.Fprintf(w, "| %d | %s | %s | %s |\n", r.n, r.system, r.api.name, res.commands(r.n, hi))
	}

	fmt.Fprintf(w, "\nRatios (each the median over rounds of the ratio within a round):\n\n")
	fmt.Fprintf(w, "| ratio | value | target | |\n|---|---|---|---|\n")
	for _, t := range targets(h.concurrency) {
		if !slices.ContainsFunc(t.rows, func(n int) bool { return res[n] != nil }) {
			continue // none of its rows ran
		}
		v := t.value(res)
		mark := "n/a"
		switch {
		case math.IsNaN(v):
		case t.met(v):
			mark = "met"
		default:
			mark = "not met"
		}
		fmt.Fprintf(w, "| %s | %s | %s %s | %s |\n", t.name, t.format(v), t.op, t.format(t.bound), mark)
	}

	var failed []string
	for _, r := range selected {
		for _, c := range h.concurrency {
			for round, s := range res[r.n][c] {
				if s.failed != "" {
					failed = append(failed, fmt.Sprintf("- row %d, round %d, c=%d: %s", r.n, round+1, c, oneLine(s.failed)))
				}
			}
		}
	}
	if len(failed) > 0 {
		fmt.Fprintf(w, "\nFailed runs (left out of the medians):\n\n%s\n", strings.Join(failed, "\n"))
	}
}

// cell is the median of f at (row, c), with how many rounds counted when
// some did not; "failed" when none did.
func (res results) cell(row, c int, format func(float64) string, f func(sample) float64) string {
	all, ok := len(res[row][c]), len(res.ok(row, c))
	if ok == 0 {
		return "failed"
	}
	s := format(res.median(row, c, f))
	if ok < all {
		s += fmt.Sprintf(" (%d/%d)", ok, all)
	}
	return s
}

// commands lists the median Redis µs and calls per call of each command
// at (row, c), costliest first.
func (res results) commands(row, c int) string {
	ok := res.ok(row, c)
	if len(ok) == 0 {
		return "failed"
	}
	names := make(map[string]bool)
	for _, s := range ok {
		for k := range s.commands {
			names[k] = true
		}
	}
	type cost struct {
		name        string
		usec, calls float64
	}
	var list []cost
	for name := range maps.Keys(names) {
		var u, n []float64
		for _, s := range ok {
			u = append(u, s.commands[name].usec)
			n = append(n, s.commands[name].calls)
		}
		if cl := median(n); cl >= 0.001 {
			list = append(list, cost{name, median(u), cl})
		}
	}
	slices.SortFunc(list, func(a, b cost) int {
		if a.usec != b.usec {
			return compareFloat(b.usec, a.usec)
		}
		return strings.Compare(a.name, b.name)
	})
	var parts []string
	for _, x := range list {
		parts = append(parts, fmt.Sprintf("%s %.2f (%.3g)", strings.ReplaceAll(x.name, "|", "\\|"), x.usec, x.calls))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

func compareFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// target is a figure the comparison is run for, and its bound.
type target struct {
	name string
	// rows are the rows the figure needs.
	rows   []int
	op     string // "≥" or "≤"
	bound  float64
	format func(float64) string
	value  func(results) float64
}

func (t target) met(v float64) bool {
	if t.op == "≥" {
		return v >= t.bound
	}
	return v <= t.bound
}

func times(v float64) string {
	if math.IsNaN(v) {
		return "n/a"
	}
	return fmt.Sprintf("%.2fx", v)
}

func plain(v float64) string {
	if math.IsNaN(v) {
		return "n/a"
	}
	return fmt.Sprintf("%.2f", v)
}

func micros(v float64) string {
	if math.IsNaN(v) {
		return "n/a"
	}
	return fmt.Sprintf("%.1f µs", v)
}

// targets are the ratios and figures the table is for; the concurrencies
// above 1 for the RLS throughput, the highest for the rest.
func targets(conc []int) []target {
	hi := conc[len(conc)-1]
	rps := func(x, y sample) float64 { return x.rps / y.rps }
	var out []target
	for _, c := range conc {
		if c == 1 {
			continue
		}
		for _, a := range []int{1, 2} {
			out = append(out, target{
				name: fmt.Sprintf("limiterd RLS (row %d) / envoy ratelimit (row 3), req/s at c=%d", a, c), rows: []int{a, 3},
				op: "≥", bound: 1.3, format: times,
				value: func(res results) float64 { return res.perRound(a, 3, c, rps) },
			})
		}
	}
	cpu := func(x, y sample) float64 { return (x.serverUs + x.redisUs) / (y.serverUs + y.redisUs) }
	for _, a := range []int{1, 2} {
		out = append(out, target{
			name: fmt.Sprintf("limiterd RLS (row %d) / envoy ratelimit (row 3), server + Redis CPU per call at c=%d", a, hi), rows: []int{a, 3},
			op: "≤", bound: 0.6, format: times,
			value: func(res results) float64 { return res.perRound(a, 3, hi, cpu) },
		})
	}
	out = append(out,
		target{
			name: fmt.Sprintf("Check 1-primary (row 5) / health (row 8), req/s at c=%d", hi), rows: []int{5, 8},
			op: "≥", bound: 0.75, format: plain,
			value: func(res results) float64 { return res.perRound(5, 8, hi, rps) },
		},
		target{
			name: fmt.Sprintf("limiterd server CPU per Check, 1-primary (row 5) at c=%d", hi), rows: []int{5},
			op: "≤", bound: 40, format: micros,
			value: func(res results) float64 { return res.median(5, hi, func(s sample) float64 { return s.serverUs }) },
		},
		target{
			name: fmt.Sprintf("limiterd server CPU per Check, 3-primary (row 4) at c=%d", hi), rows: []int{4},
			op: "≤", bound: 40, format: micros,
			value: func(res results) float64 { return res.median(4, hi, func(s sample) float64 { return s.serverUs }) },
		},
		target{
			name: fmt.Sprintf("Redis CPU per Check on 3 primaries (row 4) at c=%d", hi), rows: []int{4},
			op: "≤", bound: 20, format: micros,
			value: func(res results) float64 { return res.median(4, hi, func(s sample) float64 { return s.redisUs }) },
		})
	for _, c := range conc {
		out = append(out, target{
			name: fmt.Sprintf("limiterd in memory (row 6) / Gubernator (row 7), req/s at c=%d", c), rows: []int{6, 7},
			op: "≥", bound: 1.5, format: times,
			value: func(res results) float64 { return res.perRound(6, 7, c, rps) },
		})
	}
	return out
}

// us formats µs per call, "-" without a value (no Redis).
func us(v float64) string {
	if math.IsNaN(v) {
		return "-"
	}
	return fmt.Sprintf("%.1f", v)
}

// thousands formats v rounded, with commas: 12,345.
func thousands(v float64) string {
	s := strconv.FormatInt(int64(math.Round(v)), 10)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 300 {
		s = s[:300] + "…"
	}
	return s
}
