package engine

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/limiterd/limiterd/internal/engine/concurrency"
	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// plan is one call to Decide or Acquire, routed once under one topology
// snapshot: where each item is decided, and an undo stack of what the
// call's stages spent. The stages run in order (checkStages,
// acquireStages); each that spends pushes its undo; the first that
// refuses or fails ends the call, and unwind gives back, newest first,
// what the earlier stages spent: a home region's spends by a refund,
// tokens to this instance's lease, this region's store spends by an undo
// at their instants, an Acquire's leases here and at the keys' homes.
type plan struct {
	ts *homes.State
	// rerouted: the call is routed a second time, after a home refused it
	// as routed with a stale topology.
	rerouted bool

	// The rate rules by where they are decided (routeStage): the home
	// regions of pinned ones, in order, and their items; the ones with
	// token leases; this region's store (with those whose home failed
	// open, and lease batches taken).
	homes  []string
	remote map[string][]*request.Item
	leased []*request.Item
	local  []*request.Item

	// An Acquire's concurrency rules (acquireStages), as their lease
	// stages hold them.
	leases concurrency.Hold

	undo []undoStep

	// traced: the call's span records (it is sampled; see runStages).
	traced bool
}

// stage is one step of a call: it decides some of the plan's items and
// says whether the call goes on (true) or is refused (false, or an error,
// the call's answer). What it spent it pushes onto the undo stack. (The
// stages are named, not function values, so that a plan stays on its
// caller's stack.)
type stage uint8

const (
	leaseRouteStage stage = iota
	leaseHomeStage
	leaseHereStage
	denyStage
	routeStage
	homeStage
	tokenLeaseStage
	storeStage
)

// stageNames name the stages in a trace's events.
var stageNames = [...]string{
	leaseRouteStage: "lease route", leaseHomeStage: "lease at home", leaseHereStage: "lease here",
	denyStage: "deny cache", routeStage: "route", homeStage: "home regions", tokenLeaseStage: "token lease", storeStage: "store",
}

func (s stage) String() string { return stageNames[s] }

// checkStages are a check's stages, in order (see Decide).
var checkStages = []stage{denyStage, routeStage, homeStage, tokenLeaseStage, storeStage}

// acquireStages are an Acquire's: its concurrency rules' leases, at their
// keys' homes and then here, then its rate rules as a check's.
var acquireStages = append([]stage{leaseRouteStage, leaseHomeStage, leaseHereStage}, checkStages...)

func (e *Engine) runStage(ctx context.Context, c *request.Request, p *plan, s stage) (bool, error) {
	switch s {
	case leaseRouteStage:
		e.conc.Route(p.ts, &p.leases)
		return true, nil
	case leaseHomeStage:
		ok, err := e.conc.AtHomes(ctx, p.ts, p.rerouted, &p.leases)
		p.leasesTaken()
		return ok, err
	case leaseHereStage:
		ok, err := e.conc.Here(ctx, &p.leases)
		p.leasesTaken()
		return ok, err
	case denyStage:
		return e.denied(c, p)
	case routeStage:
		return e.route(c, p)
	case homeStage:
		return e.atHomes(ctx, c, p)
	case tokenLeaseStage:
		return e.fromLeases(ctx, p)
	default:
		return e.inStore(ctx, c, p)
	}
}

// undoKind is what an undo step gives back.
type undoKind uint8

const (
	// undoRefund: a home region's spends of items, refunded there.
	undoRefund undoKind = iota
	// undoTokens: items' tokens, to this instance's leases.
	undoTokens
	// undoStore: this region's store spends reqs of items, undone at the
	// store's instants.
	undoStore
	// undoLeases: an Acquire's leases, here and at their homes (what its
	// hold recorded).
	undoLeases
)

type undoStep struct {
	kind  undoKind
	home  string
	items []*request.Item
	reqs  []bucket.Request
}

func (p *plan) push(s undoStep) { p.undo = append(p.undo, s) }

// leasesTaken pushes the undo of the lease stages, once they took a lease:
// what they take they record in the hold, given back below (after) what
// the later stages spent.
func (p *plan) leasesTaken() {
	if len(p.undo) == 0 && p.leases.Taken() {
		p.push(undoStep{kind: undoLeases})
	}
}

// run routes a check (a == nil) or an Acquire under the topology in force
// and runs its stages. When a home refuses it as routed with a stale
// topology and reading the topology again puts a newer one in force
// (errReroute), what it spent is given back and it is routed again, once,
// under the newer one.
func (e *Engine) run(ctx context.Context, c *request.Request, a *concurrency.Acquire) (bool, *concurrency.Lease, error) {
	stages := checkStages
	if a != nil && len(a.Leases()) > 0 {
		stages = acquireStages
	} else {
		a = nil
	}
	for rerouted := false; ; rerouted = true {
		ts := e.topo.Use()
		p := plan{ts: ts, rerouted: rerouted}
		if a != nil {
			p.leases = concurrency.Holding(a)
		}
		allowed, err := e.decideUnder(ctx, c, &p, stages)
		var l *concurrency.Lease
		switch {
		case a == nil:
		case err == nil && allowed:
			l = e.conc.Granted(&p.leases)
		case p.leases.Held():
			// The rate rules refused: the leases held were given back.
			a.GivenBack()
		}
		ts.Release()
		if !rerouted && errors.Is(err, errReroute) {
			continue
		}
		return allowed, l, err
	}
}

// runStages runs stages in order until one refuses or fails; then it
// gives back what the earlier ones spent.
func (e *Engine) runStages(ctx context.Context, c *request.Request, p *plan, stages []stage) (bool, error) {
	allowed, err := true, error(nil)
	// A sampled call's span (see internal/tracing) gets an event per
	// stage, with its time; the rest pay for one context lookup.
	span := trace.SpanFromContext(ctx)
	traced := span.IsRecording()
	p.traced = traced
	var began time.Time
	for _, st := range stages {
		if traced {
			began = time.Now()
		}
		allowed, err = e.runStage(ctx, c, p, st)
		if traced {
			stageEvent(span, st, began, allowed, err)
		}
		if err != nil || !allowed {
			allowed = false
			break
		}
	}
	if !allowed {
		if traced {
			began = time.Now()
		}
		e.unwind(ctx, p)
		if traced && len(p.undo) > 0 {
			span.AddEvent("undo", trace.WithAttributes(attribute.Int("steps", len(p.undo)),
				attribute.Int64("duration_us", time.Since(began).Microseconds())))
		}
	}
	// The lease batches the check took end on every return, once what a
	// refusal gave back is back: the key's other checks wait for them.
	e.leases.EndBatches(p.local, allowed)
	return allowed, err
}

// unwind gives back, newest first, what the plan's stages spent, on
// contexts of their own (see detached): the caller may be gone. A home
// region's refund runs on after the answer.
func (e *Engine) unwind(ctx context.Context, p *plan) {
	for i := len(p.undo) - 1; i >= 0; i-- {
		s := &p.undo[i]
		switch s.kind {
		case undoRefund:
			e.fwd.Refund(ctx, p.ts, s.home, s.items)
		case undoTokens:
			for _, it := range s.items {
				e.leases.GiveBack(it.Rule.ID, it.Key, it.Cost)
			}
		case undoStore:
			// Each at the store's instant of its spend: a window rule
			// gives back to the window it counted in.
			ats := make([]int64, len(s.items))
			for i, it := range s.items {
				ats[i] = it.Decision.At
			}
			uctx, cancel := e.detached(ctx)
			if err := undoAt(uctx, e.store, s.reqs, ats); err != nil {
				e.log.Warn("a refused check's store spends not given back", "err", err)
			}
			cancel()
		case undoLeases:
			e.conc.Unwind(ctx, p.ts, &p.leases)
		}
	}
	p.undo = p.undo[:0]
}

// stageEvent records stage st of a traced call, begun at began.
func stageEvent(span trace.Span, st stage, began time.Time, allowed bool, err error) {
	attrs := []attribute.KeyValue{attribute.Int64("duration_us", time.Since(began).Microseconds()), attribute.Bool("go_on", allowed && err == nil)}
	if err != nil {
		attrs = append(attrs, attribute.String("error", err.Error()))
	}
	span.AddEvent(st.String(), trace.WithAttributes(attrs...))
}
