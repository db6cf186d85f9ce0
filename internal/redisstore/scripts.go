package redisstore

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// The scripts the store runs, built once with the store's clock.
var (
	singleScripts = func() (out [len(scriptAlgorithms)]*redis.Script) {
		for i, a := range scriptAlgorithms {
			src, err := lua.Single(string(a), lua.StoreClock)
			if err != nil {
				panic(fmt.Sprintf("redisstore: %v", err)) // scriptAlgorithms names embedded files only
			}
			out[i] = redis.NewScript(src)
		}
		return out
	}()
	multiScript  = redis.NewScript(lua.Multi(lua.StoreClock))
	undoScript   = redis.NewScript(lua.Undo(lua.StoreClock))
	debitScript  = redis.NewScript(lua.Debit(lua.StoreClock))
	refundScript = redis.NewScript(lua.Refund(lua.StoreClock))
	seenScript   = redis.NewScript(lua.Seen())
	// The lease operations of concurrency rules: acquire, release, renew.
	leaseScripts = [3]*redis.Script{
		redis.NewScript(lua.Lease(lua.LeaseAcquire, lua.StoreClock)),
		redis.NewScript(lua.Lease(lua.LeaseRelease, lua.StoreClock)),
		redis.NewScript(lua.Lease(lua.LeaseRenew, lua.StoreClock)),
	}
)

var scriptAlgorithms = [...]bucket.Algorithm{bucket.TokenBucket, bucket.GCRA, bucket.SlidingWindow, bucket.SlidingLog, bucket.FixedWindow}

func scriptIndex(a bucket.Algorithm) int {
	for i, s := range scriptAlgorithms {
		if s == a {
			return i
		}
	}
	return -1
}

// allScripts lists every script Load puts on a node.
func allScripts() []*redis.Script {
	return append(singleScripts[:len(singleScripts):len(singleScripts)], multiScript, undoScript, debitScript, refundScript, seenScript, reserveScript, unreserveScript,
		leaseScripts[0], leaseScripts[1], leaseScripts[2])
}

// loadScripts loads every script on one node, so checks run by hash.
func loadScripts(ctx context.Context, c *redis.Client) error {
	for _, sc := range allScripts() {
		if err := sc.Load(ctx, c).Err(); err != nil {
			return fmt.Errorf("load scripts on %s: %w", c.Options().Addr, err)
		}
	}
	return nil
}

// scriptCall is one script to run on one slot: KEYS and ARGV.
type scriptCall struct {
	script *redis.Script
	keys   []string
	args   []any
}

// pipeliner is what runScripts sends on: a node client, a cluster client
// (which splits a pipeline by node) or one connection.
type pipeliner interface {
	Pipeline() redis.Pipeliner
}

// runScripts sends calls as one pipeline, each by its hash (EVALSHA), and
// returns their commands, in order. A node that lost its scripts (a restart,
// a failover) answers NOSCRIPT; nothing ran for those calls, so they go again
// in a second pipeline with the script's text (EVAL, which also caches the
// script on that node, so the next calls run by hash again). This is the
// store's only EVALSHA to EVAL fallback: checks, all-or-nothing checks,
// undos, debits and refunds all run through it. before, when not nil, is
// queued ahead of each call (ASKING, for a slot being migrated).
//
// The error is that of the pipeline (the first command's failure); each
// command holds its own.
func runScripts(ctx context.Context, p pipeliner, calls []scriptCall, before func(redis.Pipeliner)) ([]*redis.Cmd, error) {
	cmds := make([]*redis.Cmd, len(calls))
	pipe := p.Pipeline()
	for i, c := range calls {
		if before != nil {
			before(pipe)
		}
		cmds[i] = c.script.EvalSha(ctx, pipe, c.keys, c.args...)
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
		cmds[i] = calls[i].script.Eval(ctx, pipe, calls[i].keys, calls[i].args...)
	}
	_, _ = pipe.Exec(ctx)
	for _, cmd := range cmds {
		if err := cmd.Err(); err != nil {
			return cmds, err
		}
	}
	return cmds, nil
}
