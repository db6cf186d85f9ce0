// Package concurrency holds the leases of concurrency rules: an Acquire
// (its concurrency rules and its rate rules, built as a check is), its
// lease stages (routed to the keys' homes or here, held at the homes
// through their Peer services, then here in one store call, each hold
// recorded to be given back), a peer region's Acquire held here with the
// same lease stage (PeerAcquire), and the Release and Renew of a lease id,
// wherever its parts are held. The engine (internal/engine) runs an
// Acquire's lease stages in front of its rate rules' and gives it the
// failure policy (Policy); this package holds and gives back, and decides
// no rate rule.
package concurrency

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/inflight"
	"github.com/limiterd/limiterd/internal/engine/leaseid"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/topkeys"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// Errors of the lease operations.
var (
	// ErrNotConcurrency: an Acquire by rule id, or a lease id, names a
	// rule that is not a concurrency rule.
	ErrNotConcurrency = errors.New("not a concurrency rule")
	// ErrLeaseStore: the store did not answer a Release or Renew; the
	// lease expires on its own.
	ErrLeaseStore = errors.New("lease store unavailable")
)

// Policy is the engine's failure policy, as the lease stages use it.
type Policy interface {
	// Refused says whether the leases of items, which could not be held
	// at where (failing with err), refuse the Acquire, and its error then.
	// When they do not, they are held with a share of their limits.
	Refused(ctx context.Context, items []*request.Item, where string, err error) (bool, error)
	// HomeFailed says whether err, a home region's failure to answer a
	// call routed under ts, decides the call by itself (its error, the
	// call's answer); nil leaves it to Refused.
	HomeFailed(ts *homes.State, rerouted bool, home string, err error) error
}

// Options configure Leases. Every field is required but Store (nil: the
// fallback holds every lease).
type Options struct {
	// Region is this region.
	Region string
	// Store holds the leases; Fallback those a failing Store could not
	// hold, each with this instance's share of its limit (limit / Fleet()).
	Store    bucket.LeaseStore
	Fallback *bucket.Memory
	Fleet    func() int
	// Topology is the topology in force, Table the rule table in force:
	// Release, Renew and PeerAcquire use those of their start.
	Topology *homes.Current
	Table    *atomic.Pointer[request.Table]
	// Inflight tracks the leases granted here.
	Inflight *inflight.Tracker
	Metrics  *metrics.Metrics
	Log      *slog.Logger
	// ForwardTimeout bounds a call to another region.
	ForwardTimeout time.Duration
	// Detached is a context for what is given back whether or not the
	// caller still waits (engine.Engine's: ctx's values, a deadline of its
	// own).
	Detached func(context.Context) (context.Context, context.CancelFunc)
	Policy   Policy
	// Top counts the keys each rule refuses (Admin/TopLimited); nil: none.
	Top *topkeys.Tracker
}

// Leases holds the leases of concurrency rules for one engine. Make it
// with New; it is safe for concurrent use.
type Leases struct {
	region   string
	store    bucket.LeaseStore
	fallback *bucket.Memory
	fleet    func() int
	topo     *homes.Current
	table    *atomic.Pointer[request.Table]
	inflight *inflight.Tracker
	m        *metrics.Metrics
	log      *slog.Logger
	fwdTO    time.Duration
	detached func(context.Context) (context.Context, context.CancelFunc)
	policy   Policy
	top      *topkeys.Tracker
}

// New makes the Leases of opts.
func New(opts Options) *Leases {
	return &Leases{region: opts.Region, store: opts.Store, fallback: opts.Fallback, fleet: opts.Fleet,
		topo: opts.Topology, table: opts.Table, inflight: opts.Inflight, m: opts.Metrics, log: opts.Log,
		fwdTO: opts.ForwardTimeout, detached: opts.Detached, policy: opts.Policy, top: opts.Top}
}

// refused counts the lease of it refused, by the store or its home region.
func (l *Leases) refused(it *request.Item) {
	it.Entry.Lease[metrics.EventRefused].Inc()
	l.top.Add(it.Rule.ID, it.Key, 1, time.Now().UnixNano())
}

// Hold is an Acquire's leases as its call holds them: its lease id, which
// names where each part is held, the parts held at each home region (the
// indexes into its leases) and here, and what the lease stages took, to be
// given back (Unwind). Make it with Holding; the engine keeps it in its
// plan, one per routing of the call.
type Hold struct {
	a          *Acquire
	id         *leaseid.ID
	leaseHomes []string
	byHome     map[string][]int
	here       []int
	heldHere   []*heldLease
	held       bool
	// What the stages took, to be given back: the leases of the homes
	// whose bits are set (indexes into leaseHomes; at most
	// leaseid.MaxParts of them), taken in their order, and after them
	// heldHere when hereTaken.
	homesTaken uint64
	hereTaken  bool
}

// Holding starts the Hold of a.
func Holding(a *Acquire) Hold { return Hold{a: a} }

// Held reports whether the Acquire's leases were all held (the lease
// stages allowed it).
func (h *Hold) Held() bool { return h.held }

// Taken reports whether the lease stages took leases that Unwind would
// give back.
func (h *Hold) Taken() bool { return h.homesTaken != 0 || h.hereTaken }

// Unwind gives back, newest first, what the lease stages of h took: the
// leases held here, then those held at each home, on contexts of their own
// (the caller may be gone).
func (l *Leases) Unwind(ctx context.Context, ts *homes.State, h *Hold) {
	if h.hereTaken {
		l.giveLeasesBack(ctx, h.heldHere, h.id)
	}
	for i := len(h.leaseHomes) - 1; i >= 0; i-- {
		if h.homesTaken&(1<<i) != 0 {
			l.releaseAt(ctx, ts, h.leaseHomes[i], h.id)
		}
	}
	h.homesTaken, h.hereTaken = 0, false
}

// parseLeaseID reads a lease id from a caller. Its errors are an
// *request.InvalidError of lease_id wrapping bucket.ErrInvalidLease.
func parseLeaseID(s string) (*leaseid.ID, error) {
	id, err := leaseid.Parse(s)
	if err != nil {
		return nil, &request.InvalidError{Field: "lease_id", Err: err}
	}
	return id, nil
}
