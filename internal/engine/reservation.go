package engine

import (
	"context"

	"github.com/limiterd/limiterd/internal/engine/request"
)

// A reservation names the slot a paced check reserved in this region's
// store (see the reservation package for its format and its Book).

// Reservation is the name of the slot it reserved, for CancelReservation:
// not empty only for an allowed paced check's item decided in this
// region's store. Each call names a new nonce.
func (e *Engine) Reservation(it *request.Item) string { return e.res.Name(it) }

// CancelReservation gives back the slot a paced check reserved (named by
// Reservation), while nothing was spent from the bucket after it: then
// the next check gets it, and it reports true. When a later spend (a
// reservation stacked behind it) moved the bucket, nothing comes back and
// it reports false. A reservation is given back at most once by this
// engine. Errors: an *request.InvalidError naming reservation (for a malformed or
// altered one, or one made with another key, and wrapping request.ErrUnknownRule
// for a rule no longer in force) or the store's.
func (e *Engine) CancelReservation(ctx context.Context, s string) (bool, error) {
	r, err := e.res.Cancel(ctx, e.table.Load(), s)
	if r != nil && e.deny != nil {
		e.deny.Forget(r.Rule, r.Key)
	}
	return r != nil, err
}
