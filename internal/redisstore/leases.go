package redisstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// LeaseKey is the Redis key of the lease set of key under a concurrency
// rule: rl:{key}:rule~c. The hash tag is the client's, as for its buckets;
// '~' is never in a rule id, so the set never takes the name of a bucket
// (a rule whose algorithm changes to concurrency starts afresh).
func LeaseKey(rule, key string) string { return Key(rule, key) + "~c" }

// AdaptiveKey is the Redis key of the adaptive limit of key under a
// concurrency rule, beside its lease set (same slot): rl:{key}:rule~a.
func AdaptiveKey(rule, key string) string { return Key(rule, key) + "~a" }

// leaseGroup is the requests of one client: one slot, one script.
type leaseGroup struct {
	idx  []int
	reqs []bucket.LeaseRequest
	keys []string
	// akeys are the keys' adaptive limits, for the acquire and release
	// scripts.
	akeys []string
	res   []any
	err   error
}

func leaseGroups(reqs []bucket.LeaseRequest) []*leaseGroup {
	var groups []*leaseGroup
	for _, idx := range byKey(reqs, func(r bucket.LeaseRequest) string { return r.Key }) {
		g := &leaseGroup{idx: idx}
		for _, i := range idx {
			g.reqs = append(g.reqs, reqs[i])
			g.keys = append(g.keys, LeaseKey(reqs[i].Rule, reqs[i].Key))
			g.akeys = append(g.akeys, AdaptiveKey(reqs[i].Rule, reqs[i].Key))
		}
		groups = append(groups, g)
	}
	return groups
}

// runLeases runs the script of operation o (0 acquire, 1 release, 2 renew)
// for every group, concurrently, with the arguments args makes of each.
func (s *Store) runLeases(ctx context.Context, o int, groups []*leaseGroup, args func(g *leaseGroup) []any) {
	ops := [3]op{opAcquire, opRelease, opRenew}
	run := func(g *leaseGroup) {
		keys := slices.Concat(g.keys, g.akeys)
		g.res, g.err = s.eval(ctx, ops[o], g.keys[0], pipeline.Call{Script: leaseScripts[o], Keys: keys, Args: args(g)}, s.m.leaseDuration[o])
		if g.err == nil && len(g.res) != len(g.keys)*[3]int{4, 1, 4}[o] {
			g.err = fmt.Errorf("%w: %s reply has %d elements for %d keys", bucket.ErrOutcomeUnknown, opNames[ops[o]], len(g.res), len(g.keys))
		}
	}
	var wg sync.WaitGroup
	for _, g := range groups[1:] {
		wg.Go(func() { run(g) })
	}
	run(groups[0])
	wg.Wait()
}

// acquireDecision reads the k-th decision of an acquire's or a renew's
// reply, which ends with the key's limit.
func acquireDecision(res []any, k int) (bucket.LeaseDecision, error) {
	l, ok := res[4*k+3].(int64)
	if !ok {
		return bucket.LeaseDecision{}, fmt.Errorf("unexpected lease reply %v", res)
	}
	return leaseReply(res[4*k:4*k+3], int(l))
}

func leaseReply(res []any, limit int) (bucket.LeaseDecision, error) {
	ok, n, t := res[0], res[1], res[2]
	a, ok1 := ok.(int64)
	held, ok2 := n.(int64)
	us, ok3 := t.(int64)
	if !ok1 || !ok2 || !ok3 {
		return bucket.LeaseDecision{}, fmt.Errorf("unexpected lease reply %v", res)
	}
	// a: 1 held, 0 refused (an acquire at the limit; a renew: gone), 2
	// an acquire refused for what its class keeps.
	d := bucket.LeaseDecision{Allowed: a == 1, InFlight: int(held), Limit: limit, Reserved: a == 2}
	switch {
	case a == 1 && us > 0:
		d.Expires = time.UnixMicro(us)
	case a != 1:
		d.RetryAfter = time.Duration(us) * time.Microsecond
	}
	return d, nil
}

// Acquire takes member's lease of every request, all or nothing: the
// leases of one client are taken by one script, those of different clients
// (different slots) by one script each, and when any refuses, the others'
// are given back by the release script. Between the two another acquire may
// find a slot taken: a refusal a little early, never a lease too many.
// When some clients' scripts fail, the error is a *bucket.MultiError (as
// TakeAll's) and every lease taken, or perhaps taken, is given back.
func (s *Store) Acquire(ctx context.Context, reqs []bucket.LeaseRequest, member string) ([]bucket.LeaseDecision, error) {
	if len(reqs) == 0 {
		return nil, nil
	}
	groups := leaseGroups(reqs)
	s.runLeases(ctx, 0, groups, func(g *leaseGroup) []any {
		return AcquireArgs(member, g.reqs)
	})
	out := make([]bucket.LeaseDecision, len(reqs))
	var errs []error
	refused := false
	for _, g := range groups {
		if g.err == nil {
			for k, i := range g.idx {
				if out[i], g.err = acquireDecision(g.res, k); g.err != nil {
					break
				}
				refused = refused || !out[i].Allowed
			}
		}
		if g.err != nil {
			if errs == nil {
				errs = make([]error, len(reqs))
			}
			for _, i := range g.idx {
				errs[i] = fmt.Errorf("eval acquire: %w", g.err)
			}
		}
	}
	if refused || errs != nil {
		// Give back what was taken, and what may have been (an unknown
		// outcome): releasing a lease not held changes nothing.
		var back []*leaseGroup
		for _, g := range groups {
			if g.err == nil && refused && !allHeld(out, g.idx) {
				continue // this client refused: it took nothing
			}
			if g.err != nil && !errors.Is(g.err, bucket.ErrOutcomeUnknown) {
				continue // not applied
			}
			back = append(back, g)
		}
		if len(back) > 0 {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), UndoTimeout)
			s.runLeases(rctx, 1, back, func(g *leaseGroup) []any { return ReleaseArgs(member, withoutSamples(g.reqs)) })
			cancel()
		}
		if refused && errs == nil {
			for i := range out {
				if out[i].Allowed {
					// Given back: it would have been held.
					out[i].Expires = time.Time{}
				}
			}
		}
	}
	if errs != nil {
		return out, &bucket.MultiError{Errs: errs}
	}
	return out, nil
}

func allHeld(ds []bucket.LeaseDecision, idx []int) bool {
	for _, i := range idx {
		if !ds[i].Allowed || ds[i].Expires.IsZero() {
			return false
		}
	}
	return true
}

// Release gives member's leases back; one not held is no error.
func (s *Store) Release(ctx context.Context, reqs []bucket.LeaseRequest, member string) ([]bool, error) {
	if len(reqs) == 0 {
		return nil, nil
	}
	groups := leaseGroups(reqs)
	s.runLeases(ctx, 1, groups, func(g *leaseGroup) []any { return ReleaseArgs(member, g.reqs) })
	out := make([]bool, len(reqs))
	var errs []error
	for _, g := range groups {
		if g.err != nil {
			errs = append(errs, fmt.Errorf("eval release: %w", g.err))
			continue
		}
		for k, i := range g.idx {
			n, _ := g.res[k].(int64)
			out[i] = n == 1
		}
	}
	return out, errors.Join(errs...)
}

// Renew extends member's leases by their TTL from now; a decision not
// allowed says that lease is gone.
func (s *Store) Renew(ctx context.Context, reqs []bucket.LeaseRequest, member string) ([]bucket.LeaseDecision, error) {
	if len(reqs) == 0 {
		return nil, nil
	}
	groups := leaseGroups(reqs)
	s.runLeases(ctx, 2, groups, func(g *leaseGroup) []any { return AcquireArgs(member, g.reqs) })
	out := make([]bucket.LeaseDecision, len(reqs))
	var errs []error
	for _, g := range groups {
		if g.err == nil {
			for k, i := range g.idx {
				if out[i], g.err = acquireDecision(g.res, k); g.err != nil {
					break
				}
			}
		}
		if g.err != nil {
			errs = append(errs, fmt.Errorf("eval renew: %w", g.err))
		}
	}
	return out, errors.Join(errs...)
}

var _ bucket.LeaseStore = (*Store)(nil)

// AcquireArgs are the acquire script's arguments of member's leases of
// reqs (keys of one client); the renew script's too, which reads no Keep.
// Each request's Keep comes after them all, in the shortest form that
// reads back as the same float64.
func AcquireArgs(member string, reqs []bucket.LeaseRequest) []any {
	args := make([]any, 0, 1+5*len(reqs))
	args = append(args, member)
	for _, r := range reqs {
		a := r.Limit.Adaptive
		args = append(args, strconv.Itoa(r.Limit.Limit), strconv.FormatInt(r.Limit.TTL.Microseconds(), 10), strconv.Itoa(a.Min), strconv.Itoa(a.Max))
	}
	for _, r := range reqs {
		args = append(args, strconv.FormatFloat(r.Keep, 'g', -1, 64))
	}
	return args
}

// ReleaseArgs are the release script's arguments of member's leases of
// reqs (keys of one client), with their samples.
func ReleaseArgs(member string, reqs []bucket.LeaseRequest) []any {
	args := make([]any, 0, 1+6*len(reqs))
	args = append(args, member)
	for _, r := range reqs {
		a := r.Limit.Adaptive
		dur, failed := int64(-1), "0"
		if r.Sample != nil {
			dur = r.Sample.Duration.Microseconds()
			if r.Sample.Failed {
				failed = "1"
			}
		}
		args = append(args, strconv.Itoa(r.Limit.Limit), strconv.Itoa(a.Min), strconv.Itoa(a.Max), strconv.FormatInt(a.Target.Microseconds(), 10),
			strconv.FormatInt(dur, 10), failed)
	}
	return args
}

// withoutSamples is reqs without their samples: an Acquire that gives
// its leases back reports no request.
func withoutSamples(reqs []bucket.LeaseRequest) []bucket.LeaseRequest {
	out := slices.Clone(reqs)
	for i := range out {
		out[i].Sample = nil
	}
	return out
}
