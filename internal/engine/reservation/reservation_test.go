package reservation

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/engine/sealed"
)

// FuzzParseReservation: any fields (a name's, its MAC checked) either
// read into a reservation whose key is valid and whose state is positive,
// or are refused; never a panic.
func FuzzParseReservation(f *testing.F) {
	for _, s := range []string{"", "cGFjZQ.aw.1.1764480047000000000", "cGFjZQ.aw.NaN.-1", "...", "cGFjZQ.aw.1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := fromFields(strings.Split(s, "."), sealed.Nonce{})
		if err == nil && (r.Key == "" || r.State <= 0) {
			t.Fatalf("parsed %q into key %q state %d", s, r.Key, r.State)
		}
	})
}

// TestNameParse: a name parses back under its key, with what it named,
// and is refused as forged under another key; Spent takes a nonce once.
func TestNameParse(t *testing.T) {
	k := Key([]byte("secret"))
	want := Reservation{Rule: "sms", Key: "user:1", Cost: 2, State: time.Now().UnixNano()}
	s := Name(k, want)
	got, err := Parse(k, s)
	if err != nil {
		t.Fatal(err)
	}
	if got.Rule != want.Rule || got.Key != want.Key || got.Cost != want.Cost || got.State != want.State {
		t.Errorf("Parse = %+v, want %+v", got, want)
	}
	if _, err := Parse(Key([]byte("other")), s); !errors.Is(err, ErrForged) {
		t.Errorf("Parse under another key: %v, want ErrForged", err)
	}
	if s2 := Name(k, want); s2 == s {
		t.Error("two names of one reservation are the same: want a new nonce each")
	}
	var sp Spent
	if !sp.Take(got.Nonce, got.State, time.Now()) || sp.Take(got.Nonce, got.State, time.Now()) {
		t.Error("Take: want true once, then false")
	}
	sp.Forget(got.Nonce)
	if !sp.Take(got.Nonce, got.State, time.Now()) {
		t.Error("Take after Forget: want true")
	}
}
