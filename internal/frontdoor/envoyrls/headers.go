package envoyrls

import (
	"github.com/limiterd/limiterd/internal/quota"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/limiterd/limiterd/internal/engine/request"
)

// The quota headers as Envoy gets them: the names of pkg/httplimit in
// lower case (as HTTP/2 sends them), in this order, sorted.
const (
	hRateLimit  = "ratelimit"
	hLimit      = "ratelimit-limit"
	hPolicy     = "ratelimit-policy"
	hRemaining  = "ratelimit-remaining"
	hReset      = "ratelimit-reset"
	hRetryAfter = "retry-after"
	hXLimit     = "x-ratelimit-limit"
	hXRemaining = "x-ratelimit-remaining"
	hXReset     = "x-ratelimit-reset"
	maxHeaders  = 9
)

// quotaHeaders are the headers httplimit.SetHeaders writes for a check of
// the rules all, decided by top and allowed or not, as of now; nil when
// there are none. Their values are written into one string, and the
// headers into one slice: a few allocations whatever the rules.
// TestQuotaHeadersAsSetHeaders holds the two to the same bytes.
func quotaHeaders(all []*request.Item, top *request.Item, allowed bool, now time.Time) []*corev3.HeaderValue {
	if top == nil {
		return nil
	}
	d := top.Decision
	retryMs := request.CeilMillis(d.RetryAfter)
	if !(d.Limit > 0) {
		if allowed {
			return nil
		}
		return headerValues([]string{hRetryAfter}, strconv.FormatInt(max(quota.CeilSeconds(retryMs), 1), 10), []int{0})
	}
	limit, remaining := quota.FloorInt(d.Limit), quota.FloorInt(d.Remaining)
	resetMs := request.CeilMillis(d.ResetAfter)
	if !allowed {
		resetMs = max(resetMs, retryMs, 1)
	}
	reset := quota.CeilSeconds(resetMs)

	var mem [256]byte
	buf := mem[:0]
	var names [maxHeaders]string
	var ends [maxHeaders]int
	n := 0
	end := func(name string) {
		names[n], ends[n] = name, len(buf)
		n++
	}
	// RateLimit and RateLimit-Policy: every rule with a limit, or the
	// deciding one when none has.
	listed := false
	for _, it := range all {
		if it.Rule.Shadow || !(it.Decision.Limit > 0) {
			continue
		}
		if listed {
			buf = append(buf, ", "...)
		}
		listed = true
		ms := request.CeilMillis(it.Decision.ResetAfter)
		if !it.Decision.Allowed {
			ms = max(ms, request.CeilMillis(it.Decision.RetryAfter), 1)
		}
		buf = appendState(buf, it.Rule.ID, quota.FloorInt(it.Decision.Remaining), quota.CeilSeconds(ms))
	}
	if !listed {
		buf = appendState(buf, top.Rule.ID, remaining, reset)
	}
	end(hRateLimit)
	buf = strconv.AppendInt(buf, limit, 10)
	end(hLimit)
	listed = false
	for _, it := range all {
		if it.Rule.Shadow || !(it.Decision.Limit > 0) {
			continue
		}
		if listed {
			buf = append(buf, ", "...)
		}
		listed = true
		buf = appendPolicy(buf, it.Rule.ID, quota.FloorInt(it.Decision.Limit), it.WindowMillis())
	}
	if !listed {
		buf = appendPolicy(buf, top.Rule.ID, limit, top.WindowMillis())
	}
	end(hPolicy)
	buf = strconv.AppendInt(buf, remaining, 10)
	end(hRemaining)
	buf = strconv.AppendInt(buf, reset, 10)
	end(hReset)
	if !allowed {
		buf = strconv.AppendInt(buf, max(quota.CeilSeconds(retryMs), 1), 10)
		end(hRetryAfter)
	}
	buf = strconv.AppendInt(buf, limit, 10)
	end(hXLimit)
	buf = strconv.AppendInt(buf, remaining, 10)
	end(hXRemaining)
	buf = strconv.AppendInt(buf, quota.UnixCeil(now.Add(time.Duration(resetMs)*time.Millisecond)), 10)
	end(hXReset)
	return headerValues(names[:n], string(buf), ends[:n])
}

// headerValues are names with their values, value i being
// values[ends[i-1]:ends[i]].
func headerValues(names []string, values string, ends []int) []*corev3.HeaderValue {
	hs := make([]corev3.HeaderValue, len(names))
	out := make([]*corev3.HeaderValue, len(names))
	from := 0
	for i, name := range names {
		hs[i].Key, hs[i].Value = name, values[from:ends[i]]
		out[i] = &hs[i]
		from = ends[i]
	}
	return out
}

// appendPolicy and appendState append the items of RateLimit-Policy and
// RateLimit as pkg/httplimit writes them: `"api";q=100;w=60` and
// `"api";r=42;t=17`.
func appendPolicy(buf []byte, rule string, limit, windowMs int64) []byte {
	buf = append(appendSFString(buf, rule), ";q="...)
	buf = strconv.AppendInt(buf, limit, 10)
	if windowMs > 0 {
		buf = strconv.AppendInt(append(buf, ";w="...), quota.CeilSeconds(windowMs), 10)
	}
	return buf
}

func appendState(buf []byte, rule string, remaining, reset int64) []byte {
	buf = strconv.AppendInt(append(appendSFString(buf, rule), ";r="...), remaining, 10)
	return strconv.AppendInt(append(buf, ";t="...), reset, 10)
}

// appendSFString appends s as a structured-field string (RFC 8941), as
// pkg/httplimit does: quoted, " and \ escaped, anything but printable
// ASCII as _ (one per rune).
func appendSFString(buf []byte, s string) []byte {
	buf = append(buf, '"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			buf = append(buf, '\\', byte(r))
		case r >= 0x20 && r < 0x7f:
			buf = append(buf, byte(r))
		default:
			buf = append(buf, '_')
		}
	}
	return append(buf, '"')
}

// Headers of a refusal for the reserve of more important classes.
const (
	hReason       = "x-ratelimit-reason"
	reasonReserve = "reserved"
)

// reservedHeaders adds to hs, the quota headers or none, what Envoy adds to
// a refusal for the reserve of more important classes: the reason, and
// retry-after by top's retry when the quota headers did not.
func reservedHeaders(hs []*corev3.HeaderValue, top *request.Item) []*corev3.HeaderValue {
	retry := true
	for _, h := range hs {
		retry = retry && h.GetKey() != hRetryAfter
	}
	if retry && top != nil {
		hs = append(hs, &corev3.HeaderValue{Key: hRetryAfter,
			Value: strconv.FormatInt(max(quota.CeilSeconds(request.CeilMillis(top.Decision.RetryAfter)), 1), 10)})
	}
	return append(hs, &corev3.HeaderValue{Key: hReason, Value: reasonReserve})
}
