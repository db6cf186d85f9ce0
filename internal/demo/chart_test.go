package demo

import (
	"bytes"
	"context"
	"encoding/xml"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// syntheticReport is a demo of 10 s at 20 checks/s per region on a bucket
// of 100 refilling 1/s: reconciled, the regions share about the limit;
// unreconciled, each admits it.
func syntheticReport() *Report {
	run := func(rule string, reconciled bool, admitted ...[]time.Duration) Result {
		r := Result{Rule: rule, Reconciled: reconciled, Capacity: 100, RefillPerSecond: 1,
			Elapsed: 10 * time.Second, GossipInterval: time.Second}
		for i, region := range []string{"us-east", "eu-west", "ap-south"} {
			r.Regions = append(r.Regions, RegionResult{Region: region, Address: "127.0.0.1:808" + string(rune('1'+i)),
				Sent: 200, Admitted: admitted[i]})
		}
		return r
	}
	return &Report{Key: "limiterdemo-test", Rate: 20, Duration: 10 * time.Second, Runs: []Result{
		run("global-demo", true, every(0, 50*ms, 37), every(17*ms, 50*ms, 37), every(33*ms, 50*ms, 36)),
		run("global-demo-unreconciled", false, every(0, 50*ms, 110), every(17*ms, 50*ms, 110), every(33*ms, 50*ms, 110)),
	}}
}

// svgTexts parses an SVG as XML and returns the text of its <text>
// elements, and how many <path> elements have a dash pattern.
func svgTexts(t *testing.T, svg []byte) (texts []string, dashed int) {
	t.Helper()
	d := xml.NewDecoder(bytes.NewReader(svg))
	root := ""
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("chart is not XML: %v", err)
		}
		se, ok := tok.(xml.StartElement)
		if !ok {
			continue
		}
		if root == "" {
			root = se.Name.Local
		}
		switch se.Name.Local {
		case "text":
			var s string
			if err := d.DecodeElement(&s, &se); err != nil {
				t.Fatalf("chart <text>: %v", err)
			}
			texts = append(texts, s)
		case "path":
			for _, a := range se.Attr {
				if a.Name.Local == "style" && strings.Contains(a.Value, "stroke-dasharray:") &&
					!strings.Contains(a.Value, "stroke-dasharray:none") {
					dashed++
				}
			}
		}
	}
	if root != "svg" {
		t.Fatalf("chart's root element is <%s>, want <svg>", root)
	}
	return texts, dashed
}

func TestWriteChart(t *testing.T) {
	rep := syntheticReport()
	var b bytes.Buffer
	if err := rep.WriteChart(&b); err != nil {
		t.Fatal(err)
	}
	texts, dashed := svgTexts(t, b.Bytes())
	count := map[string]int{}
	for _, s := range texts {
		count[s]++
	}
	// Each panel's legend names every region, the total and the limit.
	for _, name := range []string{"us-east", "eu-west", "ap-south", ChartTotal, ChartLimit} {
		if count[name] != 2 {
			t.Errorf("legend entry %q appears %d times, want 2 (one per panel); texts: %q", name, count[name], texts)
		}
	}
	// The titles: the run's rule and numbers, then the regions and the
	// gossip interval over both panels.
	for _, want := range []string{
		"global-demo (reconciled): 110 admitted, limit 110.0",
		"global-demo-unreconciled (not reconciled): 330 admitted, limit 110.0",
		"capacity 100 + refill 1/s × T 10.0s",
		"make demo: one key, 20 checks/s to each of us-east, eu-west, ap-south, gossip interval 1s",
		"time since the run started (s)",
		"tokens admitted so far",
	} {
		if !strings.Contains(strings.Join(texts, "\n"), want) {
			t.Errorf("chart has no text %q; texts: %q", want, texts)
		}
	}
	// The limit line, dashed, in each panel (and its legend sample).
	if dashed < 2 {
		t.Errorf("%d dashed paths, want the limit line in both panels", dashed)
	}
}

func TestWriteChartNoRuns(t *testing.T) {
	if err := (&Report{}).WriteChart(io.Discard); !errors.Is(err, ErrNoRuns) {
		t.Errorf("WriteChart of no runs = %v, want ErrNoRuns", err)
	}
}

// TestRunWritesChart runs the demo against fakes: the chart it writes has
// the numbers the printed report has, from the same measurement.
func TestRunWritesChart(t *testing.T) {
	opts := testOptions(t, serve(t, &fakeLimiter{admit: 15}), serve(t, &fakeLimiter{admit: 10}), serve(t, &fakeLimiter{admit: 5}))
	opts.ChartFile = filepath.Join(t.TempDir(), "out", "demo.svg")
	var out strings.Builder
	if err := Run(context.Background(), opts, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(out.String(), "\nchart: "+opts.ChartFile+"\n") {
		t.Errorf("report does not end with the chart's path:\n%s", out.String())
	}
	svg, err := os.ReadFile(opts.ChartFile)
	if err != nil {
		t.Fatal(err)
	}
	texts, _ := svgTexts(t, svg)
	all := strings.Join(texts, "\n")
	for _, rule := range []string{"shared (reconciled): 30 admitted", "solo (not reconciled): 30 admitted"} {
		if !strings.Contains(all, rule) {
			t.Errorf("chart has no %q; texts: %q", rule, texts)
		}
	}
	if !strings.Contains(out.String(), "total       30\n") {
		t.Errorf("report:\n%s", out.String())
	}
}
