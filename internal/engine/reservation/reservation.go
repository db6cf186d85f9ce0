// Package reservation names the slot a paced check reserved in a region's
// store, so that a caller who will not send can give it back
// (engine.Engine.CancelReservation): "r2.", then the rule id and the key
// (base64url), the cost, the bucket's state the reservation left (ns), a
// nonce and a MAC, dot-separated (see package sealed). The MAC (HMAC-SHA256 keyed
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
	"errors"
	"strconv"
	"sync"
	"time"

	"github.com/limiterd/limiterd/internal/engine/sealed"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// prefix starts every reservation of this format.
const prefix = "r2."

// maxLen bounds a reservation: a rule id, a key of bucket.MaxKeyLen
// bytes in base64, two numbers, a nonce and a MAC.
const maxLen = 2048

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
func Key(secret []byte) []byte { return sealed.Key(secret, "limiterd reservation key v2") }

// Reservation is a reserved slot: the bucket of Key under Rule, Cost spent
// from it, and State the bucket's state the reservation left (ns). Nonce
// tells two reservations of one bucket state apart.
type Reservation struct {
	Rule, Key string
	Cost      float64
	State     int64
	Nonce     sealed.Nonce
}

// Name names r with key (a new nonce; r's is ignored).
func Name(key []byte, r Reservation) string {
	name, _ := sealed.Seal(key, prefix, sealed.Text(r.Rule), sealed.Text(r.Key),
		strconv.FormatFloat(r.Cost, 'g', -1, 64), strconv.FormatInt(r.State, 10))
	return name
}

// Parse reads a reservation named with key. Errors: ErrMalformed, the
// key's (wrapping bucket.ErrInvalidKey), ErrForged.
func Parse(key []byte, s string) (*Reservation, error) {
	f, nonce, err := sealed.Open(key, prefix, s, 4, maxLen)
	if errors.Is(err, sealed.ErrForged) {
		return nil, ErrForged
	}
	if err != nil {
		return nil, ErrMalformed
	}
	return fromFields(f, nonce)
}

// fromFields reads a reservation's fields, its MAC checked.
func fromFields(f []string, nonce sealed.Nonce) (*Reservation, error) {
	if len(f) != 4 {
		return nil, ErrMalformed
	}
	rule, err1 := sealed.FromText(f[0])
	k, err2 := sealed.FromText(f[1])
	cost, err3 := strconv.ParseFloat(f[2], 64)
	state, err4 := strconv.ParseInt(f[3], 10, 64)
	if errors.Join(err1, err2, err3, err4) != nil || state <= 0 {
		return nil, ErrMalformed
	}
	if err := bucket.ValidateKey(k); err != nil {
		return nil, err
	}
	return &Reservation{Rule: rule, Key: k, Cost: cost, State: state, Nonce: nonce}, nil
}

// Spent are the nonces of the reservations an engine gave back (or is
// giving back), each until its slot (ns) and a minute have passed. The
// zero value is empty and ready; it is safe for concurrent use.
type Spent struct {
	mu sync.Mutex
	m  map[sealed.Nonce]int64
}

// Take marks nonce, whose slot is state, as given back at now; false when
// it already was, or when MaxSpent are remembered.
func (s *Spent) Take(nonce sealed.Nonce, state int64, now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = make(map[sealed.Nonce]int64)
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
func (s *Spent) Forget(nonce sealed.Nonce) {
	s.mu.Lock()
	delete(s.m, nonce)
	s.mu.Unlock()
}
