package redisstore

import (
	"context"
	"fmt"
	"strconv"
	"sync"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// SeedKey is the key that records that the bucket of s was seeded from its
// key's old home region, holding the topology generation it moved at
// (bucket.SeedRecord names it). It shares the buckets' hash tag, so one
// script checks it and replaces the bucket.
func SeedKey(s bucket.Seed) string {
	return Key(bucket.SeedRecord(s), s.Key)
}

// Used reports, per request, the tokens its bucket counts now
// (bucket.Limit.Used). The requests run in parallel, one script each on
// the node of its key.
func (s *Store) Used(ctx context.Context, reqs []bucket.Request) ([]float64, error) {
	out := make([]float64, len(reqs))
	err := each(len(reqs), func(i int) error {
		r := reqs[i]
		key := Key(r.Rule, r.Key)
		a := scriptArgs(r.Limit, 0)
		res, err := s.eval(ctx, opHandoff, key, pipeline.Call{Script: handoffScript, Keys: []string{key},
			Args: []any{"used", string(r.Limit.Algorithm), a[0], a[1]}}, s.m.handoffDur)
		if err != nil {
			return fmt.Errorf("eval handoff used: %w", err)
		}
		v, ok := "", len(res) == 1
		if ok {
			v, ok = res[0].(string)
		}
		f, perr := strconv.ParseFloat(v, 64)
		if !ok || perr != nil || !(f >= 0) {
			s.m.errors[opHandoff].Inc()
			return fmt.Errorf("eval handoff used: unexpected reply %v", res)
		}
		out[i] = f
		return nil
	})
	return out, err
}

// Seeded reports, per seed, whether its bucket was seeded at its
// generation or a later one.
func (s *Store) Seeded(ctx context.Context, seeds []bucket.Seed) ([]bool, error) {
	out := make([]bool, len(seeds))
	err := each(len(seeds), func(i int) error {
		sd := seeds[i]
		mark := SeedKey(sd)
		n, err := s.handoffInt(ctx, mark, []string{mark}, "seeded", strconv.FormatUint(sd.Generation, 10))
		out[i] = n == 1
		return err
	})
	return out, err
}

// Seed replaces each bucket not seeded at its generation or a later one
// with a fresh one debited by the seed's Used, and records it seeded for
// the seed's TTL (at least 1 ms), in one script on the key's node.
func (s *Store) Seed(ctx context.Context, seeds []bucket.Seed) ([]bool, error) {
	out := make([]bool, len(seeds))
	err := each(len(seeds), func(i int) error {
		sd := seeds[i]
		mark := SeedKey(sd)
		a := scriptArgs(sd.Limit, sd.Used)
		ttl := max(sd.TTL.Milliseconds(), 1)
		n, err := s.handoffInt(ctx, mark, []string{mark, Key(sd.Rule, sd.Key)}, "seed",
			strconv.FormatUint(sd.Generation, 10), strconv.FormatInt(ttl, 10), string(sd.Limit.Algorithm), a[0], a[1], a[2])
		out[i] = n == 1
		return err
	})
	return out, err
}

// handoffInt runs the handoff script's operation op, replying 0 or 1.
func (s *Store) handoffInt(ctx context.Context, route string, keys []string, op string, args ...string) (int64, error) {
	argv := make([]any, 0, 1+len(args))
	argv = append(argv, op)
	for _, a := range args {
		argv = append(argv, a)
	}
	res, err := s.eval(ctx, opHandoff, route, pipeline.Call{Script: handoffScript, Keys: keys, Args: argv}, s.m.handoffDur)
	if err != nil {
		return 0, fmt.Errorf("eval handoff %s: %w", op, err)
	}
	n, ok := int64(-1), len(res) == 1
	if ok {
		n, ok = res[0].(int64)
	}
	if !ok || (n != 0 && n != 1) {
		s.m.errors[opHandoff].Inc()
		return 0, fmt.Errorf("eval handoff %s: unexpected reply %v", op, res)
	}
	return n, nil
}

// each runs f(0..n-1) in parallel and returns the first error.
func each(n int, f func(i int) error) error {
	if n == 1 {
		return f(0)
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { errs[i] = f(i) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
