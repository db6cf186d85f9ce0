package engine

import (
	"testing"
)

// FuzzParseReservation: any string either parses into a reservation whose
// key is valid and whose state is positive, or is refused; never a panic.
func FuzzParseReservation(f *testing.F) {
	for _, s := range []string{"", "r2.", "r2.cGFjZQ.aw.1.1764480047000000000.AAAAAAAAAAAAAAAA.AAAAAAAAAAAAAAAAAAAAAA",
		"r2.cGFjZQ.aw.NaN.-1..", "r2.......", "r1.cGFjZQ.aw.1.1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := parseReservation(s)
		if err == nil && (r.key == "" || r.state <= 0) {
			t.Fatalf("parsed %q into key %q state %d", s, r.key, r.state)
		}
	})
}
