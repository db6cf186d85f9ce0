package redisstore

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

var (
	multiScript = redis.NewScript(lua.Multi(lua.StoreClock))
	undoScript  = redis.NewScript(lua.Undo(lua.StoreClock))
)

// TakeAll decides reqs all or nothing. The buckets of one client share a
// slot and are decided by one script, which spends only if all of them
// allow. Buckets of different clients live in different slots, where no
// script reaches across: each client's script runs (in one pipeline), and
// when any refuses, the clients whose scripts spent are given their tokens
// back by a second script. Between the two, another check may see those
// tokens spent: a refusal a little early, never an admission too many.
func (s *Store) TakeAll(ctx context.Context, reqs []bucket.Request) ([]bucket.Decision, error) {
	if len(reqs) == 1 {
		d, err := s.Take(ctx, reqs[0])
		return []bucket.Decision{d}, err
	}
	ctx, cancel := s.withTimeout(ctx)
	defer cancel()
	type group struct {
		reqs []bucket.Request
		idx  []int
		keys []string
		args []any
		cmd  *redis.Cmd
		at   int64
	}
	var groups []*group
	byKey := map[string]*group{}
	for i, r := range reqs {
		if scriptIndex(r.Limit.Algorithm) < 0 {
			return nil, fmt.Errorf("%w: no script for algorithm %q", bucket.ErrInvalidLimit, r.Limit.Algorithm)
		}
		g := byKey[r.Key]
		if g == nil {
			g = &group{}
			byKey[r.Key] = g
			groups = append(groups, g)
		}
		g.idx = append(g.idx, i)
		g.reqs = append(g.reqs, r)
	}
	for _, g := range groups {
		g.keys, g.args = groupArgs(g.reqs)
	}
	start := time.Now()
	run := func(useEval bool, only func(*group) bool) {
		pipe := s.client.Pipeline()
		for _, g := range groups {
			if only != nil && !only(g) {
				continue
			}
			if useEval {
				g.cmd = multiScript.Eval(ctx, pipe, g.keys, g.args...)
			} else {
				g.cmd = multiScript.EvalSha(ctx, pipe, g.keys, g.args...)
			}
		}
		_, _ = pipe.Exec(ctx)
	}
	run(false, nil)
	run(true, func(g *group) bool { return g.cmd.Err() != nil && strings.HasPrefix(g.cmd.Err().Error(), "NOSCRIPT") })
	s.m.multiDuration.Observe(time.Since(start).Seconds())

	out := make([]bucket.Decision, len(reqs))
	spent := make([]bool, len(groups))
	all := true
	var firstErr error
	for gi, g := range groups {
		res, err := g.cmd.Slice()
		var ds []bucket.Decision
		if err == nil {
			ds, g.at, err = parseMultiReply(res, g.reqs)
		}
		if err != nil {
			if firstErr == nil {
				firstErr = err
			}
			all = false
			continue
		}
		groupAllowed := true
		for k, i := range g.idx {
			out[i] = ds[k]
			groupAllowed = groupAllowed && ds[k].Allowed
		}
		spent[gi] = groupAllowed
		all = all && groupAllowed
	}
	if !all {
		// Give back what the clients that allowed have spent.
		pipe := s.client.Pipeline()
		n := 0
		for gi, g := range groups {
			if spent[gi] {
				undoScript.Eval(ctx, pipe, g.keys, undoArgs(g.at, g.args)...)
				n++
			}
		}
		if n > 0 {
			if _, err := pipe.Exec(ctx); err != nil {
				s.m.errors.Inc()
				if firstErr == nil {
					firstErr = fmt.Errorf("undo: %w", err)
				}
			}
		}
	}
	if firstErr != nil {
		s.m.errors.Inc()
		return nil, fmt.Errorf("eval multi: %w", firstErr)
	}
	return out, nil
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
		d, err := parseDecision(res[4*k:4*k+4], r.Limit.Capacity)
		if err != nil {
			return nil, 0, err
		}
		ds[k] = d
	}
	return ds, at, nil
}

// undoArgs are the undo script's ARGV: the instant of the spend to give
// back, then a group's ARGV (groupArgs).
func undoArgs(at int64, args []any) []any {
	return append([]any{strconv.FormatInt(at, 10)}, args...)
}
