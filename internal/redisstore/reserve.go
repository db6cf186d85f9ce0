package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// The scripts of paced requests (reserve_main.lua, unreserve.lua).
var (
	reserveScript   = redis.NewScript(lua.Reserve(lua.StoreClock))
	unreserveScript = redis.NewScript(lua.Unreserve(lua.StoreClock))
)

// errCrossSlotReserve: the requests of a paced TakeAll name several
// clients, whose buckets live in different slots, where no one script
// reserves one instant.
var errCrossSlotReserve = errors.New("a paced check's rules must count against one key")

// reserve decides paced requests (bucket.Request.MaxWait > 0) of one
// client in one script: reserve_main.lua reserves every rule's slot at one
// instant, all or nothing. It runs and fails as a multi check does.
func (s *Store) reserve(ctx context.Context, reqs []bucket.Request) ([]bucket.Decision, error) {
	maxWait := reqs[0].MaxWait
	for _, r := range reqs {
		if err := r.Limit.ValidateWait(r.MaxWait); err != nil {
			return nil, err
		}
		if r.Key != reqs[0].Key {
			return nil, fmt.Errorf("%w: %w", bucket.ErrInvalidWait, errCrossSlotReserve)
		}
		maxWait = min(maxWait, r.MaxWait)
	}
	keys, args := groupArgs(reqs)
	args = append([]any{strconv.FormatInt(maxWait.Nanoseconds(), 10)}, args...)
	res, err := s.eval(ctx, opMulti, keys[0], pipeline.Call{Script: reserveScript, Keys: keys, Args: args}, s.m.multiDuration)
	if err != nil {
		return nil, fmt.Errorf("eval reserve: %w", err)
	}
	ds, err := parseReserveReply(res, reqs)
	if err != nil {
		err = fmt.Errorf("%w: %w", bucket.ErrOutcomeUnknown, err)
		s.m.failed(opMulti, err) // it ran, and what it did is not known
		return nil, fmt.Errorf("eval reserve: %w", err)
	}
	return ds, nil
}

// parseReserveReply reads reserve_main.lua's reply: four values per
// bucket (see parseDecision), the instant (µs) and the wait W (ns). When
// all are allowed each decision gets the wait, rounded up to the µs as a
// retry is, and its reservation: the state it wrote, now + remaining ns.
func parseReserveReply(res []any, reqs []bucket.Request) ([]bucket.Decision, error) {
	if len(res) != 4*len(reqs)+2 {
		return nil, fmt.Errorf("reply has %d elements, want %d", len(res), 4*len(reqs)+2)
	}
	at, ok1 := res[len(res)-2].(int64)
	w, ok2 := res[len(res)-1].(int64)
	if !ok1 || !ok2 {
		return nil, fmt.Errorf("unexpected instant and wait %v", res[len(res)-2:])
	}
	ds := make([]bucket.Decision, len(reqs))
	all := true
	for k, r := range reqs {
		d, err := parseDecision(res[4*k:4*k+4], r.Limit)
		if err != nil {
			return nil, err
		}
		d.At = at
		ds[k] = d
		all = all && d.Allowed
	}
	if all {
		wait := time.Duration((w+999)/1000) * time.Microsecond
		for k := range ds {
			ds[k].Wait = wait
			ds[k].Reservation = at*1000 + res[4*k+1].(int64)
		}
	}
	return ds, nil
}

// Unreserve gives back the spend of a paced request that will not be
// sent, while the bucket's state is still the one its reservation left
// (bucket.Unreserver); it reports whether it gave back.
func (s *Store) Unreserve(ctx context.Context, req bucket.Request, reservation int64) (bool, error) {
	if req.Limit.Algorithm != bucket.TokenBucket && req.Limit.Algorithm != bucket.GCRA {
		return false, nil
	}
	key := Key(req.Rule, req.Key)
	a := scriptArgs(req.Limit, req.Cost)
	res, err := s.eval(ctx, opUndo, key, pipeline.Call{Script: unreserveScript, Keys: []string{key},
		Args: []any{a[0], a[1], a[2], "-" + strconv.FormatInt(reservation, 10)}}, s.m.multiDuration)
	if err != nil {
		return false, fmt.Errorf("eval unreserve: %w", err)
	}
	n, ok := res[0].(int64)
	if len(res) != 1 || !ok {
		return false, fmt.Errorf("eval unreserve: unexpected reply %v", res)
	}
	return n == 1, nil
}
