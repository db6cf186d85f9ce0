package demo

import (
	"errors"
	"fmt"
	"image/color"
	"io"
	"slices"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgsvg"
)

// Names of the chart's series other than the regions, in its legends.
const (
	ChartTotal = "total"
	ChartLimit = "limit: capacity + refill × t"
)

// Size of the chart: two panels side by side.
const (
	chartWidth  = 26 * vg.Centimeter
	chartHeight = 11 * vg.Centimeter
)

// ErrNoRuns is returned by WriteChart for a report without runs.
var ErrNoRuns = errors.New("demo: the report has no runs to chart")

// regionColors are the regions' lines, in the order of the report; total is
// black and the limit dashed red, so the series read the same in both panels.
var regionColors = []color.Color{
	color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
	color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
}

var (
	totalColor = color.Black
	limitColor = color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}
)

// WriteChart draws the report as an SVG: one panel per run, side by side
// (the reconciled rule first), each with the tokens admitted so far by
// every region and in total over the run, against the limit
// capacity + refill*t. It draws the same admissions Write prints, so the
// chart and the printed report never disagree.
func (rep *Report) WriteChart(w io.Writer) error {
	if len(rep.Runs) == 0 {
		return ErrNoRuns
	}
	// One y scale for every panel, so the runs compare at a glance.
	top := 0.0
	for i := range rep.Runs {
		r := &rep.Runs[i]
		top = max(top, float64(r.Total()), r.Capacity+r.RefillPerSecond*chartEnd(r).Seconds())
	}
	row := make([]*plot.Plot, len(rep.Runs))
	for i := range rep.Runs {
		// Headroom above the data for the legend, top left.
		p, err := runPlot(&rep.Runs[i], top*1.4)
		if err != nil {
			return err
		}
		row[i] = p
	}

	c := vgsvg.New(chartWidth, chartHeight)
	dc := draw.New(c)
	title := text.Style{
		Color:   color.Black,
		Font:    font.From(sansFont, 13),
		XAlign:  draw.XCenter,
		YAlign:  draw.YTop,
		Handler: plot.DefaultTextHandler,
	}
	pad := vg.Points(8)
	dc.FillText(title, vg.Point{X: chartWidth / 2, Y: chartHeight - pad}, rep.chartTitle())
	titleHeight := title.Height(rep.chartTitle())
	tiles := draw.Tiles{
		Rows: 1, Cols: len(row),
		PadTop: 2*pad + titleHeight, PadBottom: pad, PadLeft: pad, PadRight: pad,
		PadX: 3 * pad,
	}
	canvases := plot.Align([][]*plot.Plot{row}, tiles, dc)
	for i, p := range row {
		p.Draw(canvases[0][i])
	}
	_, err := c.WriteTo(w)
	return err
}

// chartTitle names the regions, the rate and the gossip interval.
func (rep *Report) chartTitle() string {
	var regions []string
	interval := time.Duration(0)
	if len(rep.Runs) > 0 {
		for _, reg := range rep.Runs[0].Regions {
			regions = append(regions, reg.Region)
		}
		interval = rep.Runs[0].GossipInterval
	}
	return fmt.Sprintf("make demo: one key, %s checks/s to each of %s, gossip interval %v",
		num(rep.Rate), strings.Join(regions, ", "), interval)
}

// chartEnd is where a run's x axis ends: its length, or its last admission
// when that came later (a run cut short, a synthetic one).
func chartEnd(r *Result) time.Duration {
	end := r.Elapsed
	for _, reg := range r.Regions {
		if n := len(reg.Admitted); n > 0 {
			end = max(end, reg.Admitted[n-1])
		}
	}
	return end
}

// sansFont is the chart's typeface (the plot package defaults to a serif).
var sansFont = font.Font{Typeface: "Liberation", Variant: "Sans"}

// runPlot is one run's panel, with its y axis from 0 to top.
func runPlot(r *Result, top float64) (*plot.Plot, error) {
	p := plot.New()
	for _, s := range []*text.Style{&p.Title.TextStyle, &p.X.Label.TextStyle, &p.Y.Label.TextStyle,
		&p.X.Tick.Label, &p.Y.Tick.Label, &p.Legend.TextStyle} {
		s.Font.Typeface, s.Font.Variant = sansFont.Typeface, sansFont.Variant
	}
	how := "reconciled"
	if !r.Reconciled {
		how = "not reconciled"
	}
	p.Title.Text = fmt.Sprintf("%s (%s): %d admitted, limit %.1f\ncapacity %s + refill %s/s × T %.1fs",
		r.Rule, how, r.Total(), r.Limit(), num(r.Capacity), num(r.RefillPerSecond), r.Elapsed.Seconds())
	p.Title.TextStyle.Font.Size = 11
	p.X.Label.Text = "time since the run started (s)"
	p.Y.Label.Text = "tokens admitted so far"
	p.X.Min, p.Y.Min, p.Y.Max = 0, 0, top
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.XOffs, p.Legend.YOffs = vg.Points(6), -vg.Points(4)
	p.Add(plotter.NewGrid())

	end := chartEnd(r)
	var all []time.Duration
	for i, reg := range r.Regions {
		// Regions that admit alike draw over each other: each line is
		// thinner than the one before, so all of them show.
		width := 1 + 1.2*float64(len(r.Regions)-1-i)
		l, err := cumulative(reg.Admitted, end, regionColors[i%len(regionColors)], width)
		if err != nil {
			return nil, fmt.Errorf("chart %s %s: %w", r.Rule, reg.Region, err)
		}
		p.Add(l)
		p.Legend.Add(reg.Region, l)
		all = append(all, reg.Admitted...)
	}
	slices.Sort(all)
	total, err := cumulative(all, end, totalColor, 2.2)
	if err != nil {
		return nil, fmt.Errorf("chart %s total: %w", r.Rule, err)
	}
	p.Add(total)
	p.Legend.Add(ChartTotal, total)

	limit, err := plotter.NewLine(plotter.XYs{
		{X: 0, Y: r.Capacity},
		{X: end.Seconds(), Y: r.Capacity + r.RefillPerSecond*end.Seconds()},
	})
	if err != nil {
		return nil, fmt.Errorf("chart %s limit: %w", r.Rule, err)
	}
	limit.Color = limitColor
	limit.Width = vg.Points(1.5)
	limit.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
	p.Add(limit)
	p.Legend.Add(ChartLimit, limit)
	return p, nil
}

// cumulative is the step line of how many of sorted (ascending) instants
// had passed at each moment from 0 to end.
func cumulative(sorted []time.Duration, end time.Duration, c color.Color, width float64) (*plotter.Line, error) {
	xys := make(plotter.XYs, 0, len(sorted)+2)
	xys = append(xys, plotter.XY{})
	for i, t := range sorted {
		xys = append(xys, plotter.XY{X: t.Seconds(), Y: float64(i + 1)})
	}
	xys = append(xys, plotter.XY{X: end.Seconds(), Y: float64(len(sorted))})
	l, err := plotter.NewLine(xys)
	if err != nil {
		return nil, err
	}
	l.StepStyle = plotter.PostStep
	l.Color = c
	l.Width = vg.Points(width)
	return l, nil
}
