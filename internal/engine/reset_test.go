package engine

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

const resetRules = `
rules:
  - id: open
    capacity: 2
    refill_per_second: 0.000001
  - id: quiet
    capacity: 2
    refill_per_second: 0.000001
    reconcile: false
  - id: pinned
    capacity: 2
    refill_per_second: 0.000001
    home: pinned
    home_keys: {far: eu-west, near: us-east}
  - id: held
    algorithm: concurrency
    limit: 1
    lease_ttl: 1s
`

type resetLog []string

func (r *resetLog) Reset(rule, key string, _ int64) { *r = append(*r, rule+"/"+key) }

// TestResetKey: a reset puts the key back to full at once, past this
// instance's deny cache, and records it for the other regions when the
// rule is reconciled; a pinned key is reset at its home only, and an
// unknown rule, a concurrency rule and a bad key are refused, changing
// nothing.
func TestResetKey(t *testing.T) {
	var log resetLog
	r := twoRegionsWith(t, resetRules, newFaultStore(), func(o *Options) { o.Resets = &log })
	ctx := context.Background()
	exhaust := func(rule, key string) {
		t.Helper()
		for range 2 {
			if ok, err := decideRules(ctx, t, r.east, key, rule); !ok || err != nil {
				t.Fatalf("check %s/%s = %v, %v", rule, key, ok, err)
			}
		}
		if ok, _ := decideRules(ctx, t, r.east, key, rule); ok {
			t.Fatalf("check %s/%s past its capacity admitted", rule, key)
		}
	}
	for _, tc := range []struct {
		rule, key  string
		propagated bool
	}{
		{"open", "k", true},
		{"quiet", "k", false},
		{"pinned", "near", false},
	} {
		exhaust(tc.rule, tc.key)
		if r.east.deny.Len() == 0 {
			t.Fatalf("%s: no denial remembered", tc.rule)
		}
		prop, err := r.east.ResetKey(ctx, tc.rule, tc.key)
		if err != nil || prop != tc.propagated {
			t.Fatalf("ResetKey(%s, %s) = %v, %v; want %v, nil", tc.rule, tc.key, prop, err, tc.propagated)
		}
		if _, _, denied, _ := r.east.deny.Get(tc.rule, tc.key, 1); denied {
			t.Fatalf("%s: the denial outlived the reset", tc.rule)
		}
		exhaust(tc.rule, tc.key)
	}
	if want := []string{"open/k"}; !slices.Equal(log, want) {
		t.Fatalf("resets recorded %v, want %v", log, want)
	}

	for _, tc := range []struct {
		name, rule, key string
		field           string
		is              error
	}{
		{"unknown rule", "nope", "k", "rule_id", request.ErrUnknownRule},
		{"concurrency rule", "held", "k", "rule_id", request.ErrConcurrencyRule},
		{"empty key", "open", "", "key", bucket.ErrInvalidKey},
		{"long key", "open", string(make([]byte, bucket.MaxKeyLen+1)), "key", bucket.ErrInvalidKey},
		{"pinned elsewhere", "pinned", "far", "", ErrNotHome},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := r.east.ResetKey(ctx, tc.rule, tc.key)
			if !errors.Is(err, tc.is) {
				t.Fatalf("ResetKey = %v, want %v", err, tc.is)
			}
			var inv *request.InvalidError
			if tc.field != "" && (!errors.As(err, &inv) || inv.Field != tc.field) {
				t.Fatalf("ResetKey = %v, want an invalid %s", err, tc.field)
			}
		})
	}
	if ok, _ := decideRules(ctx, t, r.east, "k", "open"); ok {
		t.Fatal("a refused reset admitted a check")
	}
	if want := []string{"open/k"}; !slices.Equal(log, want) {
		t.Fatalf("resets recorded %v, want %v", log, want)
	}
}
