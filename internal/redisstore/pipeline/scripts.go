package pipeline

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// loadScripts loads every script given to New on one node, so checks run
// by hash.
func (ns *Nodes) loadScripts(ctx context.Context, c *redis.Client) error {
	for _, sc := range ns.scripts {
		if err := sc.Load(ctx, c).Err(); err != nil {
			return fmt.Errorf("load scripts on %s: %w", c.Options().Addr, err)
		}
	}
	return nil
}

// Pipeliner is what RunScripts sends on: a node client, a cluster client
// (which splits a pipeline by node) or one connection.
type Pipeliner interface {
	Pipeline() redis.Pipeliner
}

// RunScripts sends calls as one pipeline on p, as Eval does for one call
// (EVALSHA, then EVAL for a node that lost the script), and returns their
// commands, in order. It is for calls that go through the admin client
// (Nodes.Admin) and take their deadline from ctx, outside the nodes'
// queues and breakers. A cluster client may send them more than once (see
// newBackend): only for scripts that may run twice. The error is that of
// the pipeline (the first command's failure); each command holds its own.
func RunScripts(ctx context.Context, p Pipeliner, calls []Call) ([]*redis.Cmd, error) {
	return runScripts(ctx, p, calls, nil)
}

// runScripts sends calls as one pipeline, each by its hash (EVALSHA), and
// returns their commands, in order. A node that lost its scripts (a restart,
// a failover) answers NOSCRIPT; nothing ran for those calls, so they go again
// in a second pipeline with the script's text (EVAL, which also caches the
// script on that node, so the next calls run by hash again). This is the
// only EVALSHA to EVAL fallback: checks, all-or-nothing checks, undos,
// debits and refunds all run through it. before, when not nil, is queued
// ahead of each call (ASKING, for a slot being migrated).
//
// The error is that of the pipeline (the first command's failure); each
// command holds its own.
func runScripts(ctx context.Context, p Pipeliner, calls []Call, before func(redis.Pipeliner)) ([]*redis.Cmd, error) {
	cmds := make([]*redis.Cmd, len(calls))
	pipe := p.Pipeline()
	for i, c := range calls {
		if before != nil {
			before(pipe)
		}
		cmds[i] = c.Script.EvalSha(ctx, pipe, c.Keys, c.Args...)
	}
	_, err := pipe.Exec(ctx)
	var retry []int
	for i, cmd := range cmds {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			retry = append(retry, i)
		}
	}
	if len(retry) == 0 {
		return cmds, err
	}
	pipe = p.Pipeline()
	for _, i := range retry {
		if before != nil {
			before(pipe)
		}
		cmds[i] = calls[i].Script.Eval(ctx, pipe, calls[i].Keys, calls[i].Args...)
	}
	_, _ = pipe.Exec(ctx)
	for _, cmd := range cmds {
		if err := cmd.Err(); err != nil {
			return cmds, err
		}
	}
	return cmds, nil
}
