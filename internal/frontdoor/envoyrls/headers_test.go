package envoyrls

import (
	"context"
	"maps"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/frontdoor/checkapi"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/httplimit"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// headerRules are rules of every algorithm and several windows, which one
// descriptor matches together (generic_key=all) or one at a time
// (generic_key=ID), so that checks refuse by one rule while others allow.
const headerRules = `rules:
  - id: tb
    capacity: 5
    refill_per_second: 0.3
    key_by: global
    match: {domain: edge, attributes: {generic_key: all}}
  - id: log.90s
    algorithm: sliding_log
    limit: 3
    window: 90s
    key_by: global
    match: {domain: edge, attributes: {generic_key: all}}
  - id: win_1m
    algorithm: sliding_window
    limit: 4
    window: 1m
    key_by: global
    match: {domain: edge, attributes: {generic_key: all}}
  - id: fixed-1h
    algorithm: fixed_window
    limit: 10
    window: 1h
    cost: 2
    key_by: global
    match: {domain: edge, attributes: {generic_key: all}}
  - id: gcra
    algorithm: gcra
    capacity: 2
    refill_per_second: 0.5
    key_by: attr:generic_key
    match: {domain: edge, attributes: {generic_key: gcra}}
  - id: watch
    capacity: 3
    refill_per_second: 0.001
    shadow: true
    key_by: global
    match: {domain: edge, attributes: {generic_key: all}}
`

// setHeadersEnvoy is how the quota headers were made before quotaHeaders:
// httplimit.SetHeaders into an http.Header, then names in lower case,
// sorted.
func setHeadersEnvoy(all []*request.Item, top *request.Item, allowed bool, now time.Time) []*corev3.HeaderValue {
	if top == nil {
		return nil
	}
	quota := checkapi.Response([]*request.Item{top}, nil, allowed, false)
	for _, it := range all {
		quota.Statuses = append(quota.Statuses, checkapi.RuleStatus(it))
	}
	h := make(http.Header)
	httplimit.SetHeaders(h, quota, now)
	var out []*corev3.HeaderValue
	for _, k := range slices.Sorted(maps.Keys(h)) {
		for _, v := range h[k] {
			out = append(out, &corev3.HeaderValue{Key: strings.ToLower(k), Value: v})
		}
	}
	return out
}

// TestQuotaHeadersAsSetHeaders: the headers Envoy gets are, byte for
// byte and in order, those httplimit.SetHeaders writes for the same
// decision, allowed or refused, by one rule or several.
func TestQuotaHeadersAsSetHeaders(t *testing.T) {
	set, err := rules.Parse("headers.yml", []byte(headerRules))
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(engine.Options{Store: bucket.NewMemory()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	nows := []time.Time{time.Unix(1_764_480_000, 0), time.Unix(1_764_480_000, 1), time.Unix(1_764_480_017, 999_999_999)}
	steps := []struct {
		key  string
		cost float64
	}{
		{"all", 1}, {"all", 1}, {"gcra", 1}, {"all", 1}, {"gcra", 1}, {"gcra", 1}, {"all", 1},
		{"all", 2}, {"nothing", 1}, {"all", 1}, {"gcra", 2}, {"all", 1},
	}
	refused, several := false, false
	for i, st := range steps {
		c := e.NewCheck()
		a := &rules.Attributes{Domain: "edge", Extra: map[string]string{"generic_key": st.key}}
		if _, _, err := c.AddAttributes(a, st.cost); err != nil {
			t.Fatal(err)
		}
		allowed, err := e.Decide(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		all := c.Enforced()
		refused = refused || !allowed
		several = several || len(all) > 1
		for _, now := range nows {
			got := quotaHeaders(all, request.MostRestrictive(all), allowed, now)
			want := setHeadersEnvoy(all, request.MostRestrictive(all), allowed, now)
			if len(got) != len(want) {
				t.Fatalf("step %d (%s, allowed %v): %d headers %v, SetHeaders writes %d: %v", i, st.key, allowed, len(got), got, len(want), want)
			}
			for j := range want {
				if got[j].GetKey() != want[j].GetKey() || got[j].GetValue() != want[j].GetValue() || got[j].GetRawValue() != nil {
					t.Fatalf("step %d (%s, allowed %v), header %d: %s: %q, SetHeaders writes %s: %q",
						i, st.key, allowed, j, got[j].GetKey(), got[j].GetValue(), want[j].GetKey(), want[j].GetValue())
				}
			}
		}
	}
	if !refused || !several {
		t.Fatalf("the steps made no refusal (%v) or no check of several rules (%v)", !refused, !several)
	}
	// Every header SetHeaders may write is one quotaHeaders knows.
	known := []string{hRateLimit, hLimit, hPolicy, hRemaining, hReset, hRetryAfter, hXLimit, hXRemaining, hXReset}
	if !slices.IsSorted(known) || len(known) != maxHeaders {
		t.Fatalf("header names %v: not sorted, or not %d", known, maxHeaders)
	}
	for _, name := range httplimit.HeaderNames {
		if !slices.Contains(known, strings.ToLower(name)) {
			t.Errorf("httplimit writes %s, which quotaHeaders does not", name)
		}
	}
}

// TestSFString: rule names are quoted as pkg/httplimit quotes them, also
// names no rules file accepts.
func TestSFString(t *testing.T) {
	for _, id := range []string{"api", `a"b\c`, "é-ü", "tab\there", "\xff\xfe", ""} {
		got := string(appendState(nil, id, 1, 2))
		h := make(http.Header)
		httplimit.SetHeaders(h, &limiterv1.CheckResponse{Allowed: true, Limit: 5, Remaining: 1, ResetAfterMs: 2000, RuleId: id}, time.Unix(0, 0))
		if want := h.Get(httplimit.HeaderRateLimit); got != want {
			t.Errorf("rule %q: %s, SetHeaders writes %s", id, got, want)
		}
	}
}
