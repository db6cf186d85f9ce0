package limiterd

import (
	"context"
	"math"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// FuzzCheck: any request is either decided with sane numbers or refused
// with NotFound or InvalidArgument naming the field; it never panics and
// never spends on an invalid request.
func FuzzCheck(f *testing.F) {
	set, err := rules.Load("testdata/rules.yml")
	if err != nil {
		f.Fatal(err)
	}
	m, err := newMetrics(prometheus.NewRegistry())
	if err != nil {
		f.Fatal(err)
	}
	c := &checker{store: bucket.NewMemory(), fallback: bucket.NewMemory(), log: quietLogger(), m: m}
	c.rules.Store(newTable(set, 1, 1, m))
	f.Add("tb", "client", 1.0)
	f.Add("log", "k", 1.5)
	f.Add("tb", "", math.NaN())
	f.Add("nope", "k", math.Inf(1))
	f.Add("tb", "k", -0.0)
	f.Add("tb", "k", 1e-300)
	f.Fuzz(func(t *testing.T, rule, key string, cost float64) {
		d, e, err := c.check(context.Background(), rule, key, cost)
		if err != nil {
			code := status.Code(err)
			if code != codes.NotFound && code != codes.InvalidArgument {
				t.Fatalf("check(%q, %q, %v): code %v: %v", rule, key, cost, code, err)
			}
			return
		}
		if e == nil || e.rule.ID != rule {
			t.Fatalf("decided by rule %v, asked %q", e, rule)
		}
		if d.Remaining < 0 || math.IsNaN(d.Remaining) || d.Limit != e.limit.Capacity {
			t.Fatalf("decision %+v for limit %+v", d, e.limit)
		}
		if !d.Allowed && d.RetryAfter <= 0 {
			t.Fatalf("rejection without a retry time: %+v", d)
		}
	})
}
