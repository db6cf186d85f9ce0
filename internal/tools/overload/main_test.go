package main

import (
	"bytes"
	"context"
	"encoding/xml"
	"strings"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/rules"
)

// TestRunSmoke runs every configuration for a moment at a low rate and
// checks the report: a row for every configuration, load and class, each
// class served, and a table and chart that name them. It asserts no
// figure of the overload itself: those are `make overload`'s.
func TestRunSmoke(t *testing.T) {
	o := DefaultOptions()
	o.Rate, o.Warmup, o.Duration = 40, 200*time.Millisecond, 700*time.Millisecond
	rep, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Rows) != len(Configs)*len(o.Loads)*len(Classes) {
		t.Fatalf("%d rows, want %d", len(rep.Rows), len(Configs)*len(o.Loads)*len(Classes))
	}
	for _, cfg := range Configs {
		for _, load := range o.Loads {
			for _, class := range Classes {
				r, err := rep.Find(cfg, load, class)
				if err != nil {
					t.Fatal(err)
				}
				if r.Offered <= 0 || r.Goodput <= 0 || r.P99 <= 0 {
					t.Errorf("%s at %gx, %s: nothing served: %+v", cfg, load, class, r)
				}
			}
		}
	}
	var md, svg bytes.Buffer
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteSVG(&svg); err != nil {
		t.Fatal(err)
	}
	for _, s := range append(append([]string{}, Configs...), Classes...) {
		if !strings.Contains(md.String(), "| "+s+" |") || !strings.Contains(svg.String(), ">"+s+"<") {
			t.Errorf("%q missing from the table or the chart", s)
		}
	}
	if err := xml.Unmarshal(svg.Bytes(), new(struct{})); err != nil {
		t.Fatalf("the chart is not well-formed XML: %v", err)
	}
}

func TestPick(t *testing.T) {
	for u, want := range map[float64]int{0: 0, 0.19: 0, 0.2: 1, 0.69: 1, 0.71: 2, 0.999: 2} {
		if got := pick(u); got != want {
			t.Errorf("pick(%v) = %d, want %d", u, got, want)
		}
	}
}

// TestRulesOf: every configuration's rules load; adaptive+reserve is the
// adaptive rule with the reserve rule's fractions, and goes through
// Concurrency (its Acquire carries the class).
func TestRulesOf(t *testing.T) {
	for _, cfg := range Configs {
		if _, err := rules.Parse(cfg+".yml", []byte(rulesOf(cfg))); err != nil {
			t.Fatalf("%s: %v", cfg, err)
		}
	}
	set, err := rules.Parse("ar.yml", []byte(rulesOf("adaptive+reserve")))
	if err != nil {
		t.Fatal(err)
	}
	r := set.Get("inflight")
	if r == nil || !r.Concurrent() || r.Adaptive == nil || r.Reserve["critical"] != 0.2 || r.Reserve["default"] != 0.05 {
		t.Fatalf("adaptive+reserve's rule: %+v", r)
	}
	if !leased("adaptive+reserve") || !leased("adaptive") || leased("reserve") || leased("none") {
		t.Fatal("only the adaptive configurations acquire")
	}
}

func TestParseConfigs(t *testing.T) {
	if got, err := parseConfigs("adaptive+reserve, none"); err != nil || strings.Join(got, ",") != "adaptive+reserve,none" {
		t.Fatalf("parseConfigs = %v, %v", got, err)
	}
	if got, err := parseConfigs(""); err != nil || len(got) != len(Configs) {
		t.Fatalf("parseConfigs of none = %v, %v; want every configuration", got, err)
	}
	if _, err := parseConfigs("adaptive,bogus"); err == nil {
		t.Fatal("an unknown configuration parsed")
	}
}
