package engine

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// seriesOf counts the series, over every family, whose rule label is rule.
func seriesOf(t *testing.T, reg *prometheus.Registry, rule string) int {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if hasLabel(m, "rule", rule) {
				n++
			}
		}
	}
	return n
}

func hasLabel(m *dto.Metric, name, value string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == name && l.GetValue() == value {
			return true
		}
	}
	return false
}

// TestDeletedRuleLeavesNoSeries: the metric series of a rule taken out of
// force go with it (807 series for 7 rules in force, before).
func TestDeletedRuleLeavesNoSeries(t *testing.T) {
	parse := func(yml string) *rules.Set {
		set, err := rules.Parse("r.yml", []byte(yml))
		if err != nil {
			t.Fatal(err)
		}
		return set
	}
	reg := prometheus.NewRegistry()
	e, err := New(Options{Store: bucket.NewMemory()}, parse("rules:\n  - id: kept\n    capacity: 1\n    refill_per_second: 1\n  - id: gone\n    capacity: 1\n    refill_per_second: 1\n"), reg)
	if err != nil {
		t.Fatal(err)
	}
	if seriesOf(t, reg, "gone") == 0 {
		t.Fatal("rule gone has no series while in force")
	}
	if err := e.SetRules(parse("rules:\n  - id: kept\n    capacity: 1\n    refill_per_second: 1\n")); err != nil {
		t.Fatal(err)
	}
	if n := seriesOf(t, reg, "gone"); n != 0 {
		t.Fatalf("rule gone left %d series after it was taken out of force", n)
	}
	if seriesOf(t, reg, "kept") == 0 {
		t.Fatal("rule kept lost its series")
	}
}
