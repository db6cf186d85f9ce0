package httplimit

import (
	"github.com/limiterd/limiterd/internal/quota"
	"net/http"
	"strconv"
	"strings"
	"time"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// The headers SetHeaders writes.
const (
	// HeaderRetryAfter is on rejections only: whole seconds, rounded up, ≥ 1.
	HeaderRetryAfter = "Retry-After"
	// HeaderLimit, HeaderRemaining, HeaderReset are the IETF draft's first
	// fields; the reset is in seconds from now, rounded up.
	HeaderLimit     = "RateLimit-Limit"
	HeaderRemaining = "RateLimit-Remaining"
	HeaderReset     = "RateLimit-Reset"
	// HeaderXLimit, HeaderXRemaining, HeaderXReset are the older de facto
	// fields; the reset is a Unix timestamp, on purpose unlike HeaderReset.
	HeaderXLimit     = "X-RateLimit-Limit"
	HeaderXRemaining = "X-RateLimit-Remaining"
	HeaderXReset     = "X-RateLimit-Reset"
	// HeaderPolicy and HeaderRateLimit are the newer draft's structured
	// fields: `"api";q=100;w=60` and `"api";r=42;t=17`.
	HeaderPolicy    = "RateLimit-Policy"
	HeaderRateLimit = "RateLimit"
)

// HeaderNames lists every header SetHeaders may write, Retry-After last.
var HeaderNames = []string{
	HeaderLimit, HeaderRemaining, HeaderReset,
	HeaderXLimit, HeaderXRemaining, HeaderXReset,
	HeaderPolicy, HeaderRateLimit,
	HeaderRetryAfter,
}

// SetHeaders writes the quota headers of a decision into h, as of now,
// removing any of HeaderNames already there: on allowed responses the quota headers, on
// rejections also Retry-After, rounded up to whole seconds and never 0. A
// response without a limit (no rule applied) writes no quota header.
//
// Values are integers: the limit and the remaining tokens rounded down
// (remaining never below 0), times rounded up. On a rejection the reset is
// never earlier than the retry, so never 0 either. With per-rule statuses
// (an attribute check), RateLimit-Policy and RateLimit list every rule that
// is not in shadow mode; the other fields describe the deciding rule.
func SetHeaders(h http.Header, resp *limiterv1.CheckResponse, now time.Time) {
	for _, name := range HeaderNames {
		h.Del(name)
	}
	retry := quota.CeilSeconds(resp.GetRetryAfterMs())
	if !resp.GetAllowed() {
		retry = max(retry, 1)
		h.Set(HeaderRetryAfter, strconv.FormatInt(retry, 10))
	}
	if !(resp.GetLimit() > 0) {
		return
	}
	limit := quota.FloorInt(resp.GetLimit())
	remaining := quota.FloorInt(resp.GetRemaining())
	resetMs := resp.GetResetAfterMs()
	if !resp.GetAllowed() {
		resetMs = max(resetMs, resp.GetRetryAfterMs(), 1)
	}
	reset := quota.CeilSeconds(resetMs)
	h.Set(HeaderLimit, strconv.FormatInt(limit, 10))
	h.Set(HeaderRemaining, strconv.FormatInt(remaining, 10))
	h.Set(HeaderReset, strconv.FormatInt(reset, 10))
	h.Set(HeaderXLimit, strconv.FormatInt(limit, 10))
	h.Set(HeaderXRemaining, strconv.FormatInt(remaining, 10))
	h.Set(HeaderXReset, strconv.FormatInt(quota.UnixCeil(now.Add(time.Duration(resetMs)*time.Millisecond)), 10))

	var policy, state []string
	statuses := 0
	for _, s := range resp.GetStatuses() {
		if s.GetShadow() || !(s.GetLimit() > 0) {
			continue
		}
		statuses++
		ms := s.GetResetAfterMs()
		if !s.GetAllowed() {
			ms = max(ms, s.GetRetryAfterMs(), 1)
		}
		policy = append(policy, policyItem(s.GetRuleId(), quota.FloorInt(s.GetLimit()), s.GetWindowMs()))
		state = append(state, stateItem(s.GetRuleId(), quota.FloorInt(s.GetRemaining()), quota.CeilSeconds(ms)))
	}
	if statuses == 0 {
		policy = []string{policyItem(resp.GetRuleId(), limit, resp.GetWindowMs())}
		state = []string{stateItem(resp.GetRuleId(), remaining, reset)}
	}
	h.Set(HeaderPolicy, strings.Join(policy, ", "))
	h.Set(HeaderRateLimit, strings.Join(state, ", "))
}

func policyItem(rule string, limit, windowMs int64) string {
	s := sfString(rule) + ";q=" + strconv.FormatInt(limit, 10)
	if windowMs > 0 {
		s += ";w=" + strconv.FormatInt(quota.CeilSeconds(windowMs), 10)
	}
	return s
}

func stateItem(rule string, remaining, reset int64) string {
	return sfString(rule) + ";r=" + strconv.FormatInt(remaining, 10) + ";t=" + strconv.FormatInt(reset, 10)
}

// sfString is a structured-field string (RFC 8941): quoted, with " and \
// escaped, and only printable ASCII.
func sfString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r >= 0x20 && r < 0x7f:
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
	}
	b.WriteByte('"')
	return b.String()
}
