package limiterd

import (
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
