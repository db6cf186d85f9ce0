// Package settlement names the spend of a check that spent an estimate, so
// that its caller can settle it later with the actual cost
// (engine.Engine.Settle): "s1.", then the rule id and the key (base64url),
// the estimate, the instant the store spent it (µs), the instant the
// settlement expires (ms since the Unix epoch), a nonce and a MAC
// (base64url), dot-separated. The MAC (HMAC-SHA256 keyed by the engine's
// settlement key, truncated to 16 bytes) binds every field: a caller
// cannot write another estimate, key, instant or expiry into it. The nonce
// names the settlement's record in the store, which makes it settle once
// (see bucket.Settler). It is made as a reservation's name is (the
// reservation package), with its own key and prefix. A Book names an
// engine's settlements and settles them.
package settlement

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"strconv"
	"strings"
)

// prefix starts every settlement of this format.
const prefix = "s1."

// MaxLen bounds a settlement: a rule id, a key of bucket.MaxKeyLen bytes
// in base64, three numbers, a nonce and a MAC.
const MaxLen = 2048

const (
	nonceLen = 12
	macLen   = 16
)

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
func Key(secret []byte) []byte {
	if len(secret) == 0 {
		k := make([]byte, sha256.Size)
		_, _ = rand.Read(k) // never fails (crypto/rand)
		return k
	}
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("limiterd settlement key v1"))
	return m.Sum(nil)
}

// Nonce tells two settlements apart, and names the record of one.
type Nonce [nonceLen]byte

// ID is the nonce as the store's record names it.
func (n Nonce) ID() string { return base64.RawURLEncoding.EncodeToString(n[:]) }

// Settlement is a spend to settle: Estimate spent from the bucket of Key
// under Rule at the store's instant At (µs), to be settled before Expires
// (ms since the Unix epoch).
type Settlement struct {
	Rule, Key string
	Estimate  float64
	At        int64
	Expires   int64
	Nonce     Nonce
}

func (s *Settlement) mac(key []byte) []byte {
	m := hmac.New(sha256.New, key)
	for _, f := range []string{s.Rule, s.Key, strconv.FormatFloat(s.Estimate, 'g', -1, 64),
		strconv.FormatInt(s.At, 10), strconv.FormatInt(s.Expires, 10), string(s.Nonce[:])} {
		// Length-prefixed, so no two field lists write the same bytes.
		m.Write(strconv.AppendInt(nil, int64(len(f)), 10))
		m.Write([]byte{':'})
		m.Write([]byte(f))
	}
	return m.Sum(nil)[:macLen]
}

// Name is the name of s under a new random nonce, its MAC keyed by key.
func Name(key []byte, s Settlement) string {
	_, _ = rand.Read(s.Nonce[:]) // never fails (crypto/rand)
	enc := base64.RawURLEncoding
	var b strings.Builder
	b.Grow(128 + 2*len(s.Key))
	b.WriteString(prefix)
	b.WriteString(enc.EncodeToString([]byte(s.Rule)))
	b.WriteByte('.')
	b.WriteString(enc.EncodeToString([]byte(s.Key)))
	b.WriteByte('.')
	b.WriteString(strconv.FormatFloat(s.Estimate, 'g', -1, 64))
	b.WriteByte('.')
	b.WriteString(strconv.FormatInt(s.At, 10))
	b.WriteByte('.')
	b.WriteString(strconv.FormatInt(s.Expires, 10))
	b.WriteByte('.')
	b.WriteString(enc.EncodeToString(s.Nonce[:]))
	b.WriteByte('.')
	b.WriteString(enc.EncodeToString(s.mac(key)))
	return b.String()
}

// Parse reads a settlement named with key. Errors: ErrMalformed,
// ErrForged.
func Parse(key []byte, str string) (*Settlement, error) {
	s, sum, err := parse(str)
	if err == nil && !hmac.Equal(s.mac(key), sum) {
		err = ErrForged
	}
	if err != nil {
		return nil, err
	}
	return s, nil
}

// parse reads a settlement and the MAC it carries.
func parse(str string) (*Settlement, []byte, error) {
	if len(str) > MaxLen || !strings.HasPrefix(str, prefix) {
		return nil, nil, ErrMalformed
	}
	parts := strings.Split(str[len(prefix):], ".")
	if len(parts) != 7 {
		return nil, nil, ErrMalformed
	}
	enc := base64.RawURLEncoding
	r, err1 := enc.DecodeString(parts[0])
	k, err2 := enc.DecodeString(parts[1])
	est, err3 := strconv.ParseFloat(parts[2], 64)
	at, err4 := strconv.ParseInt(parts[3], 10, 64)
	exp, err5 := strconv.ParseInt(parts[4], 10, 64)
	nonce, err6 := enc.DecodeString(parts[5])
	sum, err7 := enc.DecodeString(parts[6])
	if err := errors.Join(err1, err2, err3, err4, err5, err6, err7); err != nil || len(r) == 0 || len(k) == 0 ||
		!(est > 0) || at <= 0 || exp <= 0 || len(nonce) != nonceLen || len(sum) != macLen {
		return nil, nil, ErrMalformed
	}
	s := &Settlement{Rule: string(r), Key: string(k), Estimate: est, At: at, Expires: exp}
	copy(s.Nonce[:], nonce)
	return s, sum, nil
}
