// Package report prints the comparison's tables as markdown: the medians
// over rounds of each row, Redis's time per command, and the ratios
// against their targets.
package report

import (
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/limiterd/limiterd/internal/tools/compare/load"
)

// Results are the samples by row, then concurrency, then round.
type Results map[int]map[int][]load.Sample

// Add records the samples of row in round, by concurrency.
func (res Results) Add(row, round int, samples map[int]load.Sample) {
	if res[row] == nil {
		res[row] = make(map[int][]load.Sample)
	}
	for c, s := range samples {
		for len(res[row][c]) <= round {
			res[row][c] = append(res[row][c], load.Sample{Failed: "not run"})
		}
		res[row][c][round] = s
	}
}

// ok are the samples of row at c that count.
func (res Results) ok(row, c int) []load.Sample {
	var out []load.Sample
	for _, s := range res[row][c] {
		if s.Failed == "" {
			out = append(out, s)
		}
	}
	return out
}

// median of the values of f over the samples that count; NaN when none.
func (res Results) median(row, c int, f func(load.Sample) float64) float64 {
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
func (res Results) perRound(a, b, c int, f func(x, y load.Sample) float64) float64 {
	xs, ys := res[a][c], res[b][c]
	var v []float64
	for i := range min(len(xs), len(ys)) {
		if xs[i].Failed == "" && ys[i].Failed == "" {
			v = append(v, f(xs[i], ys[i]))
		}
	}
	return median(v)
}

// Header describes the run above the table.
type Header struct {
	// Limiterd names the limiterd measured.
	Limiterd string
	// The versions of the pinned tools.
	Ghz, EnvoyRatelimit, Gubernator string
	Rounds                          int
	Duration                        time.Duration
	Concurrency                     []int
	Took                            time.Duration
	Cores                           int
	// Pinned is the CPUs of the servers when ghz had CPU 0 to itself
	// (--pin); "" when they shared every CPU.
	Pinned string
}

// Row is one line of the table: N, its number, the system and the name of
// the API; Redis when the system has Redis servers.
type Row struct {
	N           int
	System, API string
	Redis       bool
}

// Write prints the table of medians of the rows, the per-command Redis
// costs, the ratios against their targets and the failed runs, as
// markdown.
func Write(w io.Writer, h Header, rows []Row, res Results) {
	hi := h.Concurrency[len(h.Concurrency)-1]
	fmt.Fprintf(w, "\n## make compare\n\n")
	cpus := "load tool and servers on the same ones"
	if h.Pinned != "" {
		cpus = fmt.Sprintf("ghz on CPU 0, the servers and their Redis on CPU %s (--pin)", h.Pinned)
	}
	fmt.Fprintf(w, "limiterd: %s. ghz %s, envoy ratelimit %s, Gubernator %s. %d round(s) of %s per run, "+
		"one connection, a new key per request; medians over rounds; %d cores, %s; took %s.\n\n",
		h.Limiterd, h.Ghz, h.EnvoyRatelimit, h.Gubernator, h.Rounds, h.Duration, h.Cores, cpus, h.Took)

	cols := []string{"row", "system", "API"}
	for _, c := range h.Concurrency {
		cols = append(cols, fmt.Sprintf("req/s c=%d", c))
	}
	cols = append(cols, fmt.Sprintf("p99 c=%d", hi), fmt.Sprintf("server µs/call c=%d", hi), fmt.Sprintf("Redis µs/call c=%d", hi),
		fmt.Sprintf("ghz µs/call c=%d", hi))
	fmt.Fprintf(w, "| %s |\n|%s\n", strings.Join(cols, " | "), strings.Repeat("---|", len(cols)))
	for _, r := range rows {
		cells := []string{strconv.Itoa(r.N), r.System, r.API}
		for _, c := range h.Concurrency {
			cells = append(cells, res.cell(r.N, c, func(v float64) string { return thousands(v) }, func(s load.Sample) float64 { return s.RPS }))
		}
		cells = append(cells,
			res.cell(r.N, hi, func(v float64) string { return fmt.Sprintf("%.2f ms", v) }, func(s load.Sample) float64 { return float64(s.P99) / 1e6 }),
			res.cell(r.N, hi, func(v float64) string { return fmt.Sprintf("%.1f", v) }, func(s load.Sample) float64 { return s.ServerUs }),
			res.cell(r.N, hi, us, func(s load.Sample) float64 { return s.RedisUs }),
			res.cell(r.N, hi, func(v float64) string { return fmt.Sprintf("%.1f", v) }, func(s load.Sample) float64 { return s.ClientUs }))
		fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
	}

	fmt.Fprintf(w, "\nRedis time per call by command at c=%d: INFO commandstats `usec`, summed over the nodes, "+
		"divided by ghz's calls; calls per call in brackets; commands under 1 per 1,000 calls left out. "+
		"A command a script runs (redis.call) is listed on its own too, its time also inside the script's.\n\n", hi)
	fmt.Fprintf(w, "| row | system | API | µs per call by command |\n|---|---|---|---|\n")
	for _, r := range rows {
		if !r.Redis {
			continue
		}
		fmt.Fprintf(w, "| %d | %s | %s | %s |\n", r.N, r.System, r.API, res.commands(r.N, hi))
	}

	fmt.Fprintf(w, "\nRatios (each the median over rounds of the ratio within a round):\n\n")
	fmt.Fprintf(w, "| ratio | value | target | |\n|---|---|---|---|\n")
	for _, t := range targets(h.Concurrency) {
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
	for _, r := range rows {
		for _, c := range h.Concurrency {
			for round, s := range res[r.N][c] {
				if s.Failed != "" {
					failed = append(failed, fmt.Sprintf("- row %d, round %d, c=%d: %s", r.N, round+1, c, oneLine(s.Failed)))
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
func (res Results) cell(row, c int, format func(float64) string, f func(load.Sample) float64) string {
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
func (res Results) commands(row, c int) string {
	ok := res.ok(row, c)
	if len(ok) == 0 {
		return "failed"
	}
	names := make(map[string]bool)
	for _, s := range ok {
		for k := range s.Commands {
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
			u = append(u, s.Commands[name].Usec)
			n = append(n, s.Commands[name].Calls)
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
	value  func(Results) float64
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
	rps := func(x, y load.Sample) float64 { return x.RPS / y.RPS }
	var out []target
	for _, c := range conc {
		if c == 1 {
			continue
		}
		for _, a := range []int{1, 2} {
			out = append(out, target{
				name: fmt.Sprintf("limiterd RLS (row %d) / envoy ratelimit (row 3), req/s at c=%d", a, c), rows: []int{a, 3},
				op: "≥", bound: 1.3, format: times,
				value: func(res Results) float64 { return res.perRound(a, 3, c, rps) },
			})
		}
	}
	cpu := func(x, y load.Sample) float64 { return (x.ServerUs + x.RedisUs) / (y.ServerUs + y.RedisUs) }
	for _, a := range []int{1, 2} {
		out = append(out, target{
			name: fmt.Sprintf("limiterd RLS (row %d) / envoy ratelimit (row 3), server + Redis CPU per call at c=%d", a, hi), rows: []int{a, 3},
			op: "≤", bound: 0.6, format: times,
			value: func(res Results) float64 { return res.perRound(a, 3, hi, cpu) },
		})
	}
	out = append(out,
		target{
			name: fmt.Sprintf("Check 1-primary (row 5) / health (row 8), req/s at c=%d", hi), rows: []int{5, 8},
			op: "≥", bound: 0.75, format: plain,
			value: func(res Results) float64 { return res.perRound(5, 8, hi, rps) },
		},
		target{
			name: fmt.Sprintf("limiterd server CPU per Check, 1-primary (row 5) at c=%d", hi), rows: []int{5},
			op: "≤", bound: 40, format: micros,
			value: func(res Results) float64 { return res.median(5, hi, func(s load.Sample) float64 { return s.ServerUs }) },
		},
		target{
			name: fmt.Sprintf("limiterd server CPU per Check, 3-primary (row 4) at c=%d", hi), rows: []int{4},
			op: "≤", bound: 40, format: micros,
			value: func(res Results) float64 { return res.median(4, hi, func(s load.Sample) float64 { return s.ServerUs }) },
		},
		target{
			name: fmt.Sprintf("Redis CPU per Check on 3 primaries (row 4) at c=%d", hi), rows: []int{4},
			op: "≤", bound: 20, format: micros,
			value: func(res Results) float64 { return res.median(4, hi, func(s load.Sample) float64 { return s.RedisUs }) },
		})
	for _, c := range conc {
		out = append(out, target{
			name: fmt.Sprintf("limiterd in memory (row 6) / Gubernator (row 7), req/s at c=%d", c), rows: []int{6, 7},
			op: "≥", bound: 1.5, format: times,
			value: func(res Results) float64 { return res.perRound(6, 7, c, rps) },
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
