package engine

import (
	"context"
	"encoding/base64"
	"errors"
	"strconv"
	"strings"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// A reservation names the slot a paced check reserved in this region's
// store, for CancelReservation: "r1.", then the rule id and the key
// (base64url), the cost and the bucket's state the reservation left (ns),
// dot-separated. It is not a secret: a caller able to check a rule and key
// can also ignore its wait. And it can give back only the latest
// reservation of a bucket (see bucket.Unreserver).
const reservationPrefix = "r1."

// maxReservationLen bounds a reservation: a rule id, a key of
// bucket.MaxKeyLen bytes in base64 and two numbers.
const maxReservationLen = 2048

// ErrNoUnreserve: the store cannot give a reservation back (it implements
// no bucket.Unreserver).
var ErrNoUnreserve = errors.New("the store cannot give reservations back")

var errBadReservation = errors.New("malformed reservation")

// Reservation is the name of the slot it reserved, for CancelReservation:
// not empty only for an allowed paced check's item decided in this
// region's store.
func Reservation(it *Item) string {
	d := it.Decision
	if it.route != routeStore || !d.Allowed || d.Reservation == 0 {
		return ""
	}
	enc := base64.RawURLEncoding
	return reservationPrefix + enc.EncodeToString([]byte(it.Rule.ID)) + "." + enc.EncodeToString([]byte(it.Key)) + "." +
		strconv.FormatFloat(it.Cost, 'g', -1, 64) + "." + strconv.FormatInt(d.Reservation, 10)
}

// CancelReservation gives back the slot a paced check reserved (named by
// Reservation), while nothing was spent from the bucket after it: then
// the next check gets it, and it reports true. When a later spend (a
// reservation stacked behind it) moved the bucket, nothing comes back and
// it reports false. Errors: an *InvalidError naming reservation (wrapping
// ErrUnknownRule for a rule no longer in force), ErrNoUnreserve, or the
// store's.
func (e *Engine) CancelReservation(ctx context.Context, reservation string) (bool, error) {
	rule, key, cost, state, err := parseReservation(reservation)
	if err != nil {
		e.m.invalid.WithLabelValues("reservation").Inc()
		return false, invalid("reservation", "reservation: %w", err)
	}
	en := e.table.Load().byID[rule]
	if en == nil {
		e.m.invalid.WithLabelValues("reservation").Inc()
		return false, invalid("reservation", "reservation: %w", errUnknownRule(rule))
	}
	if en.limit.ValidateWait(bucket.MaxWait) != nil {
		return false, nil // the rule changed algorithm: nothing to give back
	}
	if cost, err = en.limit.NormalizeCost(cost); err != nil {
		return false, nil // the rule changed under the reservation
	}
	u, ok := e.store.(bucket.Unreserver)
	if !ok {
		return false, ErrNoUnreserve
	}
	back, err := u.Unreserve(ctx, bucket.Request{Rule: rule, Key: key, Limit: en.limit, Cost: cost}, state)
	if back && e.deny != nil {
		e.deny.Forget(rule, key)
	}
	return back, err
}

func parseReservation(s string) (rule, key string, cost float64, state int64, err error) {
	if len(s) > maxReservationLen || !strings.HasPrefix(s, reservationPrefix) {
		return "", "", 0, 0, errBadReservation
	}
	parts := strings.Split(s[len(reservationPrefix):], ".")
	if len(parts) != 4 {
		return "", "", 0, 0, errBadReservation
	}
	enc := base64.RawURLEncoding
	r, err1 := enc.DecodeString(parts[0])
	k, err2 := enc.DecodeString(parts[1])
	cost, err3 := strconv.ParseFloat(parts[2], 64)
	state, err4 := strconv.ParseInt(parts[3], 10, 64)
	if err := errors.Join(err1, err2, err3, err4); err != nil || state <= 0 {
		return "", "", 0, 0, errBadReservation
	}
	if err := bucket.ValidateKey(string(k)); err != nil {
		return "", "", 0, 0, err
	}
	return string(r), string(k), cost, state, nil
}
