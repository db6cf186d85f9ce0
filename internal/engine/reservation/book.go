package reservation

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// Book names the slots paced checks reserved in a region's store and
// gives them back, each at most once by this Book.
type Book struct {
	key   []byte
	spent Spent
	store bucket.Unreserver
	// invalid counts the names refused as invalid (field reservation).
	invalid *prometheus.CounterVec
}

// NewBook names reservations with Key(secret) and gives them back to
// store, counting those refused as invalid in invalid, by field.
func NewBook(secret []byte, store bucket.Unreserver, invalid *prometheus.CounterVec) *Book {
	return &Book{key: Key(secret), store: store, invalid: invalid}
}

// Name is the name of the slot it reserved: not empty only for an
// allowed paced check's item decided in this region's store. Each call
// names a new nonce.
func (b *Book) Name(it *request.Item) string {
	d := it.Decision
	if it.Route != request.RouteStore || !d.Allowed || d.Reservation == 0 {
		return ""
	}
	return Name(b.key, Reservation{Rule: it.Rule.ID, Key: it.Key, Cost: it.Cost, State: d.Reservation})
}

// Cancel gives back the slot named s, its rule's as t has it, while
// nothing was spent from the bucket after it (see
// engine.Engine.CancelReservation), and returns it when it did. Errors: an
// *request.InvalidError naming reservation (for a malformed or altered
// one, or one made with another key, and wrapping request.ErrUnknownRule
// for a rule no longer in force) or the store's.
func (b *Book) Cancel(ctx context.Context, t *request.Table, s string) (*Reservation, error) {
	r, err := Parse(b.key, s)
	if err != nil {
		b.invalid.WithLabelValues("reservation").Inc()
		return nil, request.Invalid("reservation", "reservation: %w", err)
	}
	en := t.ByID[r.Rule]
	if en == nil {
		b.invalid.WithLabelValues("reservation").Inc()
		return nil, request.Invalid("reservation", "reservation: %w", request.UnknownRule(r.Rule))
	}
	lim := en.For(r.Key).Limit
	if lim.ValidateWait(bucket.MaxWait) != nil {
		return nil, nil // the rule changed algorithm: nothing to give back
	}
	cost, err := lim.NormalizeCost(r.Cost)
	if err != nil {
		return nil, nil // the rule changed under the reservation
	}
	if !b.spent.Take(r.Nonce, r.State, time.Now()) {
		return nil, nil // given back before, or too many remembered
	}
	back, err := b.store.Unreserve(ctx, bucket.Request{Rule: r.Rule, Key: r.Key, Limit: lim, Cost: cost}, r.State)
	if !back {
		// Nothing came back: it may later, once the reservations stacked
		// behind it are given back.
		b.spent.Forget(r.Nonce)
		return nil, err
	}
	return r, err
}
