package loadgen

import (
	"math"
	"time"
)

// KeyResult counts the requests of one key over a whole run, warmup
// included, since warmup requests spend tokens too.
type KeyResult struct {
	Key string
	// Sent counts requests sent, including any cut short by the end of the
	// caller's context.
	Sent    int64
	Allowed int64
	Limited int64
	Errors  int64
	// Window runs from the first send to the last answer of the key: every
	// decision on the key was taken inside it.
	Window time.Duration
}

// Accuracy compares the admissions of each key with what a token bucket of
// the expected rate and burst allows. The counts are in requests.
type Accuracy struct {
	// Rate and Burst are the expected refill per second and capacity per
	// key, in tokens; Cost is the tokens of each request.
	Rate, Burst, Cost float64
	// Keys is the number of keys that were sent at least one request.
	Keys int
	// Admitted sums the allowed requests over the keys.
	Admitted int64
	// Expected sums over the keys min(sent, (Burst + Rate*window)/Cost),
	// the most a token bucket full at the key's first request admits.
	Expected float64
	// Ratio is Admitted / Expected: near 1 when the limiter admits all it
	// may, above 1 when it admits more.
	Ratio float64
	// WorstOvershoot is the highest admitted/expected of a key, and
	// WorstKey that key (with its WorstAdmitted and WorstExpected).
	WorstOvershoot float64
	WorstKey       string
	WorstAdmitted  int64
	WorstExpected  float64
	// OverKeys counts the keys that admitted more than expected.
	OverKeys int
}

// ComputeAccuracy compares each key's admissions with the most a token bucket
// of rate tokens per second and burst tokens admits during the key's window,
// assuming the bucket is full at the key's first request. Keys with no
// request sent are skipped. Burst and cost must be above 0, as
// Options.Validate requires.
func ComputeAccuracy(keys []KeyResult, rate, burst, cost float64) Accuracy {
	a := Accuracy{Rate: rate, Burst: burst, Cost: cost}
	for _, k := range keys {
		if k.Sent == 0 {
			continue
		}
		bound := (burst + rate*k.Window.Seconds()) / cost
		expected := math.Min(float64(k.Sent), bound)
		a.Keys++
		a.Admitted += k.Allowed
		a.Expected += expected
		if float64(k.Allowed) > expected {
			a.OverKeys++
		}
		var ratio float64
		switch {
		case expected > 0:
			ratio = float64(k.Allowed) / expected
		case k.Allowed > 0:
			ratio = math.Inf(1)
		}
		if a.WorstKey == "" || ratio > a.WorstOvershoot {
			a.WorstOvershoot = ratio
			a.WorstKey = k.Key
			a.WorstAdmitted = k.Allowed
			a.WorstExpected = expected
		}
	}
	if a.Expected > 0 {
		a.Ratio = float64(a.Admitted) / a.Expected
	}
	return a
}
