package rules

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestClasses(t *testing.T) {
	c, err := ParseClasses("critical, default,sheddable")
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]int{"critical": 0, "default": 1, "sheddable": 2, "": 1, "unknown": 1} {
		if got := c.Index(name); got != want {
			t.Errorf("Index(%q) = %d, want %d", name, got, want)
		}
	}
	r, err := ParseRule([]byte("id: r\ncapacity: 100\nrefill_per_second: 1\nreserve: {critical: 0.2, default: 0.05}\n"), SourceFile)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := c.Keeps(r), []float64{0, 0.2, 0.25}; !slices.Equal(got, want) {
		t.Fatalf("Keeps = %v, want %v", got, want)
	}
	if err := c.CheckRule(r); err != nil {
		t.Fatal(err)
	}
	two, _ := NewClasses([]string{"gold", "default"})
	var e *Error
	if err := two.CheckRule(r); !errors.As(err, &e) || e.Field != "reserve.critical" {
		t.Fatalf("CheckRule with no class critical = %v, want an *Error naming reserve.critical", err)
	}
	if got := two.Keeps(r); !slices.Equal(got, []float64{0, 0}) {
		t.Fatalf("Keeps of classes the reserve does not name but default: %v", got)
	}
	for _, bad := range []string{"", "critical,sheddable", "default,default", "default,Gold", "default," + strings.Repeat("x", MaxClassLen+1),
		strings.Repeat("a,", MaxClasses) + "default"} {
		if _, err := ParseClasses(bad); err == nil {
			t.Errorf("ParseClasses(%q) = nil error", bad)
		}
	}
}

// A concurrency rule keeps a reserve of its limit, fixed or adaptive, as a
// token bucket keeps one of its capacity.
func TestConcurrencyReserve(t *testing.T) {
	c := DefaultClassList()
	for _, y := range []string{
		"id: r\nalgorithm: concurrency\nlimit: 20\nreserve: {critical: 0.2, default: 0.05}\n",
		"id: r\nalgorithm: concurrency\nlimit: 20\nkey_by: global\nadaptive: {min: 2, max: 200, target_latency: 40ms}\nreserve: {critical: 0.2, default: 0.05}\n",
	} {
		r, err := ParseRule([]byte(y), SourceFile)
		if err != nil {
			t.Fatalf("%s: %v", y, err)
		}
		if got, want := c.Keeps(r), []float64{0, 0.2, 0.25}; !slices.Equal(got, want) {
			t.Fatalf("Keeps = %v, want %v", got, want)
		}
		if err := c.CheckRule(r); err != nil {
			t.Fatal(err)
		}
	}
}
