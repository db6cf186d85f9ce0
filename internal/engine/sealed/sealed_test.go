package sealed

import (
	"errors"
	"strings"
	"testing"
)

// TestSealOpen: a name opens under its key with its fields and nonce;
// under another key, or with any part changed, it is forged; with
// another prefix, field count or past the length bound, malformed.
func TestSealOpen(t *testing.T) {
	k := Key([]byte("secret"), "test v1")
	name, nonce := Seal(k, "t1.", Text("rule"), "42")
	f, n, err := Open(k, "t1.", name, 2, 1024)
	if err != nil || n != nonce || len(f) != 2 || f[1] != "42" {
		t.Fatalf("Open = %q, %v, %v", f, n, err)
	}
	if r, err := FromText(f[0]); r != "rule" || err != nil {
		t.Fatalf("FromText = %q, %v", r, err)
	}
	if _, _, err := Open(Key([]byte("other"), "test v1"), "t1.", name, 2, 1024); !errors.Is(err, ErrForged) {
		t.Errorf("another key: %v", err)
	}
	if _, _, err := Open(Key([]byte("secret"), "test v2"), "t1.", name, 2, 1024); !errors.Is(err, ErrForged) {
		t.Errorf("another label: %v", err)
	}
	parts := strings.Split(strings.TrimPrefix(name, "t1."), ".")
	for i := range parts[:len(parts)-1] {
		alt := append([]string(nil), parts...)
		alt[i] = "AAAA" + alt[i]
		if _, _, err := Open(k, "t1.", "t1."+strings.Join(alt, "."), 2, 1024); err == nil {
			t.Errorf("part %d changed: opened", i)
		}
	}
	for _, c := range []struct {
		prefix string
		n, max int
	}{{"t2.", 2, 1024}, {"t1.", 3, 1024}, {"t1.", 2, len(name) - 1}} {
		if _, _, err := Open(k, c.prefix, name, c.n, c.max); !errors.Is(err, ErrMalformed) {
			t.Errorf("%+v: %v, want ErrMalformed", c, err)
		}
	}
	if again, _ := Seal(k, "t1.", Text("rule"), "42"); again == name {
		t.Error("two names of the same fields are equal: want a new nonce each")
	}
}
