// Package quota holds the roundings of the quota headers (RateLimit-*,
// X-RateLimit-*, Retry-After), shared by pkg/httplimit, which writes them
// into an http.Header, and the Envoy front door, which writes them into
// Envoy's header values: both must write the same values.
package quota

import (
	"math"
	"time"
)

// FloorInt rounds down, to 0 at least; NaN is 0.
func FloorInt(f float64) int64 {
	if !(f > 0) {
		return 0
	}
	if f >= math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(math.Floor(f))
}

// CeilSeconds is milliseconds in whole seconds, rounded up, 0 at least.
func CeilSeconds(ms int64) int64 {
	if ms <= 0 {
		return 0
	}
	return (ms-1)/1000 + 1
}

// UnixCeil is t in Unix seconds, rounded up.
func UnixCeil(t time.Time) int64 {
	s := t.Unix()
	if t.Nanosecond() > 0 {
		s++
	}
	return s
}
