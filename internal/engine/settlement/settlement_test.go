package settlement

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/engine/sealed"
)

// FuzzParseSettlement: any fields (a name's, its MAC checked) either read
// into a settlement with a rule, a key, a positive estimate and instants,
// or are refused; never a panic.
func FuzzParseSettlement(f *testing.F) {
	for _, s := range []string{"", "cGFjZQ.aw.1.1764480047000000.1764480347000", "cGFjZQ.aw.NaN.-1.0", "....", "cGFjZQ.aw.1.1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		st, err := fromFields(strings.Split(s, "."), sealed.Nonce{})
		if err == nil && (st.Rule == "" || st.Key == "" || !(st.Estimate > 0) || st.At <= 0 || st.Expires <= 0) {
			t.Fatalf("parsed %q into %+v", s, st)
		}
	})
}

// TestNameParse: a name parses back under its key with what it named, is
// refused as forged under another key or with any field changed, and
// two names of one spend differ.
func TestNameParse(t *testing.T) {
	k := Key([]byte("secret"))
	want := Settlement{Rule: "llm", Key: "tenant:1", Estimate: 1000, At: time.Now().UnixMicro(), Expires: time.Now().Add(time.Minute).UnixMilli()}
	s := Name(k, want)
	got, err := Parse(k, s)
	if err != nil {
		t.Fatal(err)
	}
	if got.Rule != want.Rule || got.Key != want.Key || got.Estimate != want.Estimate || got.At != want.At || got.Expires != want.Expires {
		t.Errorf("Parse = %+v, want %+v", got, want)
	}
	if _, err := Parse(Key([]byte("other")), s); !errors.Is(err, ErrForged) {
		t.Errorf("Parse under another key: %v, want ErrForged", err)
	}
	parts := strings.Split(s, ".")
	for i := 1; i < len(parts)-1; i++ {
		alt := append([]string(nil), parts...)
		alt[i] = "MTIz" // base64 of "123", and a number
		if i >= 3 && i <= 5 {
			alt[i] = "123"
		}
		if _, err := Parse(k, strings.Join(alt, ".")); !errors.Is(err, ErrForged) && !errors.Is(err, ErrMalformed) {
			t.Errorf("field %d changed: %v, want refused", i, err)
		}
	}
	if s2 := Name(k, want); s2 == s {
		t.Error("two names of one spend are the same: want a new nonce each")
	}
	if len(s) > MaxLen {
		t.Errorf("a name of %d bytes, above MaxLen", len(s))
	}
}
