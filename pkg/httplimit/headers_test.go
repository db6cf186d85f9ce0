package httplimit

import (
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

func TestSetHeaders(t *testing.T) {
	// now has a fraction of a second: X-RateLimit-Reset rounds up.
	now := time.Unix(1_800_000_000, 300_000_000)
	tests := []struct {
		name string
		resp *limiterv1.CheckResponse
		want map[string]string // "" : must be absent
	}{
		{
			name: "allowed",
			resp: &limiterv1.CheckResponse{Allowed: true, Limit: 100, Remaining: 42.7, ResetAfterMs: 16_001, RuleId: "api", WindowMs: 60_000},
			want: map[string]string{
				"RateLimit-Limit": "100", "RateLimit-Remaining": "42", "RateLimit-Reset": "17",
				"X-RateLimit-Limit": "100", "X-RateLimit-Remaining": "42", "X-RateLimit-Reset": "1800000017",
				"RateLimit-Policy": `"api";q=100;w=60`, "RateLimit": `"api";r=42;t=17`,
				"Retry-After": "",
			},
		},
		{
			name: "rejected: retry rounded up",
			resp: &limiterv1.CheckResponse{Allowed: false, Limit: 10, Remaining: 0.4, RetryAfterMs: 2_001, ResetAfterMs: 90_000, RuleId: "api", WindowMs: 100_000},
			want: map[string]string{
				"Retry-After": "3", "RateLimit-Remaining": "0", "RateLimit-Reset": "90", "X-RateLimit-Reset": "1800000091",
				"RateLimit-Policy": `"api";q=10;w=100`, "RateLimit": `"api";r=0;t=90`,
			},
		},
		{
			name: "rejected: 1 ms is 1 s, never 0",
			resp: &limiterv1.CheckResponse{Allowed: false, Limit: 5, RetryAfterMs: 1, ResetAfterMs: 1, RuleId: "log", WindowMs: 3_600_000},
			want: map[string]string{"Retry-After": "1", "RateLimit-Reset": "1", "RateLimit": `"log";r=0;t=1`, "RateLimit-Policy": `"log";q=5;w=3600`},
		},
		{
			name: "rejected without a retry time still says 1",
			resp: &limiterv1.CheckResponse{Allowed: false, Limit: 5, RuleId: "x"},
			want: map[string]string{"Retry-After": "1", "RateLimit-Reset": "1", "X-RateLimit-Reset": "1800000001"},
		},
		{
			name: "rejected: reset never before the retry",
			resp: &limiterv1.CheckResponse{Allowed: false, Limit: 5, RetryAfterMs: 30_000, ResetAfterMs: 2_000, RuleId: "x"},
			want: map[string]string{"Retry-After": "30", "RateLimit-Reset": "30", "X-RateLimit-Reset": "1800000031"},
		},
		{
			name: "exactly whole seconds are not rounded further",
			resp: &limiterv1.CheckResponse{Allowed: false, Limit: 5, RetryAfterMs: 3_000, ResetAfterMs: 3_000, RuleId: "x"},
			want: map[string]string{"Retry-After": "3", "RateLimit-Reset": "3"},
		},
		{
			name: "remaining never negative",
			resp: &limiterv1.CheckResponse{Allowed: true, Limit: 10, Remaining: -3.5, ResetAfterMs: 1000, RuleId: "x"},
			want: map[string]string{"RateLimit-Remaining": "0", "X-RateLimit-Remaining": "0", "RateLimit": `"x";r=0;t=1`},
		},
		{
			name: "NaN remaining is 0",
			resp: &limiterv1.CheckResponse{Allowed: true, Limit: 10, Remaining: math.NaN(), RuleId: "x"},
			want: map[string]string{"RateLimit-Remaining": "0"},
		},
		{
			name: "full bucket: reset 0 when allowed",
			resp: &limiterv1.CheckResponse{Allowed: true, Limit: 10, Remaining: 10, RuleId: "x"},
			want: map[string]string{"RateLimit-Reset": "0", "X-RateLimit-Reset": "1800000001", "RateLimit-Policy": `"x";q=10`},
		},
		{
			name: "no rule applied: no quota headers",
			resp: &limiterv1.CheckResponse{Allowed: true},
			want: map[string]string{"RateLimit-Limit": "", "X-RateLimit-Limit": "", "RateLimit-Policy": "", "RateLimit": "", "Retry-After": ""},
		},
		{
			name: "statuses: every enforced rule in the structured fields, shadow rules left out",
			resp: &limiterv1.CheckResponse{
				Allowed: false, Limit: 3, Remaining: 0, RetryAfterMs: 4_500, ResetAfterMs: 9_000, RuleId: "per-ip", WindowMs: 9_000,
				Statuses: []*limiterv1.RuleStatus{
					{RuleId: "per-key", Allowed: true, Limit: 5, Remaining: 2, ResetAfterMs: 1_500, WindowMs: 10_000},
					{RuleId: "per-ip", Allowed: false, Limit: 3, Remaining: 0, RetryAfterMs: 4_500, ResetAfterMs: 9_000, WindowMs: 9_000},
					{RuleId: "watch", Allowed: false, Limit: 1, Shadow: true, RetryAfterMs: 1000, WindowMs: 1000},
				},
			},
			want: map[string]string{
				"Retry-After": "5", "RateLimit-Limit": "3", "RateLimit-Reset": "9",
				"RateLimit-Policy": `"per-key";q=5;w=10, "per-ip";q=3;w=9`,
				"RateLimit":        `"per-key";r=2;t=2, "per-ip";r=0;t=9`,
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := http.Header{}
			h.Set("RateLimit-Limit", "stale")
			SetHeaders(h, tt.resp, now)
			for name, want := range tt.want {
				if got := h.Get(name); got != want {
					t.Errorf("%s = %q, want %q", name, got, want)
				}
				if len(h.Values(name)) > 1 {
					t.Errorf("%s set %d times", name, len(h.Values(name)))
				}
			}
			if !tt.resp.GetAllowed() {
				if ra := h.Get("Retry-After"); ra == "" || ra == "0" {
					t.Errorf("a rejection with Retry-After %q", ra)
				}
			}
			// X-RateLimit-Reset is a Unix timestamp, RateLimit-Reset a delta.
			if x := h.Get("X-RateLimit-Reset"); x != "" {
				var ts int64
				for _, c := range x {
					ts = ts*10 + int64(c-'0')
				}
				if ts < now.Unix() || ts > now.Unix()+365*24*3600 {
					t.Errorf("X-RateLimit-Reset %s is not a Unix timestamp near now", x)
				}
			}
		})
	}
}

func TestSfString(t *testing.T) {
	for in, want := range map[string]string{
		"api":       `"api"`,
		`a"b\c`:     `"a\"b\\c"`,
		"tab\there": `"tab_here"`,
		"é":         `"_"`,
	} {
		if got := sfString(in); got != want {
			t.Errorf("sfString(%q) = %s, want %s", in, got, want)
		}
	}
}

// FuzzSetHeaders: whatever limiterd answers, no header is negative, and a
// rejection always says when to retry.
func FuzzSetHeaders(f *testing.F) {
	f.Add(false, 10.0, 0.5, int64(1), int64(0), int64(60_000), "api")
	f.Add(true, 100.0, -3.0, int64(0), int64(999), int64(0), `a"b`)
	f.Add(false, math.Inf(1), math.NaN(), int64(-5), int64(-5), int64(-1), "")
	f.Fuzz(func(t *testing.T, allowed bool, limit, remaining float64, retryMs, resetMs, windowMs int64, rule string) {
		h := http.Header{}
		SetHeaders(h, &limiterv1.CheckResponse{Allowed: allowed, Limit: limit, Remaining: remaining,
			RetryAfterMs: retryMs, ResetAfterMs: resetMs, WindowMs: windowMs, RuleId: rule}, time.Unix(1_800_000_000, 0))
		for _, name := range []string{HeaderLimit, HeaderRemaining, HeaderReset, HeaderXLimit, HeaderXRemaining, HeaderXReset, HeaderRetryAfter} {
			if v := h.Get(name); strings.HasPrefix(v, "-") {
				t.Fatalf("%s = %s", name, v)
			}
		}
		if !allowed {
			if v := h.Get(HeaderRetryAfter); v == "" || v == "0" {
				t.Fatalf("rejection with Retry-After %q", v)
			}
		}
	})
}
