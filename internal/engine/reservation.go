package engine

import (
	"context"
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

// A reservation names the slot a paced check reserved in this region's
// store, for CancelReservation: "r2.", then the rule id and the key
// (base64url), the cost, the bucket's state the reservation left (ns), a
// nonce and a MAC (base64url), dot-separated. The MAC (HMAC-SHA256 keyed
// by the engine's reservation key, truncated to 16 bytes) binds the rule,
// key, cost, state and nonce: a caller cannot write another cost, key or
// state into it. The nonce makes two reservations' names differ even when
// they leave the bucket in the same state (a reservation given back, then
// another of the same cost), and an engine gives back each name at most
// once (spentReservations). The store gives back only the latest
// reservation of a bucket (see bucket.Unreserver).
const reservationPrefix = "r2."

// maxReservationLen bounds a reservation: a rule id, a key of
// bucket.MaxKeyLen bytes in base64, two numbers, a nonce and a MAC.
const maxReservationLen = 2048

const (
	reservationNonceLen = 12
	reservationMACLen   = 16
)

// MaxSpentReservations bounds the reservations an engine remembers as
// given back, each until its slot has passed (when the store would refuse
// it anyway). While that many are remembered, a cancel gives nothing back.
const MaxSpentReservations = 100_000

// reservationSlack is how long past its slot a given-back reservation is
// remembered: the slot is read on the store's clock, which may run behind
// this process's.
const reservationSlack = time.Minute

var (
	errBadReservation    = errors.New("malformed reservation")
	errForgedReservation = errors.New("reservation not made by this fleet, or altered")
)

// reservationKey is the MAC key of reservations: derived from secret
// (shared by the fleet, so that any of its processes can give back
// another's reservations) when set, otherwise random (this process only).
func reservationKey(secret []byte) []byte {
	if len(secret) == 0 {
		k := make([]byte, sha256.Size)
		_, _ = rand.Read(k) // never fails (crypto/rand)
		return k
	}
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("limiterd reservation key v2"))
	return m.Sum(nil)
}

// reservation is a parsed reservation.
type reservation struct {
	rule, key string
	cost      float64
	state     int64
	nonce     [reservationNonceLen]byte
}

func (r *reservation) mac(key []byte) []byte {
	m := hmac.New(sha256.New, key)
	for _, f := range []string{r.rule, r.key, strconv.FormatFloat(r.cost, 'g', -1, 64), strconv.FormatInt(r.state, 10), string(r.nonce[:])} {
		// Length-prefixed, so no two field lists write the same bytes.
		m.Write(strconv.AppendInt(nil, int64(len(f)), 10))
		m.Write([]byte{':'})
		m.Write([]byte(f))
	}
	return m.Sum(nil)[:reservationMACLen]
}

// Reservation is the name of the slot it reserved, for CancelReservation:
// not empty only for an allowed paced check's item decided in this
// region's store. Each call names a new nonce.
func (e *Engine) Reservation(it *Item) string {
	d := it.Decision
	if it.route != routeStore || !d.Allowed || d.Reservation == 0 {
		return ""
	}
	r := reservation{rule: it.Rule.ID, key: it.Key, cost: it.Cost, state: d.Reservation}
	_, _ = rand.Read(r.nonce[:]) // never fails (crypto/rand)
	enc := base64.RawURLEncoding
	return reservationPrefix + enc.EncodeToString([]byte(r.rule)) + "." + enc.EncodeToString([]byte(r.key)) + "." +
		strconv.FormatFloat(r.cost, 'g', -1, 64) + "." + strconv.FormatInt(r.state, 10) + "." +
		enc.EncodeToString(r.nonce[:]) + "." + enc.EncodeToString(r.mac(e.resKey))
}

// CancelReservation gives back the slot a paced check reserved (named by
// Reservation), while nothing was spent from the bucket after it: then
// the next check gets it, and it reports true. When a later spend (a
// reservation stacked behind it) moved the bucket, nothing comes back and
// it reports false. A reservation is given back at most once by this
// engine. Errors: an *InvalidError naming reservation (for a malformed or
// altered one, or one made with another key, and wrapping ErrUnknownRule
// for a rule no longer in force) or the store's.
func (e *Engine) CancelReservation(ctx context.Context, s string) (bool, error) {
	r, err := parseReservation(s)
	if err == nil && !hmac.Equal(r.mac(e.resKey), r.sum) {
		err = errForgedReservation
	}
	if err != nil {
		e.m.invalid.WithLabelValues("reservation").Inc()
		return false, invalid("reservation", "reservation: %w", err)
	}
	en := e.table.Load().byID[r.rule]
	if en == nil {
		e.m.invalid.WithLabelValues("reservation").Inc()
		return false, invalid("reservation", "reservation: %w", errUnknownRule(r.rule))
	}
	if en.limit.ValidateWait(bucket.MaxWait) != nil {
		return false, nil // the rule changed algorithm: nothing to give back
	}
	cost, err := en.limit.NormalizeCost(r.cost)
	if err != nil {
		return false, nil // the rule changed under the reservation
	}
	if !e.spentRes.take(r.nonce, r.state, time.Now()) {
		return false, nil // given back before, or too many remembered
	}
	back, err := e.store.Unreserve(ctx, bucket.Request{Rule: r.rule, Key: r.key, Limit: en.limit, Cost: cost}, r.state)
	if !back {
		// Nothing came back: it may later, once the reservations stacked
		// behind it are given back.
		e.spentRes.forget(r.nonce)
	}
	if back && e.deny != nil {
		e.deny.Forget(r.rule, r.key)
	}
	return back, err
}

// parsedReservation is a reservation and the MAC it carried.
type parsedReservation struct {
	reservation
	sum []byte
}

func parseReservation(s string) (*parsedReservation, error) {
	if len(s) > maxReservationLen || !strings.HasPrefix(s, reservationPrefix) {
		return nil, errBadReservation
	}
	parts := strings.Split(s[len(reservationPrefix):], ".")
	if len(parts) != 6 {
		return nil, errBadReservation
	}
	enc := base64.RawURLEncoding
	r, err1 := enc.DecodeString(parts[0])
	k, err2 := enc.DecodeString(parts[1])
	cost, err3 := strconv.ParseFloat(parts[2], 64)
	state, err4 := strconv.ParseInt(parts[3], 10, 64)
	nonce, err5 := enc.DecodeString(parts[4])
	sum, err6 := enc.DecodeString(parts[5])
	if err := errors.Join(err1, err2, err3, err4, err5, err6); err != nil || state <= 0 ||
		len(nonce) != reservationNonceLen || len(sum) != reservationMACLen {
		return nil, errBadReservation
	}
	if err := bucket.ValidateKey(string(k)); err != nil {
		return nil, err
	}
	p := &parsedReservation{reservation: reservation{rule: string(r), key: string(k), cost: cost, state: state}, sum: sum}
	copy(p.nonce[:], nonce)
	return p, nil
}

// spentReservations are the nonces of the reservations an engine gave
// back (or is giving back), each until its slot (ns) and reservationSlack
// have passed. The zero value is empty and ready; it is safe for
// concurrent use.
type spentReservations struct {
	mu sync.Mutex
	m  map[[reservationNonceLen]byte]int64
}

// take marks nonce, whose slot is state, as given back at now; false when
// it already was, or when MaxSpentReservations are remembered.
func (s *spentReservations) take(nonce [reservationNonceLen]byte, state int64, now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = make(map[[reservationNonceLen]byte]int64)
	}
	if _, ok := s.m[nonce]; ok {
		return false
	}
	if len(s.m) >= MaxSpentReservations {
		ns := now.UnixNano()
		for n, until := range s.m {
			if until <= ns {
				delete(s.m, n)
			}
		}
		if len(s.m) >= MaxSpentReservations {
			return false
		}
	}
	s.m[nonce] = state + int64(reservationSlack)
	return true
}

// forget unmarks nonce.
func (s *spentReservations) forget(nonce [reservationNonceLen]byte) {
	s.mu.Lock()
	delete(s.m, nonce)
	s.mu.Unlock()
}
