package limiterd

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/limiterd/limiterd/pkg/bucket"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// TestEmbeddedStoreBounded: a flood of distinct keys on an hour's sliding
// log (1.12M keys once took the embedded store from 21 to 428 MB, held
// for the hour) stays within --memory.max-bytes, exported as
// limiter_memory_bytes{store="embedded"}, and the limit still holds for
// a key checked after the flood.
func TestEmbeddedStoreBounded(t *testing.T) {
	d := startDaemon(t, nil, func(o *Options) { o.Memory.MaxBytes = bucket.MinMaxBytes })
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	ctx := context.Background()
	for i := range 12_000 {
		resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "log", Key: fmt.Sprint("flood:", i)})
		if err != nil || !resp.GetAllowed() {
			t.Fatalf("flood key %d: %v, %v; want allowed", i, resp, err)
		}
	}
	values := map[string]float64{}
	for _, mf := range mustGather(t, d) {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "store" && l.GetValue() == "embedded" {
					values[mf.GetName()] = m.GetGauge().GetValue() + m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Logf("embedded store after 12,000 keys: %v", values)
	if values["limiter_memory_max_bytes"] != bucket.MinMaxBytes {
		t.Fatalf("limiter_memory_max_bytes{store=embedded} = %v, want %d", values["limiter_memory_max_bytes"], bucket.MinMaxBytes)
	}
	if b := values["limiter_memory_bytes"]; b == 0 || b > bucket.MinMaxBytes {
		t.Fatalf("limiter_memory_bytes{store=embedded} = %v, want in (0, %d]", b, bucket.MinMaxBytes)
	}
	if values["limiter_memory_evictions_total"] == 0 {
		t.Fatal("no eviction exported after 12,000 keys in 1 MiB")
	}
	for i := range 4 {
		resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "log", Key: "user:after"})
		if err != nil || resp.GetAllowed() != (i < 3) {
			t.Fatalf("check %d of a key after the flood: %v, %v; want the 4th refused", i, resp, err)
		}
	}
}

// TestMemoryFlags: the memory bounds are validated, naming the flag.
func TestMemoryFlags(t *testing.T) {
	for _, c := range []struct {
		mutate func(*Options)
		want   string
	}{
		{func(o *Options) { o.Memory.MaxBytes = 1000 }, "--memory.max-bytes: must be 1048576 to"},
		{func(o *Options) { o.Memory.FallbackMaxBytes = -1 }, "--fallback.max-bytes: must be 1048576 to"},
		{func(o *Options) { o.Memory.MaxLeaseKeys = -5 }, "--lease.max-keys: must be 1 to"},
	} {
		o := DefaultOptions()
		o.Rules.File, o.Logger = "testdata/rules.yml", quietLogger()
		c.mutate(&o)
		_, err := New(o)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("err = %v, want %q", err, c.want)
		}
	}
}
