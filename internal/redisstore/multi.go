package redisstore

import (
	"context"
	"fmt"
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
		idx  []int
		keys []string
		args []any
		cmd  *redis.Cmd
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
		a := scriptArgs(r.Limit, r.Cost)
		g.idx = append(g.idx, i)
		g.keys = append(g.keys, Key(r.Rule, r.Key))
		g.args = append(g.args, string(r.Limit.Algorithm), a[0], a[1], a[2])
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
		if err == nil && len(res) != 4*len(g.idx) {
			err = fmt.Errorf("reply has %d elements, want %d", len(res), 4*len(g.idx))
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
			d, err := parseDecision(res[4*k:4*k+4], reqs[i].Limit.Capacity)
			if err != nil && firstErr == nil {
				firstErr = err
			}
			out[i] = d
			groupAllowed = groupAllowed && d.Allowed
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
				undoScript.Eval(ctx, pipe, g.keys, g.args...)
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
