// Package reservation names the slot a paced check reserved in a region's
// store, so that a caller who will not send can give it back
// (engine.Engine.CancelReservation): "r2.", then the rule id and the key
// (base64url), the cost, the bucket's state the reservation left (ns), a
// nonce and a MAC (base64url), dot-separated. The MAC (HMAC-SHA256 keyed
// by the engine's reservation key, truncated to 16 bytes) binds the rule,
// key, cost, state and nonce: a caller cannot write another cost, key or
// state into it. The nonce makes two reservations' names differ even when
// they leave the bucket in the same state (a reservation given back, then
// another of the same cost), and an engine gives back each name at most
// once (Spent). The store gives back only the latest reservation of a
// bucket (see bucket.Unreserver). A Book names an engine's reservations
// and gives them back.
package reservation

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// prefix starts every reservation of this format.
const prefix = "r2."

// maxLen bounds a reservation: a rule id, a key of bucket.MaxKeyLen
// bytes in base64, two numbers, a nonce and a MAC.
const maxLen = 2048

const (
	nonceLen = 12
	macLen   = 16
)

// MaxSpent bounds the reservations an engine remembers as given back, each
// until its slot has passed (when the store would refuse it anyway).
// While that many are remembered, a cancel gives nothing back.
const MaxSpent = 100_000

// slack is how long past its slot a given-back reservation is
// remembered: the slot is read on the store's clock, which may run behind
// this process's.
const slack = time.Minute

// Errors of Parse.
var (
	// ErrMalformed: not a reservation of this format.
	ErrMalformed = errors.New("malformed reservation")
	// ErrForged: its MAC is not the one the key gives it.
	ErrForged = errors.New("reservation not made by this fleet, or altered")
)

// Key is the MAC key of reservations: derived from secret (shared by the
// fleet, so that any of its processes can give back another's
// reservations) when set, otherwise random (this process only).
func Key(secret []byte) []byte {
	if len(secret) == 0 {
		k := make([]byte, sha256.Size)
		_, _ = rand.Read(k) // never fails (crypto/rand)
		return k
	}
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("limiterd reservation key v2"))
	return m.Sum(nil)
}

// Nonce tells two reservations of one bucket state apart.
type Nonce [nonceLen]byte

// Reservation is a reserved slot: the bucket of Key under Rule, Cost spent
// from it, and State the bucket's state the reservation left (ns).
type Reservation struct {
	Rule, Key string
	Cost      float64
	State     int64
	Nonce     Nonce
}

func (r *Reservation) mac(key []byte) []byte {
	m := hmac.New(sha256.New, key)
	for _, f := range []string{r.Rule, r.Key, strconv.FormatFloat(r.Cost, 'g', -1, 64), strconv.FormatInt(r.State, 10), string(r.Nonce[:])} {
		// Length-prefixed, so no two field lists write the same bytes.
		m.Write(strconv.AppendInt(nil, int64(len(f)), 10))
		m.Write([]byte{':'})
		m.Write([]byte(f))
	}
	return m.Sum(nil)[:macLen]
}

// Name is the name of r under a new random nonce, its MAC keyed by key.
func Name(key []byte, r Reservation) string {
	_, _ = rand.Read(r.Nonce[:]) // never fails (crypto/rand)
	enc := base64.RawURLEncoding
	return prefix + enc.EncodeToString([]byte(r.Rule)) + "." + enc.EncodeToString([]byte(r.Key)) + "." +
		strconv.FormatFloat(r.Cost, 'g', -1, 64) + "." + strconv.FormatInt(r.State, 10) + "." +
		enc.EncodeToString(r.Nonce[:]) + "." + enc.EncodeToString(r.mac(key))
}

// Parse reads a reservation named with key. Errors: ErrMalformed, the
// key's (wrapping bucket.ErrInvalidKey), ErrForged.
func Parse(key []byte, s string) (*Reservation, error) {
	r, sum, err := parse(s)
	if err == nil && !hmac.Equal(r.mac(key), sum) {
		err = ErrForged
	}
	if err != nil {
		return nil, err
	}
	return r, nil
}

// parse reads a reservation and the MAC it carries.
func parse(s string) (*Reservation, []byte, error) {
	if len(s) > maxLen || !strings.HasPrefix(s, prefix) {
		return nil, nil, ErrMalformed
	}
	parts := strings.Split(s[len(prefix):], ".")
	if len(parts) != 6 {
		return nil, nil, ErrMalformed
	}
	enc := base64.RawURLEncoding
	r, err1 := enc.DecodeString(parts[0])
	k, err2 := enc.DecodeString(parts[1])
	cost, err3 := strconv.ParseFloat(parts[2], 64)
	state, err4 := strconv.ParseInt(parts[3], 10, 64)
	nonce, err5 := enc.DecodeString(parts[4])
	sum, err6 := enc.DecodeString(parts[5])
	if err := errors.Join(err1, err2, err3, err4, err5, err6); err != nil || state <= 0 ||
		len(nonce) != nonceLen || len(sum) != macLen {
		return nil, nil, ErrMalformed
	}
	if err := bucket.ValidateKey(string(k)); err != nil {
		return nil, nil, err
	}
	p := &Reservation{Rule: string(r), Key: string(k), Cost: cost, State: state}
	copy(p.Nonce[:], nonce)
	return p, sum, nil
}

// Spent are the nonces of the reservations an engine gave back (or is
// giving back), each until its slot (ns) and a minute have passed. The
// zero value is empty and ready; it is safe for concurrent use.
type Spent struct {
	mu sync.Mutex
	m  map[Nonce]int64
}

// Take marks nonce, whose slot is state, as given back at now; false when
// it already was, or when MaxSpent are remembered.
func (s *Spent) Take(nonce Nonce, state int64, now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = make(map[Nonce]int64)
	}
	if _, ok := s.m[nonce]; ok {
		return false
	}
	if len(s.m) >= MaxSpent {
		ns := now.UnixNano()
		for n, until := range s.m {
			if until <= ns {
				delete(s.m, n)
			}
		}
		if len(s.m) >= MaxSpent {
			return false
		}
	}
	s.m[nonce] = state + int64(slack)
	return true
}

// Forget unmarks nonce.
func (s *Spent) Forget(nonce Nonce) {
	s.mu.Lock()
	delete(s.m, nonce)
	s.mu.Unlock()
}
