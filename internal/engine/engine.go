// Package engine decides checks: it is the one pipeline behind every front
// door (a check by rule id, by attributes, Envoy's rate limit service,
// forward-auth, and the checks other regions forward). A front door builds
// a request.Check (or, for concurrency rules, a concurrency.Acquire) from
// its request, calls Decide (or Acquire), and translates the items'
// decisions into its answer; the deny cache, leases, home-region
// forwarding, the store-failure policy and the decision metrics live in
// this package and the ones below it, and nowhere else.
//
// A call is one plan (plan.go): routed once, under one topology snapshot
// (homes.State), its stages run in order, each deciding some items and
// recording what it spent to be given back. An Acquire is a check with
// lease stages in front (acquireStages); a check has the rest
// (checkStages). The plan, the order and the failure policy are this
// package's; the stages' own work is the packages named on the right:
//
//	NewCheck / NewAcquire + Add...        request, concurrency
//	        |
//	        v
//	[Acquire] route leases: home | here   concurrency (Route)
//	[Acquire] leases at the keys' homes   concurrency (AtHomes)   undo: release there
//	[Acquire] leases here, one store call concurrency (Here)      undo: release here
//	        |
//	        v
//	deny cache ---- a denial known ---->  refused, nothing spent
//	        |                             pipeline.go, denycache
//	        v
//	route: home region | token lease | this region's store
//	        |                             pipeline.go, homes (HomeOf)
//	        v
//	home regions (forward)                homes (Forwarder)       undo: refund there
//	        v
//	token leases                          lease (Serve)           undo: tokens back
//	        v
//	handoff of moved keys                 handoff.go, handoff
//	        v
//	this region's store, one call         pipeline.go             undo: store undo
//	        v
//	shadow rules (refuse nothing)         pipeline.go
//	        v
//	counted                               tally
//
// A part that fails goes to the one failure policy (onFailure, policy.go;
// the lease stages reach it through concurrency.Policy): refused,
// uncertain or decided from a share of the limit. A call is all or
// nothing: the first stage that refuses or fails ends it, and unwind gives
// back, newest first, what the earlier stages spent, on contexts of their
// own (detached): a home region's refund runs on after the answer. A home
// that refuses a call as routed with a stale topology, when a newer one is
// in force, makes it unwound and routed again, once.
//
// The packages below it, none of which imports it: request (the rule
// table, a check's items, the errors of building one), concurrency (the
// concurrency leases: Acquire, its lease stages, a peer's Acquire, Release
// and Renew), homes (the topology a call is routed under, the clients of
// the other regions and the calls to them), handoff (the buckets of keys
// moved to a new home), denycache (refusals remembered), lease (token
// batches held by this instance), tally (what a decided check counts),
// reservation (a paced check's reserved slot), leaseid (the text of a
// concurrency lease id), inflight (the leases granted here, for the
// in-flight gauge), topkeys (the keys refused most) and metrics (the
// engine's Prometheus series).
package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/concurrency"
	"github.com/limiterd/limiterd/internal/engine/denycache"
	"github.com/limiterd/limiterd/internal/engine/handoff"
	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/inflight"
	"github.com/limiterd/limiterd/internal/engine/lease"
	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/reservation"
	"github.com/limiterd/limiterd/internal/engine/settlement"
	"github.com/limiterd/limiterd/internal/engine/tally"
	"github.com/limiterd/limiterd/internal/engine/topkeys"
	"github.com/limiterd/limiterd/internal/engine/usage"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
)

// Defaults of Options.
const (
	// DefaultDenyCacheSize is the default number of denials remembered.
	DefaultDenyCacheSize = 100_000
	// DefaultForwardTimeout allows a cross-region round trip (50-150 ms)
	// with room for one slow one.
	DefaultForwardTimeout = 300 * time.Millisecond
	// DefaultFallbackMaxBytes bounds the fallback's buckets: about 340k
	// token buckets of 20-byte keys.
	DefaultFallbackMaxBytes = 64 << 20
)

// Errors of Decide (those of building a check are the request package's).
// Front doors test them with errors.Is and errors.As and translate them
// into their own statuses.
var (
	// ErrUnavailable: a fail-closed rule could not be decided (its store,
	// or its key's home region, did not answer).
	ErrUnavailable = errors.New("rule undecided and it fails closed")
	// ErrOverloaded: the check waited in this process too long for the
	// store; nothing was spent. It says limiterd is busy, not the store.
	ErrOverloaded = errors.New("overloaded: the check waited too long to reach the store")
	// ErrNotSettled: the store did not settle a settlement (it did not
	// answer, or may have without the answer coming back); a Settle
	// again is safe.
	ErrNotSettled = errors.New("not settled: the store did not answer; settle again")
)

// errReroute: a home refused the check as routed with a stale topology and
// a newer one is in force now: the check is routed again, once.
var errReroute = errors.New("routed with a stale topology")

// Options configure an Engine. Store is required.
type Options struct {
	// Store is this region's shared store.
	Store bucket.Backend
	// Region is this region; Topology, when set, the regions that pinned
	// rules' keys have as homes, reached through Homes (one per other region).
	Region   string
	Topology *region.Topology
	Homes    map[string]homes.Home
	// ReloadTopology, when set, reads the topology again (and puts a newer
	// one in force through SetTopology before it returns); it is called when
	// a home refuses a forward as routed with a stale topology.
	ReloadTopology func()
	// ForwardTimeout bounds a check forwarded to a home region (0:
	// DefaultForwardTimeout).
	ForwardTimeout time.Duration
	// HandoffMaxWindow, when above 0, caps the handoff window of every
	// rule (see handoff): past it a moved key starts from a full bucket.
	HandoffMaxWindow time.Duration
	// DenyCacheSize bounds the deny cache (0: DefaultDenyCacheSize; < 0: off).
	DenyCacheSize int
	// FallbackMaxBytes bounds the memory of the local fallback's buckets,
	// which decide fail-open rules while the store is down (0:
	// DefaultFallbackMaxBytes).
	FallbackMaxBytes int64
	// MaxLeaseKeys bounds the keys holding a lease (0: lease.DefaultMaxKeys).
	MaxLeaseKeys int
	// FleetSize returns the live number of limiterd instances in this
	// region (at least 1); a fail-open rule whose store is down decides
	// with limit / FleetSize(). Nil: 1.
	FleetSize func() int
	// Leases holds the leases of concurrency rules; nil: Store.
	Leases bucket.LeaseStore
	// Spends, when set, receives what reconciled rules admit.
	Spends tally.SpendRecorder
	// SpendSpans, when set, receives the span context of each sampled
	// check whose spends Spends received.
	SpendSpans tally.SpanRecorder
	// Resets, when set, receives the keys of reconciled rules reset here
	// (ResetKey), for the other regions.
	Resets ResetRecorder
	// KeyAffinity says the gateways send each key to one instance of the
	// region: its spends are held in one place, so this instance holds a
	// key's whole spend budget, not its share (the budget / FleetSize()).
	KeyAffinity bool
	// TopLimitedSize is the counters per rule of the keys refused most
	// (topkeys; 0: topkeys.DefaultSize; < 0: off).
	TopLimitedSize int
	// ReservationSecret, when set, keys the MACs of reservations
	// (Reservation) and settlements (Settlement), each under a key of its
	// own derived from it: the processes of a fleet that share it give
	// back and settle each other's. Nil: random keys, so that only this
	// engine gives back and settles its own.
	ReservationSecret []byte
	// Classes are the priority classes of checks, most important first
	// (nil: rules.DefaultClasses). A rule whose reserve names another is
	// refused (SetRules).
	Classes *rules.Classes
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Engine decides checks. Make it with New; it is safe for concurrent use.
type Engine struct {
	store    bucket.Backend
	fallback *bucket.Memory
	table    atomic.Pointer[request.Table]
	gen      atomic.Uint64
	rulesMu  sync.Mutex
	deny     *denycache.Cache
	leases   *lease.Leases
	// top counts the keys each rule refused (shadow rules: would have).
	top    *topkeys.Tracker
	region string
	topo   homes.Current
	reload func()
	fwdTO  time.Duration
	// handoffs seed the buckets of the keys moved here.
	handoffs handoff.Handoff
	fleet    func() int
	// tally counts decided checks.
	tally tally.Tally
	// conc holds the leases of concurrency rules; inflight counts those
	// this instance granted.
	conc     *concurrency.Leases
	inflight *inflight.Tracker
	log      *slog.Logger
	m        *metrics.Metrics
	// fwd makes the calls to home regions, the refunds still under way
	// among them.
	fwd homes.Forwarder
	// res names paced checks' reservations and gives them back.
	res *reservation.Book
	// resets carries keys reset here to the other regions.
	resets ResetRecorder
	// settle names the spends of checks that spent an estimate, and
	// settles them; now reads the clock their expiries are on.
	settle *settlement.Book
	now    func() time.Time
	// classes are the priority classes of checks.
	classes *rules.Classes
}

// New makes an engine with the rules of set, registering its metrics on reg.
func New(opts Options, set *rules.Set, reg prometheus.Registerer) (*Engine, error) {
	if opts.Store == nil {
		return nil, errors.New("engine: no store")
	}
	if opts.ForwardTimeout <= 0 {
		opts.ForwardTimeout = DefaultForwardTimeout
	}
	if opts.DenyCacheSize == 0 {
		opts.DenyCacheSize = DefaultDenyCacheSize
	}
	if opts.FleetSize == nil {
		opts.FleetSize = func() int { return 1 }
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Classes == nil {
		opts.Classes = rules.DefaultClassList()
	}
	m, err := metrics.New(reg)
	if err != nil {
		return nil, err
	}
	m.Classes(opts.Classes.Names())
	e := &Engine{
		store: opts.Store, fallback: bucket.NewMemory(bucket.WithMaxBytes(cmp.Or(opts.FallbackMaxBytes, DefaultFallbackMaxBytes))),
		deny: denycache.New(opts.DenyCacheSize), leases: lease.New(opts.MaxLeaseKeys), top: topkeys.New(opts.TopLimitedSize),
		region: opts.Region, reload: opts.ReloadTopology, fwdTO: opts.ForwardTimeout,
		handoffs: handoff.Handoff{Region: opts.Region, MaxWindow: opts.HandoffMaxWindow, Store: opts.Store, Results: m.Handoffs},
		fleet:    opts.FleetSize, log: opts.Logger, m: m,
		res:    reservation.NewBook(opts.ReservationSecret, opts.Store, m.Invalid),
		resets: opts.Resets,
		settle: settlement.NewBook(opts.ReservationSecret, m.Invalid), now: time.Now,
		classes: opts.Classes,
	}
	ts := homes.NewState(opts.Topology, opts.Homes)
	if opts.Topology != nil {
		if prev := opts.Topology.Previous(); prev != nil {
			// Started on a topology that names the one before it: the
			// keys it moved here take their buckets from their old homes,
			// within their windows from its effective_at.
			ts.Switch.Prev, ts.Switch.Since = prev, opts.Topology.EffectiveAt()
		}
	}
	e.topo.Store(ts)
	e.tally = tally.Tally{Metrics: m, Top: e.top, Spends: opts.Spends, Spans: opts.SpendSpans, Fleet: e.fleet, KeyAffinity: opts.KeyAffinity}
	e.fwd = homes.Forwarder{Timeout: e.fwdTO, Detached: e.detached, Refunds: m.Refunds, Log: e.log}
	for name := range opts.Homes {
		m.Stale.WithLabelValues(name)
	}
	e.inflight = inflight.New(func() []string {
		var out []string
		for _, r := range e.table.Load().Set.Rules() {
			if r.Concurrent() {
				out = append(out, r.ID)
			}
		}
		return out
	}, m.Untracked, e.log)
	e.conc = concurrency.New(concurrency.Options{
		Region: e.region, Store: cmp.Or[bucket.LeaseStore](opts.Leases, opts.Store), Fallback: e.fallback, Fleet: e.fleet,
		Topology: &e.topo, Table: &e.table, Inflight: e.inflight, Metrics: m, Log: e.log,
		ForwardTimeout: e.fwdTO, Detached: e.detached, Policy: leasePolicy{e}, Top: e.top,
	})
	sizes := []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "limiter_lease_keys",
			Help: "Keys holding a lease (or taking one), expired ones not yet swept included.",
		}, func() float64 { return float64(e.leases.Len()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "limiter_lease_table_full_total",
			Help: "Checks of lease rules decided without a lease because the lease table was full.",
		}, func() float64 { return float64(e.leases.Full()) }),
	}
	sizes = append(sizes, e.inflight)
	sizes = append(sizes, metrics.MemoryCollectors(e.fallback, "fallback")...)
	if e.deny != nil {
		dc := e.deny
		sizes = append(sizes, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "limiter_deny_cache_entries",
			Help: "Denials held by the deny cache.",
		}, func() float64 { return float64(dc.Len()) }))
	}
	for _, c := range sizes {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	if err := e.SetRules(set); err != nil {
		return nil, err
	}
	return e, nil
}

// SetRules puts set in force for every check that starts from now on. A
// set whose pinned rules name a home region the topology lacks is refused
// (the rules in force stay). Denials remembered under the old rules are
// forgotten, and the metric series of rules no longer in force removed.
func (e *Engine) SetRules(set *rules.Set) error {
	e.rulesMu.Lock()
	defer e.rulesMu.Unlock()
	ts := e.topo.Load()
	if err := validateHomes(ts.Topo, set); err != nil {
		return err
	}
	for _, r := range set.Rules() {
		if err := e.classes.CheckRule(r); err != nil {
			return err
		}
	}
	e.install(set, ts.Regions)
	// The refused keys of rules that are gone go with them.
	e.top.Forget(func(id string) bool { return set.Get(id) != nil })
	return nil
}

// Classes are the priority classes of checks, most important first.
func (e *Engine) Classes() *rules.Classes { return e.classes }

// Rules is the rule set checks starting now are decided with.
func (e *Engine) Rules() *rules.Set { return e.table.Load().Set }

// NewUsage starts a usage request under the rules in force.
func (e *Engine) NewUsage() *usage.Request { return usage.NewRequest(e.table.Load(), e.m) }

// Usage reads what a check of u's rules would see now (see the usage package).
func (e *Engine) Usage(ctx context.Context, u *usage.Request) error {
	ts := e.topo.Use()
	defer ts.Release()
	return (&usage.Reader{Store: e.store, Region: e.region, Timeout: e.fwdTO}).Read(ctx, ts, u)
}

// NewCheck starts a check under the rules in force now.
func (e *Engine) NewCheck() *request.Check { return request.NewCheck(e.table.Load(), e.m) }

// Invalid counts a request a front door refused as invalid before its
// check was built, by the field at fault (rule_id, key, cost, attributes).
func (e *Engine) Invalid(field string) { e.m.Invalid.WithLabelValues(field).Inc() }

// Observe records the time a front door took to answer one check.
func (e *Engine) Observe(seconds float64) { e.m.Duration.Observe(seconds) }

// TopLimited returns the k keys the rule refused most in the last one to
// two topkeys.Window (a shadow rule: would have refused), most first.
func (e *Engine) TopLimited(ruleID string, k int) []topkeys.Entry {
	return e.top.Top(ruleID, k, time.Now().UnixNano())
}

// TopLimitedRules returns the rules that refused a key in that time.
func (e *Engine) TopLimitedRules() []string { return e.top.Rules(time.Now().UnixNano()) }

// TopLimitedSize is the counters per rule of TopLimited (0: off).
func (e *Engine) TopLimitedSize() int { return e.top.Size() }

// validateHomes checks that set's pinned rules name only regions of topo.
func validateHomes(topo *region.Topology, set *rules.Set) error {
	if topo == nil {
		return nil
	}
	for _, r := range set.Rules() {
		if err := topo.ValidateHomes(r.HomeKeys); err != nil {
			return fmt.Errorf("rule %q: home_keys: %w", r.ID, err)
		}
	}
	return nil
}

// SetTopology routes every check that starts from now on with topo, through
// homes (one per other region). When the checks and refunds that started
// under the topology it replaces are over, retired (when set) runs: the
// caller closes the connections only the old one used then. A topology
// under which the rules in force are invalid is refused. A change of the
// number of regions changes the share of the limit each region decides
// with when a key's home does not answer; denials remembered are
// forgotten, since keys moved home. The keys it moves here take their
// buckets from their old homes (see handoff): those of topo's
// previous_regions when it names them, else those of the topology it
// replaces; when that removes a region, retired waits for the longest
// handoff window too (or StopHandoffs).
func (e *Engine) SetTopology(topo *region.Topology, clients map[string]homes.Home, retired func()) error {
	e.rulesMu.Lock()
	defer e.rulesMu.Unlock()
	set := e.table.Load().Set
	if err := validateHomes(topo, set); err != nil {
		return err
	}
	for name := range clients {
		e.m.Stale.WithLabelValues(name)
	}
	ts := homes.NewState(topo, clients)
	cur := e.topo.Load()
	if topo != nil {
		if prev := topo.Previous(); prev != nil {
			// The file names the regions before it: every process hands
			// off the same keys, within windows from the same instant.
			ts.Switch.Prev, ts.Switch.Since = prev, topo.EffectiveAt()
		} else if cur.Topo != nil {
			ts.Switch.Prev, ts.Switch.Since = cur.Topo, time.Now()
		}
	}
	if ts.Switch.Prev != nil {
		// The keys this switch moves here take their buckets from their
		// old homes, a region it removes included: cur, with its clients,
		// stays in use for the longest handoff window.
		ts.PrevHomes = cur.Homes
		w, rule := e.handoffs.Longest(set)
		if w > 0 && removesRegion(ts.Switch.Prev, topo) && cur.Topo != nil {
			ts.HoldPrevious(cur, w)
		}
		if w > 0 {
			e.log.Info("keys this topology moves here take their old homes' buckets until the longest handoff window has passed",
				"generation", topo.Generation(), "previous_regions", ts.Switch.Prev.Names(), "until", ts.Switch.Since.Add(w).UTC().Format(time.RFC3339), "rule", rule)
		}
	}
	old := e.topo.Swap(ts)
	// The topology before old is not asked any more.
	old.StopHolding()
	e.install(set, ts.Regions)
	old.Retire(retired)
	return nil
}

// Topology is the topology checks starting now are routed with.
func (e *Engine) Topology() *region.Topology { return e.topo.Load().Topo }

// install puts set in force, decided with regions' shares. Called with
// rulesMu held.
func (e *Engine) install(set *rules.Set, regions int) {
	gen := e.gen.Add(1)
	old := e.table.Load()
	t := request.NewTable(set, gen, regions, e.classes, e.m, old)
	e.table.Store(t)
	if e.deny != nil {
		e.deny.Reset(gen)
	}
	if old != nil {
		for id := range old.ByID {
			if t.ByID[id] == nil {
				e.m.Forget(id)
			}
		}
	}
}

// StopHandoffs gives up the handoff windows still open: the previous
// topology's clients are released (and closed by its retire callback) now,
// not when the longest window has passed. Call it when the process stops.
func (e *Engine) StopHandoffs() {
	e.rulesMu.Lock()
	defer e.rulesMu.Unlock()
	e.topo.Load().StopHolding()
}

// LeftOver is what a lease still holds at shutdown.
type LeftOver struct {
	Rule, Key string
	Limit     bucket.Limit
	Tokens    float64
}

// DrainLeases empties every lease and returns the unexpired leftovers, to
// give back to the shared buckets when this instance stops. Checks after
// it take new leases.
func (e *Engine) DrainLeases() []LeftOver {
	t := e.table.Load()
	var out []LeftOver
	for _, l := range e.leases.Drain() {
		if en := t.ByID[l.Rule]; en != nil {
			out = append(out, LeftOver{Rule: l.Rule, Key: l.Key, Limit: en.For(l.Key).Limit, Tokens: l.Tokens})
		}
	}
	return out
}

// Wait waits for the refunds to home regions still under way, or ctx.
func (e *Engine) Wait(ctx context.Context) error { return e.fwd.Wait(ctx) }

// detached is a context for what must be done whether or not the caller
// still waits: giving back what a refused check or Acquire took (undos,
// refunds, leases, here or at a home region) and asking a moved key's old
// home. It keeps ctx's values, not its cancellation or deadline, and has
// one deadline of its own: the forward timeout, at least ReleaseTimeout.
func (e *Engine) detached(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), max(ReleaseTimeout, e.fwdTO))
}

// Refund gives back what an allowed Decide of a peer region's check spent
// in this region's store, the keys' home (the Peer service's Refund): each
// item at the instant its decision's At named. Items of rules no longer in
// force are skipped; costs are normalized against the rule as Decide did.
func (e *Engine) Refund(ctx context.Context, items []homes.Item) error {
	t := e.table.Load()
	reqs := make([]bucket.Request, 0, len(items))
	ats := make([]int64, 0, len(items))
	for i, it := range items {
		en := t.ByID[it.Rule]
		if en == nil {
			continue
		}
		lim := en.For(it.Key).Limit
		cost, err := lim.NormalizeCost(it.Cost)
		if err != nil {
			return &request.InvalidError{Field: fmt.Sprintf("items[%d].cost", i), Err: err}
		}
		if it.At <= 0 {
			return request.Invalid(fmt.Sprintf("items[%d].spent_at_us", i), "items[%d].spent_at_us: %d: want the instant the item was spent at (µs since the Unix epoch, > 0)", i, it.At)
		}
		reqs = append(reqs, bucket.Request{Rule: it.Rule, Key: it.Key, Limit: lim, Cost: cost})
		ats = append(ats, it.At)
	}
	if len(reqs) == 0 {
		return nil
	}
	if e.deny != nil {
		// Tokens came back: a denial remembered meanwhile may not hold.
		for _, r := range reqs {
			e.deny.Forget(r.Rule, r.Key)
		}
	}
	return undoAt(ctx, e.store, reqs, ats)
}

// undoAt gives reqs back, each spent at the instant of ats (µs, the
// store's clock), in one Undo per instant.
func undoAt(ctx context.Context, u bucket.Undoer, reqs []bucket.Request, ats []int64) error {
	var errs []error
	for i, at := range ats {
		if slices.Contains(ats[:i], at) {
			continue // given back with the first of its instant
		}
		var group []bucket.Request
		for j := i; j < len(reqs); j++ {
			if ats[j] == at {
				group = append(group, reqs[j])
			}
		}
		if err := u.Undo(ctx, group, time.UnixMicro(at)); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removesRegion reports whether next lacks a region of cur.
func removesRegion(cur, next *region.Topology) bool {
	for _, n := range cur.Names() {
		if !next.Has(n) {
			return true
		}
	}
	return false
}
