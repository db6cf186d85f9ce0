// Package homes is how the engine reaches the home regions of pinned
// rules' keys: each other region's limiterd as the engine calls it (Home,
// with the Items it sends), and the topology a call is routed under, with
// the clients of its regions (State). A call uses one State from its start
// to its end (Current.Use); a State replaced by a newer topology is
// retired, and its clients are closed by the caller once no call or refund
// uses it. The engine decides what to send and what a home's failure
// means; the Peer service (internal/peer) is the Home of each region.
package homes

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/limiterd/limiterd/internal/engine/handoff"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
)

// ErrStaleTopology: a Home refused a forward because its topology is newer
// than the one the call was routed with and homes a key elsewhere; it
// decided nothing.
var ErrStaleTopology = errors.New("the home region's topology is newer and homes the key elsewhere")

// Home is another region's limiterd, for the rules pinned to a key's home
// region. Errors: an *request.InvalidError or request.ErrUnknownRule when
// the home refused the items as invalid (its answer stands); any other
// error means it did not answer, and the rules' on_failure decides.
type Home interface {
	// Decide decides items in the home region, all or nothing; it returns
	// one decision per item, whose At is the instant the home's store
	// spent it at, or 0 when the home spent nothing in its store (it
	// decided from its fallback, or did not learn the outcome).
	Decide(ctx context.Context, items []Item) (allowed bool, ds []bucket.Decision, err error)
	// Refund gives back what an allowed Decide spent in the home's
	// store: the items whose decision had an At, each with it.
	Refund(ctx context.Context, items []Item) error
	// Handoff asks a region that was the home of items' keys before a
	// topology switch what their buckets count now (engine.Engine.Used
	// there), one count per item; the items' costs are not used.
	Handoff(ctx context.Context, items []Item) ([]float64, error)
	// Usage asks the home region what a check of items would see there
	// now, changing nothing (engine.Engine.Usage there): one answer per
	// item, a concurrency rule's leases free as its Remaining.
	Usage(ctx context.Context, items []Item) ([]bucket.Decision, error)
	// Settle settles in the home's store, once, the estimate a pinned
	// rule's check spent there (engine.Engine.SettleHere there); the
	// settlement's Limit is not sent: the home uses its rule's.
	Settle(ctx context.Context, s bucket.Settlement) (bucket.Settled, error)
}

// Item is one rule of a check forwarded to its key's home region.
type Item struct {
	Rule string
	Key  string
	Cost float64
	// MaxWait paces the forwarded check (request.Check.Pace): the same for
	// every item; the home reserves them at one instant and answers its
	// wait in the decisions.
	MaxWait time.Duration
	// At, in a Refund, is the instant the home's store spent the item at
	// (its Decide's bucket.Decision.At).
	At int64
}

// State is a topology calls are routed with and the Homes of its other
// regions, with the count of the calls and refunds using it.
type State struct {
	Topo *region.Topology // nil: no topology
	Gen  uint64
	// Regions is the number of regions (1 without a topology).
	Regions int
	Homes   map[string]Home
	// Switch is the switch that put it in force: the topology before it
	// (nil: the first of this process), since when, and the keys it moved
	// here whose buckets were seeded from their old homes (see handoff).
	Switch handoff.Switch
	// PrevHomes are the clients of the previous topology's regions, for
	// those this topology removed (see HoldPrevious).
	PrevHomes map[string]Home

	// holdPrev, when set, keeps prevState (the previous topology's own
	// state, its clients with it) in use until the longest handoff window
	// has passed.
	holdPrev  *time.Timer
	prevState *State
	users     atomic.Int64
	retired   atomic.Bool
	onIdle    func()
	idle      sync.Once
}

// NewState is the state of topo (nil: none), reaching its other regions
// through homes.
func NewState(topo *region.Topology, homes map[string]Home) *State {
	ts := &State{Topo: topo, Homes: homes, Regions: 1}
	if topo != nil {
		ts.Regions, ts.Gen = len(topo.Names()), topo.Generation()
	}
	return ts
}

// HomeOf is the home region that decides it (a check's) or holds it (a
// concurrency lease) under ts's topology, or "" for here, region: a
// pinned rule's key homed elsewhere, unless c was forwarded by a peer (a
// forwarded call is never forwarded again).
func (ts *State) HomeOf(region string, c *request.Request, it *request.Item) string {
	if !it.Entry.Pinned || ts.Topo == nil || c.Peer != "" {
		return ""
	}
	if home := ts.Topo.Home(it.Key, it.Rule.HomeKeys); home != region {
		return home
	}
	return ""
}

// Use counts ts as used (by a refund under way, say) until Release.
func (ts *State) Use() { ts.users.Add(1) }

// Release ends a use of ts (Use, Current.Use); the last one of a retired
// state runs its retire callback.
func (ts *State) Release() {
	if ts.users.Add(-1) == 0 && ts.retired.Load() {
		ts.idle.Do(ts.runIdle)
	}
}

// Retire marks ts replaced; f runs once no call or refund uses it.
func (ts *State) Retire(f func()) {
	ts.onIdle = f
	ts.retired.Store(true)
	if ts.users.Load() == 0 {
		ts.idle.Do(ts.runIdle)
	}
}

func (ts *State) runIdle() {
	if ts.onIdle != nil {
		ts.onIdle()
	}
}

// HoldPrevious keeps prev, the state ts replaces, in use (its clients
// open) for w: the keys ts moved here ask their old homes, a region ts
// removes included, within their handoff windows.
func (ts *State) HoldPrevious(prev *State, w time.Duration) {
	prev.Use()
	ts.prevState = prev
	ts.holdPrev = time.AfterFunc(w, prev.Release)
}

// StopHolding gives back at once the use of the previous state that
// HoldPrevious took, when its time has not passed yet.
func (ts *State) StopHolding() {
	if ts.holdPrev != nil && ts.holdPrev.Stop() {
		ts.prevState.Release()
	}
}

// Current is the State in force. The zero value holds none: Store one
// before any Use.
type Current struct{ p atomic.Pointer[State] }

// Load is the state in force, not counted as used.
func (c *Current) Load() *State { return c.p.Load() }

// Store puts ts in force.
func (c *Current) Store(ts *State) { c.p.Store(ts) }

// Swap puts ts in force and returns the state it replaces.
func (c *Current) Swap(ts *State) *State { return c.p.Swap(ts) }

// Use returns the state in force, counted as used until its Release. The
// second look tells a state retired meanwhile: its count was seen by
// Retire before it was taken here, so it is not used.
func (c *Current) Use() *State {
	for {
		ts := c.p.Load()
		ts.users.Add(1)
		if c.p.Load() == ts {
			return ts
		}
		ts.Release()
	}
}
