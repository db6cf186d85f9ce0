// Package sealed makes and opens the fleet's signed names: a kind's
// fields, a random nonce and an HMAC over them, in text joined by dots
// after a prefix naming the kind and its version. The key is derived from
// the secret every limiterd of the fleet shares, so any of them opens a
// name another made, and no caller can make or alter one. A paced check's
// reservation and a check's settlement are such names.
package sealed

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"strconv"
	"strings"
)

// NonceLen is the bytes of a name's nonce; macLen of its MAC (128 bits).
const (
	NonceLen = 12
	macLen   = 16
)

var (
	// ErrMalformed: not a name of the kind (prefix, fields, length).
	ErrMalformed = errors.New("malformed name")
	// ErrForged: well formed, but its MAC is not the key's.
	ErrForged = errors.New("name not made by this fleet, or altered")
)

// Nonce makes each name unique: two names of the same fields differ.
type Nonce [NonceLen]byte

// String is the nonce as text, fit for a store key.
func (n Nonce) String() string { return base64.RawURLEncoding.EncodeToString(n[:]) }

// Key derives the key of a kind's names (label names the kind and its
// version) from secret. Without a secret it is random: the names are
// this process's only.
func Key(secret []byte, label string) []byte {
	if len(secret) == 0 {
		k := make([]byte, sha256.Size)
		_, _ = rand.Read(k) // never fails (crypto/rand)
		return k
	}
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(label))
	return m.Sum(nil)
}

// Text encodes s (a rule id, a client key) as a field: base64url, no dot.
func Text(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }

// FromText decodes a field Text made; empty is malformed.
func FromText(f string) (string, error) {
	b, err := base64.RawURLEncoding.DecodeString(f)
	if err != nil || len(b) == 0 {
		return "", ErrMalformed
	}
	return string(b), nil
}

// Seal names fields (none holding a dot: see Text) under key: prefix,
// the fields, a new nonce and the MAC, joined by dots.
func Seal(key []byte, prefix string, fields ...string) (string, Nonce) {
	var n Nonce
	_, _ = rand.Read(n[:]) // never fails (crypto/rand)
	enc := base64.RawURLEncoding
	var b strings.Builder
	b.WriteString(prefix)
	for _, f := range fields {
		b.WriteString(f)
		b.WriteByte('.')
	}
	b.WriteString(enc.EncodeToString(n[:]))
	b.WriteByte('.')
	b.WriteString(enc.EncodeToString(mac(key, prefix, fields, n)))
	return b.String(), n
}

// Open returns the n fields of name and its nonce when name is at most
// maxLen bytes, starts with prefix and carries key's MAC. Errors:
// ErrMalformed, ErrForged.
func Open(key []byte, prefix, name string, n, maxLen int) ([]string, Nonce, error) {
	var nonce Nonce
	if len(name) > maxLen || !strings.HasPrefix(name, prefix) {
		return nil, nonce, ErrMalformed
	}
	parts := strings.Split(name[len(prefix):], ".")
	if len(parts) != n+2 {
		return nil, nonce, ErrMalformed
	}
	enc := base64.RawURLEncoding
	nb, err1 := enc.DecodeString(parts[n])
	sum, err2 := enc.DecodeString(parts[n+1])
	if err1 != nil || err2 != nil || len(nb) != NonceLen || len(sum) != macLen {
		return nil, nonce, ErrMalformed
	}
	copy(nonce[:], nb)
	if !hmac.Equal(mac(key, prefix, parts[:n], nonce), sum) {
		return nil, nonce, ErrForged
	}
	return parts[:n], nonce, nil
}

// mac is the MAC of a name: over its prefix, fields and nonce, each
// preceded by its length, so no two names share one.
func mac(key []byte, prefix string, fields []string, n Nonce) []byte {
	m := hmac.New(sha256.New, key)
	write := func(f string) {
		m.Write(strconv.AppendInt(nil, int64(len(f)), 10))
		m.Write([]byte{':'})
		m.Write([]byte(f))
	}
	write(prefix)
	for _, f := range fields {
		write(f)
	}
	write(string(n[:]))
	return m.Sum(nil)[:macLen]
}
