package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// UndoTimeout bounds the undo of a refused all-or-nothing check. The undo
// runs on a context of its own (the caller's values, not its deadline or
// cancellation, which may have passed by then), so the tokens spent for a
// refused check are given back even when its caller gave up.
const UndoTimeout = 100 * time.Millisecond

// group is the requests of one client in a TakeAll: one slot, one script.
type group struct {
	idx  []int
	reqs []bucket.Request
	keys []string
	args []any
	ds   []bucket.Decision
	at   int64 // the instant the script decided at
	err  error
}

// TakeAll decides reqs all or nothing. The buckets of one client share a
// slot and are decided by one script, which spends only if all of them
// allow. Buckets of different clients live in different slots, where no
// script reaches across: each client's script runs (coalesced like single
// checks, or concurrently), and when any refuses, the clients whose scripts
// spent are given their tokens back by a second script, on a context of its
// own (UndoTimeout). Between the two, another check may see those tokens
// spent: a refusal a little early, never an admission too many.
//
// When some clients' scripts fail, the error is a *bucket.MultiError whose
// Errs hold, for each request not decided, its client's error (wrapping
// bucket.ErrOverloaded, bucket.ErrOutcomeUnknown, or neither: not applied),
// and the decisions returned hold those of the others. A decided refusal
// refuses the whole check; then every client that spent is given its tokens
// back, and a client whose outcome is unknown is never touched (an undo
// must not give back what may not have been spent). When the decided
// clients all allowed, they stay spent: the caller decides the rest, and a
// refusal from it costs those clients tokens early, never an admission.
func (s *Store) TakeAll(ctx context.Context, reqs []bucket.Request) ([]bucket.Decision, error) {
	for _, r := range reqs {
		if scriptIndex(r.Limit.Algorithm) < 0 {
			return nil, fmt.Errorf("%w: no script for algorithm %q", bucket.ErrInvalidLimit, r.Limit.Algorithm)
		}
	}
	for _, r := range reqs {
		if r.MaxWait != 0 {
			// Paced: one script reserves every rule at one instant.
			ds, err := s.reserve(ctx, reqs)
			if err != nil {
				if errors.Is(err, bucket.ErrInvalidWait) {
					return nil, err
				}
				errs := make([]error, len(reqs))
				for i := range errs {
					errs[i] = err
				}
				return make([]bucket.Decision, len(reqs)), &bucket.MultiError{Errs: errs}
			}
			return ds, nil
		}
	}
	if len(reqs) == 1 && reqs[0].Keep == 0 {
		d, err := s.Take(ctx, reqs[0])
		if err != nil {
			return []bucket.Decision{{}}, &bucket.MultiError{Errs: []error{err}}
		}
		return []bucket.Decision{d}, nil
	}
	var groups []*group
	for _, idx := range byKey(reqs, func(r bucket.Request) string { return r.Key }) {
		g := &group{idx: idx}
		for _, i := range idx {
			g.reqs = append(g.reqs, reqs[i])
		}
		groups = append(groups, g)
	}
	run := func(g *group) {
		g.keys, g.args = groupArgs(g.reqs)
		res, err := s.eval(ctx, opMulti, g.keys[0], pipeline.Call{Script: multiScript, Keys: g.keys, Args: multiArgs(g.reqs, g.args)}, s.m.multiDuration)
		if err == nil {
			if g.ds, g.at, err = parseMultiReply(res, g.reqs); err != nil {
				// It ran, and what it did is not known.
				err = fmt.Errorf("%w: %w", bucket.ErrOutcomeUnknown, err)
				s.m.failed(opMulti, err)
			}
		}
		g.err = err
	}
	var wg sync.WaitGroup
	for _, g := range groups[1:] {
		wg.Go(func() { run(g) })
	}
	run(groups[0])
	wg.Wait()

	out := make([]bucket.Decision, len(reqs))
	var errs []error
	refused := false
	for _, g := range groups {
		if g.err != nil {
			if errs == nil {
				errs = make([]error, len(reqs))
			}
			for _, i := range g.idx {
				errs[i] = fmt.Errorf("eval multi: %w", g.err)
			}
			continue
		}
		for k, i := range g.idx {
			out[i] = g.ds[k]
			refused = refused || !g.ds[k].Allowed
		}
	}
	if refused {
		var spent []*group
		for _, g := range groups {
			if g.err == nil && allAllowed(g.ds) {
				spent = append(spent, g)
			}
		}
		s.undo(ctx, spent)
	}
	if errs != nil {
		return out, &bucket.MultiError{Errs: errs}
	}
	return out, nil
}

// reserved reports whether r, refused by d, was refused only for what it
// keeps: its spend fits the bucket that the reply's remaining (the ns
// until it is full again, an integer) describes, keeping nothing.
func reserved(d bucket.Decision, r bucket.Request, remaining any) bool {
	ns, ok := remaining.(int64)
	if d.Allowed || r.Keep <= 0 || !ok || (r.Limit.Algorithm != bucket.TokenBucket && r.Limit.Algorithm != bucket.GCRA) {
		return false
	}
	return r.Limit.Fits(time.Duration(ns), r.Cost)
}

func allAllowed(ds []bucket.Decision) bool {
	for _, d := range ds {
		if !d.Allowed {
			return false
		}
	}
	return true
}

// undo gives back what groups spent, each in the window it spent in.
func (s *Store) undo(ctx context.Context, groups []*group) {
	if len(groups) == 0 {
		return
	}
	if s.beforeUndo != nil {
		s.beforeUndo()
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), UndoTimeout)
	defer cancel()
	for _, g := range groups {
		_ = s.once(ctx, opUndo, pipeline.Call{Script: undoScript, Keys: g.keys, Args: undoArgs(g.at, g.args)})
	}
}

// once runs c, a script that must not run twice, on the node of its keys
// (sent once: see pipeline.Nodes.EvalOnce), and counts a failure under o.
func (s *Store) once(ctx context.Context, o op, c pipeline.Call) error {
	if _, err := s.nodes.EvalOnce(ctx, c.Keys[0], c); err != nil {
		s.m.errors[o].Inc()
		return err
	}
	return nil
}

// groupArgs are the multi script's KEYS and ARGV for the requests of one
// client: four ARGV per bucket, algorithm, capacity, rate or window, cost.
// The undo script takes the same, after the instant of the spend.
func groupArgs(reqs []bucket.Request) (keys []string, args []any) {
	keys = make([]string, 0, len(reqs))
	args = make([]any, 0, 4*len(reqs))
	for _, r := range reqs {
		a := scriptArgs(r.Limit, r.Cost)
		keys = append(keys, Key(r.Rule, r.Key))
		args = append(args, string(r.Limit.Algorithm), a[0], a[1], a[2])
	}
	return keys, args
}

// multiArgs are the multi script's ARGV for reqs, of which args are the
// groupArgs: args, then each request's Keep.
func multiArgs(reqs []bucket.Request, args []any) []any {
	out := make([]any, len(args), len(args)+len(reqs))
	copy(out, args)
	for _, r := range reqs {
		out = append(out, strconv.FormatFloat(r.Keep, 'g', -1, 64))
	}
	return out
}

// parseMultiReply reads the multi script's reply: four values per bucket
// (see parseDecision), then the instant (µs, the store's clock) at which it
// decided and, when all allowed, spent.
func parseMultiReply(res []any, reqs []bucket.Request) ([]bucket.Decision, int64, error) {
	if len(res) != 4*len(reqs)+1 {
		return nil, 0, fmt.Errorf("reply has %d elements, want %d", len(res), 4*len(reqs)+1)
	}
	at, ok := res[len(res)-1].(int64)
	if !ok {
		return nil, 0, fmt.Errorf("unexpected instant %v", res[len(res)-1])
	}
	ds := make([]bucket.Decision, len(reqs))
	for k, r := range reqs {
		d, err := parseDecision(res[4*k:4*k+4], r.Limit)
		if err != nil {
			return nil, 0, err
		}
		d.At = at
		d.Reserved = reserved(d, r, res[4*k+1])
		ds[k] = d
	}
	return ds, at, nil
}

// undoArgs are the undo script's ARGV: the instant of the spend to give
// back, then a group's ARGV (groupArgs).
func undoArgs(at int64, args []any) []any {
	return append([]any{strconv.FormatInt(at, 10)}, args...)
}

// Undo gives back reqs, spent at the instant at, in one script per client
// (bucket.Undoer): what a check decided here spent, when another part of
// the check, decided elsewhere, refused. Each bucket gets back at most the
// request's cost, in the window at fell in, and nothing once that window is
// gone.
func (s *Store) Undo(ctx context.Context, reqs []bucket.Request, at time.Time) error {
	byKey := map[string][]bucket.Request{}
	var order []string
	for _, r := range reqs {
		if scriptIndex(r.Limit.Algorithm) < 0 {
			return fmt.Errorf("%w: no script for algorithm %q", bucket.ErrInvalidLimit, r.Limit.Algorithm)
		}
		if byKey[r.Key] == nil {
			order = append(order, r.Key)
		}
		byKey[r.Key] = append(byKey[r.Key], r)
	}
	var errs []error
	for _, k := range order {
		keys, args := groupArgs(byKey[k])
		if err := s.once(ctx, opUndo, pipeline.Call{Script: undoScript, Keys: keys, Args: undoArgs(at.UnixMicro(), args)}); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("undo: %w", errors.Join(errs...))
	}
	return nil
}

// byKey groups the indexes of reqs by their client key, in the order each
// key first appears: the requests one script decides together (all the
// keys of one script share the client key's hash slot).
func byKey[R any](reqs []R, key func(R) string) [][]int {
	var out [][]int
	at := make(map[string]int)
	for i, r := range reqs {
		k := key(r)
		j, ok := at[k]
		if !ok {
			j = len(out)
			at[k] = j
			out = append(out, nil)
		}
		out[j] = append(out[j], i)
	}
	return out
}
