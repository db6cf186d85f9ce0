package testenv

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
)

// MetricValue is the value of the counter or gauge name in reg, summed over
// its series; t fails when reg has no metric of that name.
func MetricValue(t testing.TB, reg prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			v := 0.0
			for _, m := range mf.GetMetric() {
				v += m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
			return v
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// Histogram is the count and the sum of the observations of the histogram
// name in reg, over its series (0 and 0 when it has none).
func Histogram(t testing.TB, reg prometheus.Gatherer, name string) (count uint64, sum float64) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				count += m.GetHistogram().GetSampleCount()
				sum += m.GetHistogram().GetSampleSum()
			}
		}
	}
	return count, sum
}

// WaitFor polls cond until it holds, failing t after 20 s.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still not %s after 20 s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// SampleCount is the number of observations of the histogram name in reg.
func SampleCount(t testing.TB, reg prometheus.Gatherer, name string) uint64 {
	t.Helper()
	n, _ := Histogram(t, reg, name)
	return n
}

// SampleSum is the sum of the observations of the histogram name in reg.
func SampleSum(t testing.TB, reg prometheus.Gatherer, name string) float64 {
	t.Helper()
	_, sum := Histogram(t, reg, name)
	return sum
}

// Lint fails t for each problem promlint finds in mfs (Prometheus naming
// and help conventions).
func Lint(t testing.TB, mfs []*dto.MetricFamily) {
	t.Helper()
	problems, err := promlint.NewWithMetricFamilies(mfs).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("promlint: %s: %s", p.Metric, p.Text)
	}
}
