package rules

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// Every bad override names the rule, the override's key and its field.
func TestOverrideErrors(t *testing.T) {
	tests := []struct {
		name  string
		file  string
		id    string
		field string
		line  int
		cause error
	}{
		{name: "zero capacity", file: "override-zero-capacity.bad.yml", id: "api", field: `overrides["tenant-acme"].capacity`, line: 7, cause: bucket.ErrInvalidLimit},
		{name: "unknown field", file: "override-unknown-field.bad.yml", id: "api", field: `overrides["tenant-acme"].burst`, line: 8},
		{name: "window of a token bucket", file: "override-window-on-bucket.bad.yml", id: "api", field: `overrides["tenant-acme"].window`, line: 7},
		{name: "refill of a window", file: "override-refill-on-window.bad.yml", id: "daily", field: `overrides["tenant-acme"].refill_per_second`, line: 8},
		{name: "no field", file: "override-empty.bad.yml", id: "api", field: `overrides["tenant-acme"]`, line: 6},
		{name: "concurrency limit not whole", file: "override-concurrency.bad.yml", id: "reports", field: `overrides["tenant-acme"].limit`, line: 6},
		{name: "concurrency refill", file: "override-concurrency-refill.bad.yml", id: "reports", field: `overrides["tenant-acme"].refill_per_second`, line: 6},
		{name: "below the rule's cost", file: "override-below-cost.bad.yml", id: "api", field: `overrides["tenant-acme"].capacity`, line: 8, cause: bucket.ErrInvalidCost},
		{name: "not a mapping", file: "override-not-mapping.bad.yml", id: "api", field: `overrides["tenant-acme"]`, line: 6},
		{name: "request limit without max", file: "request-limit-no-max.bad.yml", id: "edge", field: "request_limit_max", line: 2},
		{name: "request limit of a pinned rule", file: "request-limit-pinned.bad.yml", id: "edge", field: "allow_request_limit", line: 6},
		{name: "request_limit_max alone", file: "request-limit-max-alone.bad.yml", id: "edge", field: "request_limit_max", line: 5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			file := filepath.Join("testdata", tt.file)
			_, err := Load(file)
			var e *Error
			if !errors.As(err, &e) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("Load = %v, want an *Error", err)
			}
			got := Error{File: e.File, Index: e.Index, ID: e.ID, Field: e.Field, Line: e.Line}
			want := Error{File: file, Index: 0, ID: tt.id, Field: tt.field, Line: tt.line}
			if got != want {
				t.Fatalf("Load = %v\n  at  %+v\n  want %+v", err, got, want)
			}
			if tt.cause != nil && !errors.Is(err, tt.cause) {
				t.Fatalf("Load = %v, want it to wrap %v", err, tt.cause)
			}
		})
	}
}

func TestOverrideLimits(t *testing.T) {
	s, err := Load("testdata/overrides.good.yml")
	if err != nil {
		t.Fatal(err)
	}
	api, daily, reports := s.Get("api"), s.Get("daily"), s.Get("reports")
	tests := []struct {
		name string
		rule *Rule
		key  string
		want bucket.Limit
	}{
		{name: "both fields", rule: api, key: "tenant-acme", want: bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 5000, RefillPerSecond: 100}},
		{name: "capacity only", rule: api, key: "tenant-small", want: bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 10, RefillPerSecond: 10}},
		{name: "another key", rule: api, key: "tenant-other", want: bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 100, RefillPerSecond: 10}},
		{name: "window limit", rule: daily, key: "tenant-acme", want: bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 100000, Window: 24 * time.Hour}},
		{name: "window and limit", rule: daily, key: "tenant-hourly", want: bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 50, Window: time.Hour}},
		{name: "window rule's", rule: daily, key: "x", want: bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 1000, Window: 24 * time.Hour}},
		{name: "concurrency", rule: reports, key: "tenant-acme", want: bucket.Limit{Algorithm: bucket.Concurrency, Capacity: 20}},
		{name: "concurrency rule's", rule: reports, key: "x", want: bucket.Limit{Algorithm: bucket.Concurrency, Capacity: 10}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.rule.BucketFor(tt.key); got != tt.want {
				t.Fatalf("BucketFor(%q) = %+v, want %+v", tt.key, got, tt.want)
			}
			if tt.rule.Concurrent() {
				want := bucket.LeaseLimit{Limit: int(tt.want.Capacity), TTL: DefaultLeaseTTL}
				if got := tt.rule.LeasesFor(tt.key); got != want {
					t.Fatalf("LeasesFor(%q) = %+v, want %+v", tt.key, got, want)
				}
			}
		})
	}
}

// ruleWithOverrides is a rule with n overrides, as YAML.
func ruleWithOverrides(n int) string {
	var b strings.Builder
	b.WriteString("id: api\ncapacity: 100\nrefill_per_second: 10\noverrides:\n")
	for i := range n {
		fmt.Fprintf(&b, "  tenant-%d: {capacity: %d}\n", i, i+1)
	}
	return b.String()
}

// MaxOverrides holds in a file, a rule put alone and an override put one
// at a time.
func TestOverridesBound(t *testing.T) {
	for _, tt := range []struct {
		name string
		n    int
		ok   bool
	}{
		{name: "at the bound", n: MaxOverrides, ok: true},
		{name: "one above", n: MaxOverrides + 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rule := ruleWithOverrides(tt.n)
			file := "rules:\n  - " + strings.ReplaceAll(strings.TrimSuffix(rule, "\n"), "\n", "\n    ") + "\n"
			_, ferr := Parse("rules.yml", []byte(file))
			r, rerr := ParseRule([]byte(rule), SourceAdmin)
			for _, err := range []error{ferr, rerr} {
				if tt.ok {
					if err != nil {
						t.Fatalf("%d overrides: %v", tt.n, err)
					}
					continue
				}
				var e *Error
				if !errors.Is(err, ErrTooManyOverrides) || !errors.As(err, &e) || e.Field != "overrides" || e.ID != "api" {
					t.Fatalf("%d overrides: %v, want an *Error of field overrides wrapping ErrTooManyOverrides", tt.n, err)
				}
			}
			if tt.ok && len(r.OverrideLimits()) != tt.n {
				t.Fatalf("%d override limits, want %d", len(r.OverrideLimits()), tt.n)
			}
		})
	}
}

func TestWithOverride(t *testing.T) {
	r, err := ParseRule([]byte(ruleWithOverrides(MaxOverrides)), SourceAdmin)
	if err != nil {
		t.Fatal(err)
	}
	five := 5.0
	// A new key past the bound is refused; r is unchanged.
	if _, err := r.WithOverride("new", &Override{Capacity: &five}); !errors.Is(err, ErrTooManyOverrides) {
		t.Fatalf("WithOverride past the bound = %v, want ErrTooManyOverrides", err)
	}
	// An existing key changes at the bound.
	c, err := r.WithOverride("tenant-0", &Override{Capacity: &five})
	if err != nil {
		t.Fatal(err)
	}
	if got := c.BucketFor("tenant-0").Capacity; got != 5 {
		t.Fatalf("changed override's capacity %v, want 5", got)
	}
	if got := r.BucketFor("tenant-0").Capacity; got != 1 {
		t.Fatalf("the original rule changed: capacity %v, want 1", got)
	}
	// A bad field is refused, naming it.
	zero := 0.0
	_, err = r.WithOverride("tenant-0", &Override{Capacity: &zero})
	var e *Error
	if !errors.As(err, &e) || e.Field != `overrides["tenant-0"].capacity` || !errors.Is(err, bucket.ErrInvalidLimit) {
		t.Fatalf("WithOverride(capacity 0) = %v, want an *Error naming the capacity", err)
	}
	// Deleting one makes room; its YAML parses back to the same limits.
	d, err := c.WithOverride("tenant-1", nil)
	if err != nil {
		t.Fatal(err)
	}
	back, err := ParseRule(d.YAML(), SourceAdmin)
	if err != nil {
		t.Fatal(err)
	}
	if len(back.OverrideLimits()) != MaxOverrides-1 || back.BucketFor("tenant-1").Capacity != 100 || back.BucketFor("tenant-0").Capacity != 5 {
		t.Fatalf("parsed back: %d overrides, tenant-1 %v, tenant-0 %v", len(back.OverrideLimits()), back.BucketFor("tenant-1"), back.BucketFor("tenant-0"))
	}
}

func TestRequestLimit(t *testing.T) {
	s, err := Load("testdata/request-limit.good.yml")
	if err != nil {
		t.Fatal(err)
	}
	edge := s.Get("edge")
	plain, err := ParseRule([]byte("id: p\ncapacity: 100\nrefill_per_second: 10\n"), SourceAdmin)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		rule     *Rule
		requests float64
		unit     time.Duration
		want     bucket.Limit
		err      error
	}{
		{name: "under the ceiling", rule: edge, requests: 600, unit: time.Minute, want: bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 600, RefillPerSecond: 10}},
		{name: "at the ceiling", rule: edge, requests: 50, unit: time.Second, want: bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 50, RefillPerSecond: 50}},
		{name: "above the ceiling", rule: edge, requests: 51, unit: time.Second, err: ErrRequestLimitAboveMax},
		{name: "not allowed", rule: plain, requests: 1, unit: time.Second, err: ErrRequestLimitNotAllowed},
		{name: "zero", rule: edge, requests: 0, unit: time.Second, err: bucket.ErrInvalidLimit},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.rule.RequestLimit(tt.requests, tt.unit)
			if !errors.Is(err, tt.err) || (tt.err == nil && err != nil) || got != tt.want {
				t.Fatalf("RequestLimit(%v, %v) = %+v, %v; want %+v, %v", tt.requests, tt.unit, got, err, tt.want, tt.err)
			}
		})
	}
}

// FuzzOverride: any override body of any key is either refused with an
// *Error naming the override (and the field, when one is at fault), or
// makes a rule whose YAML parses back to the same limits.
//
//	go test -run '^$' -fuzz FuzzOverride -fuzztime 30s ./internal/rules
func FuzzOverride(f *testing.F) {
	bucketRule, err := ParseRule([]byte("id: b\ncapacity: 10\nrefill_per_second: 1\ncost: 2\n"), SourceAdmin)
	if err != nil {
		f.Fatal(err)
	}
	windowRule, err := ParseRule([]byte("id: w\nalgorithm: sliding_log\nlimit: 10\nwindow: 1m\n"), SourceAdmin)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(false, "acme", []byte(`{"capacity": 50, "refill_per_second": 5}`))
	f.Add(true, "acme", []byte(`{"limit": 5, "window": "1h"}`))
	f.Add(false, "acme", []byte(`{"capacity": 1}`))
	f.Add(false, "", []byte(`{"capacity": 5}`))
	f.Add(true, "x", []byte("limit: 5.5\n"))
	f.Add(false, "x", []byte("capacity: &a 5\nlimit: *a\n"))
	f.Add(false, "x", []byte("{burst: 3}"))
	f.Fuzz(func(t *testing.T, window bool, key string, body []byte) {
		r := bucketRule
		if window {
			r = windowRule
		}
		prefix := OverrideField(key, "")
		o, err := ParseOverride(key, body)
		var c *Rule
		if err == nil {
			c, err = r.WithOverride(key, o)
		}
		if err != nil {
			var e *Error
			if !errors.As(err, &e) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("error not a *rules.Error: %v", err)
			}
			if !strings.HasPrefix(e.Field, prefix) {
				t.Fatalf("error of field %q, want one of %s: %v", e.Field, prefix, err)
			}
			return
		}
		again, err := ParseRule(c.YAML(), SourceAdmin)
		if err != nil {
			t.Fatalf("the YAML of a valid override does not parse: %v\n%s", err, c.YAML())
		}
		if again.BucketFor(key) != c.BucketFor(key) || len(again.OverrideLimits()) != 1 {
			t.Fatalf("round trip changed the override: %+v, want %+v", again.BucketFor(key), c.BucketFor(key))
		}
	})
}

// Of several bad overrides, the first by key is reported, every time.
func TestOverrideErrorsInKeyOrder(t *testing.T) {
	rule := "id: r\ncapacity: 10\nrefill_per_second: 1\noverrides:\n  z: {capacity: 0}\n  m: {capacity: -1}\n  b: {capacity: 0}\n  q: {capacity: 0}\n"
	for range 20 {
		_, err := ParseRule([]byte(rule), SourceAdmin)
		var e *Error
		if !errors.As(err, &e) || e.Field != `overrides["b"].capacity` || e.Line != 7 {
			t.Fatalf("ParseRule = %v, want the error of b's capacity at line 7", err)
		}
	}
}
