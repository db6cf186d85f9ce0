package engine

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestFailurePolicy holds onFailure, the one place the failure policy is
// written, to its rules, one row each, in their order: the first rule
// that applies decides.
func TestFailurePolicy(t *testing.T) {
	set, err := rules.Parse("rules.yml", []byte(`rules:
  - id: open
    capacity: 10
    refill_per_second: 1
  - id: closed
    capacity: 10
    refill_per_second: 1
    on_failure: closed
`))
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Store: bucket.NewMemory(), Region: "local", Logger: quietLogger()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	item := func(rule string) *request.Item {
		c := e.NewCheck()
		it, err := c.AddRule(rule, "k", 1)
		if err != nil {
			t.Fatal(err)
		}
		return it
	}
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	down := errors.New("connection refused")
	unknown := fmt.Errorf("%w: no reply", bucket.ErrOutcomeUnknown)
	busy := fmt.Errorf("%w: queue", bucket.ErrOverloaded)
	tests := []struct {
		name    string
		ctx     context.Context
		rule    string
		lease   bool
		paced   bool
		err     error
		want    verdict
		wantErr error
	}{
		{"1. the caller gone, even for a fail-closed rule", gone, "closed", false, false, down, refused, context.Canceled},
		{"2. limiterd overloaded, even for a fail-closed rule", context.Background(), "closed", false, false, busy, refused, ErrOverloaded},
		{"3. a fail-closed rule", context.Background(), "closed", false, false, down, refused, ErrUnavailable},
		{"3. a fail-closed rule whose outcome is unknown", context.Background(), "closed", false, false, unknown, refused, ErrUnavailable},
		{"4. an unpaced check's unknown outcome", context.Background(), "open", false, false, unknown, uncertain, nil},
		{"5. a paced check's unknown outcome", context.Background(), "open", false, true, unknown, fallBack, nil},
		{"5. leases whose outcome is unknown", context.Background(), "open", true, false, unknown, fallBack, nil},
		{"5. a fail-open rule, not sent", context.Background(), "open", false, false, down, fallBack, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			it := item(tt.rule)
			failed := testutil.ToFloat64(it.Entry.Failed)
			v, err := e.onFailure(tt.ctx, failure{items: []*request.Item{it}, where: "store", lease: tt.lease, paced: tt.paced}, tt.err)
			if v != tt.want || !errors.Is(err, tt.wantErr) || (tt.wantErr == nil) != (err == nil) {
				t.Fatalf("onFailure = %v, %v; want %v, %v", v, err, tt.want, tt.wantErr)
			}
			counted := testutil.ToFloat64(it.Entry.Failed) - failed
			if wantCounted := v == refused && !errors.Is(err, ErrOverloaded); counted != map[bool]float64{true: 1}[wantCounted] {
				t.Fatalf("counted failed %v times", counted)
			}
		})
	}
}
