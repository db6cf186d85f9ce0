package limiterd

import (
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
)

func mustGather(t *testing.T, d *Daemon) []*dto.MetricFamily {
	t.Helper()
	mfs, err := d.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	return mfs
}

// containsNonZero reports whether the exposition has the series prefix
// with a value other than 0.
func containsNonZero(body, series string) bool {
	for _, line := range strings.Split(body, "\n") {
		if strings.HasPrefix(line, series) {
			f := strings.Fields(line)
			return len(f) == 2 && f[1] != "0"
		}
	}
	return false
}
