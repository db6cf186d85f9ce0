package engine

import (
	"context"
	"time"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/reservation"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// A reservation names the slot a paced check reserved in this region's
// store (see the reservation package for its format).

// Reservation is the name of the slot it reserved, for CancelReservation:
// not empty only for an allowed paced check's item decided in this
// region's store. Each call names a new nonce.
func (e *Engine) Reservation(it *request.Item) string {
	d := it.Decision
	if it.Route != request.RouteStore || !d.Allowed || d.Reservation == 0 {
		return ""
	}
	return reservation.Name(e.resKey, reservation.Reservation{Rule: it.Rule.ID, Key: it.Key, Cost: it.Cost, State: d.Reservation})
}

// CancelReservation gives back the slot a paced check reserved (named by
// Reservation), while nothing was spent from the bucket after it: then
// the next check gets it, and it reports true. When a later spend (a
// reservation stacked behind it) moved the bucket, nothing comes back and
// it reports false. A reservation is given back at most once by this
// engine. Errors: an *request.InvalidError naming reservation (for a malformed or
// altered one, or one made with another key, and wrapping request.ErrUnknownRule
// for a rule no longer in force) or the store's.
func (e *Engine) CancelReservation(ctx context.Context, s string) (bool, error) {
	r, err := reservation.Parse(e.resKey, s)
	if err != nil {
		e.m.Invalid.WithLabelValues("reservation").Inc()
		return false, request.Invalid("reservation", "reservation: %w", err)
	}
	en := e.table.Load().ByID[r.Rule]
	if en == nil {
		e.m.Invalid.WithLabelValues("reservation").Inc()
		return false, request.Invalid("reservation", "reservation: %w", request.UnknownRule(r.Rule))
	}
	if en.Limit.ValidateWait(bucket.MaxWait) != nil {
		return false, nil // the rule changed algorithm: nothing to give back
	}
	cost, err := en.Limit.NormalizeCost(r.Cost)
	if err != nil {
		return false, nil // the rule changed under the reservation
	}
	if !e.spentRes.Take(r.Nonce, r.State, time.Now()) {
		return false, nil // given back before, or too many remembered
	}
	back, err := e.store.Unreserve(ctx, bucket.Request{Rule: r.Rule, Key: r.Key, Limit: en.Limit, Cost: cost}, r.State)
	if !back {
		// Nothing came back: it may later, once the reservations stacked
		// behind it are given back.
		e.spentRes.Forget(r.Nonce)
	}
	if back && e.deny != nil {
		e.deny.Forget(r.Rule, r.Key)
	}
	return back, err
}
