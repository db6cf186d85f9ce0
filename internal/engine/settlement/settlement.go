// Package settlement names the spend of a check that spent an estimate, so
// that its caller can settle it later with the actual cost
// (engine.Engine.Settle): "s1.", then the rule id and the key (base64url),
// the estimate, the instant the store spent it (µs), the instant the
// settlement expires (ms since the Unix epoch), a nonce and a MAC,
// dot-separated (see package sealed, as a reservation's name, with a key
// of its own). The MAC binds every field: a caller cannot write another
// estimate, key, instant or expiry into it. The nonce names the
// settlement's record in the store, which makes it settle once (see
// bucket.Settler). A Book names an engine's settlements and settles them.
package settlement

import (
	"errors"
	"strconv"

	"github.com/limiterd/limiterd/internal/engine/sealed"
)

// prefix starts every settlement of this format.
const prefix = "s1."

// MaxLen bounds a settlement: a rule id, a key of bucket.MaxKeyLen bytes
// in base64, three numbers, a nonce and a MAC.
const MaxLen = 2048

// Errors of Parse.
var (
	// ErrMalformed: not a settlement of this format.
	ErrMalformed = errors.New("malformed settlement")
	// ErrForged: its MAC is not the one the key gives it.
	ErrForged = errors.New("settlement not made by this fleet, or altered")
)

// Key is the MAC key of settlements: derived from secret (shared by the
// fleet, so that any of its processes can settle another's) when set,
// otherwise random (this process only).
func Key(secret []byte) []byte { return sealed.Key(secret, "limiterd settlement key v1") }

// Settlement is a spend to settle: Estimate spent from the bucket of Key
// under Rule at the store's instant At (µs), to be settled before Expires
// (ms since the Unix epoch).
type Settlement struct {
	Rule, Key string
	Estimate  float64
	At        int64
	Expires   int64
	Nonce     sealed.Nonce
}

// Name is the name of s under a new random nonce, its MAC keyed by key.
func Name(key []byte, s Settlement) string {
	name, _ := sealed.Seal(key, prefix, sealed.Text(s.Rule), sealed.Text(s.Key), strconv.FormatFloat(s.Estimate, 'g', -1, 64),
		strconv.FormatInt(s.At, 10), strconv.FormatInt(s.Expires, 10))
	return name
}

// Parse reads a settlement named with key. Errors: ErrMalformed,
// ErrForged.
func Parse(key []byte, str string) (*Settlement, error) {
	f, nonce, err := sealed.Open(key, prefix, str, 5, MaxLen)
	if errors.Is(err, sealed.ErrForged) {
		return nil, ErrForged
	}
	if err != nil {
		return nil, ErrMalformed
	}
	return fromFields(f, nonce)
}

// fromFields reads a settlement's fields, its MAC checked.
func fromFields(f []string, nonce sealed.Nonce) (*Settlement, error) {
	if len(f) != 5 {
		return nil, ErrMalformed
	}
	rule, err1 := sealed.FromText(f[0])
	k, err2 := sealed.FromText(f[1])
	est, err3 := strconv.ParseFloat(f[2], 64)
	at, err4 := strconv.ParseInt(f[3], 10, 64)
	exp, err5 := strconv.ParseInt(f[4], 10, 64)
	if errors.Join(err1, err2, err3, err4, err5) != nil || !(est > 0) || at <= 0 || exp <= 0 {
		return nil, ErrMalformed
	}
	return &Settlement{Rule: rule, Key: k, Estimate: est, At: at, Expires: exp, Nonce: nonce}, nil
}
