package main

import (
	"fmt"
	"html"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Write writes overload.md and overload.svg into dir.
func (rep *Report) Write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for name, write := range map[string]func(io.Writer) error{"overload.md": rep.WriteMarkdown, "overload.svg": rep.WriteSVG} {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		err = write(f)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func ms(d time.Duration) string { return fmt.Sprintf("%.0f ms", float64(d)/float64(time.Millisecond)) }

// WriteMarkdown writes the table, then critical's figures at the top
// load against the goal.
func (rep *Report) WriteMarkdown(w io.Writer) error {
	o := rep.Opts
	var b strings.Builder
	fmt.Fprintf(&b, "Backend: %v × (1 + in flight / %d)^%v, failing past %d in flight; 1x = %v requests/s (Poisson), classes %s = %s; %v measured after %v; timeout %v.\n\n",
		o.Base, o.Capacity, o.Exponent, o.Ceiling, o.Rate, strings.Join(Classes, "/"), "20/50/30%", o.Duration, o.Warmup, o.Timeout)
	b.WriteString("| configuration | load | class | offered/s | goodput/s | of offered | p99 | p99 / 1x | shed | errors |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rep.Rows {
		base, _ := rep.Find(r.Config, o.Loads[0], r.Class)
		fmt.Fprintf(&b, "| %s | %gx | %s | %.0f | %.0f | %.0f%% | %s | %s | %d | %d |\n",
			r.Config, r.Load, r.Class, r.Offered, r.Goodput, pct(r.Goodput, r.Offered), ms(r.P99), ratio(r.P99, base.P99), r.Shed, r.Errors)
	}
	top := o.Loads[len(o.Loads)-1]
	fmt.Fprintf(&b, "\nCritical at %gx (goal: at least 95%% of offered served, p99 within 2x of 1x):\n\n", top)
	b.WriteString("| configuration | served | p99 / 1x | goal |\n|---|---|---|---|\n")
	for _, cfg := range o.Configs {
		r, _ := rep.Find(cfg, top, Classes[0])
		base, _ := rep.Find(cfg, o.Loads[0], Classes[0])
		met := "met"
		if pct(r.Goodput, r.Offered) < 95 || base.P99 == 0 || float64(r.P99) > 2*float64(base.P99) {
			met = "not met"
		}
		fmt.Fprintf(&b, "| %s | %.0f%% | %s | %s |\n", cfg, pct(r.Goodput, r.Offered), ratio(r.P99, base.P99), met)
	}
	if rep.LoadBefore != "" {
		fmt.Fprintf(&b, "\nLoad average (1, 5, 15 min): %s before the runs, %s after.\n", rep.LoadBefore, rep.LoadAfter)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func pct(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return 100 * a / b
}

func ratio(a, b time.Duration) string {
	if b == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f", float64(a)/float64(b))
}

// classColors are the classes' bars, most important first.
var classColors = []string{"#d62728", "#1f77b4", "#7f7f7f"}

// WriteSVG draws two panels at the top load: each class's goodput as a
// share of what it offered, and its p99 latency against its 1x p99, per
// configuration.
func (rep *Report) WriteSVG(w io.Writer) error {
	const width, height = 1000, 360
	top := rep.Opts.Loads[len(rep.Opts.Loads)-1]
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="%d" y="22" text-anchor="middle" font-size="15">make overload: %gx the backend's 1x rate (%v/s), by configuration and class</text>`+"\n", width/2, top, rep.Opts.Rate)
	good := func(cfg, class string) (float64, string) {
		r, _ := rep.Find(cfg, top, class)
		v := pct(r.Goodput, r.Offered)
		return v, fmt.Sprintf("%.0f%%", v)
	}
	p99 := func(cfg, class string) (float64, string) {
		r, _ := rep.Find(cfg, top, class)
		base, _ := rep.Find(cfg, rep.Opts.Loads[0], class)
		if base.P99 == 0 || r.Goodput == 0 {
			return 0, "-"
		}
		v := float64(r.P99) / float64(base.P99)
		return v, fmt.Sprintf("%.1f", v)
	}
	panel(&b, 40, "goodput, % of offered (goal for critical: ≥ 95)", 100, 95, rep.Opts.Configs, good)
	panel(&b, 540, "p99 latency ÷ p99 at 1x (goal for critical: ≤ 2)", 10, 2, rep.Opts.Configs, p99)
	// Legend.
	for i, c := range Classes {
		x := width/2 - 150 + i*100
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s</text>`+"\n", x, height-22, classColors[i], x+16, height-12, c)
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// panel draws grouped bars at x0: one group per configuration of cfgs,
// one bar per class, the value's label above its bar; top is the axis's
// top (a value above is drawn clipped, its label true) and goal a dashed
// line.
func panel(b *strings.Builder, x0 int, title string, top, goal float64, cfgs []string, value func(cfg, class string) (float64, string)) {
	const pw, ph, y0 = 440, 230, 60 // plot area: width, height, top
	bottom := y0 + ph
	y := func(v float64) float64 { return float64(bottom) - math.Min(v, top)/top*ph }
	fmt.Fprintf(b, `<text x="%d" y="%d" text-anchor="middle" font-size="13">%s</text>`+"\n", x0+pw/2, y0-14, html.EscapeString(title))
	fmt.Fprintf(b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", x0, bottom, x0+pw, bottom)
	fmt.Fprintf(b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", x0, y0, x0, bottom)
	for _, t := range []float64{0, top / 2, top} {
		fmt.Fprintf(b, `<text x="%d" y="%.0f" text-anchor="end" font-size="10">%g</text>`+"\n", x0-4, y(t)+4, t)
	}
	fmt.Fprintf(b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#d62728" stroke-dasharray="5,4"/>`+"\n", x0, y(goal), x0+pw, y(goal))
	gw := pw / max(len(cfgs), 1)
	bw := (gw - 30) / len(Classes)
	for g, cfg := range cfgs {
		gx := x0 + g*gw + 15
		for i, class := range Classes {
			v, label := value(cfg, class)
			x := gx + i*bw
			fmt.Fprintf(b, `<rect x="%d" y="%.1f" width="%d" height="%.1f" fill="%s"/>`+"\n", x, y(v), bw-2, float64(bottom)-y(v), classColors[i])
			fmt.Fprintf(b, `<text x="%d" y="%.1f" text-anchor="middle" font-size="10">%s</text>`+"\n", x+bw/2, y(v)-3, html.EscapeString(label))
		}
		fmt.Fprintf(b, `<text x="%d" y="%d" text-anchor="middle" font-size="11">%s</text>`+"\n", gx+(gw-30)/2, bottom+16, html.EscapeString(cfg))
	}
}
