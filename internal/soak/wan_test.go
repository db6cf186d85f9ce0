package soak

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/wanproxy"
)

// defaultWAN is the one-way delay of each pair of regions: the reference
// deployment's distances, as `make up` has them.
const defaultWAN = "us-east/eu-west=40ms,us-east/ap-south=110ms,eu-west/ap-south=75ms"

// wan is the one-way delay between each two regions, by the pair sorted.
type wan map[[2]string]time.Duration

func pairOf(a, b string) [2]string {
	if a > b {
		a, b = b, a
	}
	return [2]string{a, b}
}

// parseWAN reads -soak.wan: "0" (none), one duration for every pair, or
// a/b=duration pairs separated by commas (pairs left out: none).
func parseWAN(spec string) (wan, error) {
	w := wan{}
	spec = strings.TrimSpace(spec)
	if spec == "" || spec == "0" {
		return w, nil
	}
	if d, err := time.ParseDuration(spec); err == nil {
		if d < 0 || d > 2*time.Second {
			return nil, fmt.Errorf("-soak.wan: %v: a delay is 0 to 2s", d)
		}
		for i, a := range regions {
			for _, b := range regions[i+1:] {
				w[pairOf(a, b)] = d
			}
		}
		return w, nil
	}
	for part := range strings.SplitSeq(spec, ",") {
		pair, delay, ok := strings.Cut(strings.TrimSpace(part), "=")
		a, b, ok2 := strings.Cut(pair, "/")
		if !ok || !ok2 {
			return nil, fmt.Errorf("-soak.wan: %q: want a/b=duration", part)
		}
		if !slices.Contains(regions, a) || !slices.Contains(regions, b) || a == b {
			return nil, fmt.Errorf("-soak.wan: %q: regions are two of %v", part, regions)
		}
		d, err := time.ParseDuration(delay)
		if err != nil || d < 0 || d > 2*time.Second {
			return nil, fmt.Errorf("-soak.wan: %q: a delay is 0 to 2s", part)
		}
		w[pairOf(a, b)] = d
	}
	return w, nil
}

// delay is the one-way delay between a and b.
func (w wan) delay(a, b string) time.Duration { return w[pairOf(a, b)] }

// longest is the longest one-way delay of any pair.
func (w wan) longest() time.Duration {
	var m time.Duration
	for _, d := range w {
		m = max(m, d)
	}
	return m
}

func (w wan) String() string {
	if len(w) == 0 {
		return "none"
	}
	var parts []string
	for i, a := range regions {
		for _, b := range regions[i+1:] {
			parts = append(parts, fmt.Sprintf("%s/%s %v", a, b, w.delay(a, b)))
		}
	}
	return strings.Join(parts, ", ")
}

// gatewayLinks are the two links that carry the gateway connections
// between a and b (each region's servers dial the other's).
func (s *stack) gatewayLinks(a, b string) [2]*wanproxy.Link {
	return [2]*wanproxy.Link{s.super.Link(a, b), s.super.Link(b, a)}
}

// shapeGateways changes the shape of both directions of the gateways
// between a and b.
func (s *stack) shapeGateways(a, b string, change func(*wanproxy.Shape)) {
	for _, l := range s.gatewayLinks(a, b) {
		for _, d := range []wanproxy.Direction{wanproxy.ClientToTarget, wanproxy.TargetToClient} {
			sh := l.Shape(d)
			change(&sh)
			l.SetShape(d, sh)
		}
	}
}

// cutOneWay stops what from sends to to on their gateways (heal: lets it
// through again); what to sends to from still flows.
func (s *stack) cutOneWay(from, to string, heal bool) {
	out, in := s.super.Link(from, to), s.super.Link(to, from)
	if heal {
		out.Heal(wanproxy.ClientToTarget)
		in.Heal(wanproxy.TargetToClient)
		return
	}
	out.Cut(wanproxy.ClientToTarget)
	in.Cut(wanproxy.TargetToClient)
}

// TestParseWAN: -soak.wan takes pairs, one delay for all, or none, and
// refuses what it cannot read, naming the flag.
func TestParseWAN(t *testing.T) {
	w, err := parseWAN(defaultWAN)
	if err != nil {
		t.Fatal(err)
	}
	if w.delay("eu-west", "us-east") != 40*time.Millisecond || w.delay("ap-south", "us-east") != 110*time.Millisecond || w.longest() != 110*time.Millisecond {
		t.Fatalf("default: %v", w)
	}
	if w, err := parseWAN("25ms"); err != nil || len(w) != 3 || w.delay("eu-west", "ap-south") != 25*time.Millisecond {
		t.Fatalf("one delay: %v, %v", w, err)
	}
	if w, err := parseWAN("0"); err != nil || len(w) != 0 || w.longest() != 0 {
		t.Fatalf("none: %v, %v", w, err)
	}
	for _, bad := range []string{"us-east=40ms", "us-east/mars=1ms", "us-east/us-east=1ms", "us-east/eu-west=soon", "us-east/eu-west=-1ms", "3s"} {
		if _, err := parseWAN(bad); err == nil || !strings.Contains(err.Error(), "-soak.wan") {
			t.Errorf("parseWAN(%q) = %v, want an error naming -soak.wan", bad, err)
		}
	}
}
