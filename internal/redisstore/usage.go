package redisstore

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/pkg/bucket"
)

var _ bucket.Usager = (*Store)(nil)

// Usage answers, per request, what a check of its cost would see now
// (bucket.Limit.UsageKeeping), changing nothing. The buckets of one client are
// read by one script; the clients' scripts run in parallel.
func (s *Store) Usage(ctx context.Context, reqs []bucket.Request) ([]bucket.Decision, error) {
	out := make([]bucket.Decision, len(reqs))
	groups := byKey(reqs, func(r bucket.Request) string { return r.Key })
	err := each(len(groups), func(g int) error {
		idx := groups[g]
		keys := make([]string, len(idx))
		args := make([]any, 0, 5*len(idx))
		for k, i := range idx {
			r := reqs[i]
			if scriptIndex(r.Limit.Algorithm) < 0 {
				return fmt.Errorf("%w: no script for algorithm %q", bucket.ErrInvalidLimit, r.Limit.Algorithm)
			}
			keys[k] = Key(r.Rule, r.Key)
			a := scriptArgs(r.Limit, r.Cost)
			args = append(args, string(r.Limit.Algorithm), a[0], a[1], a[2], strconv.FormatFloat(r.Keep, 'g', -1, 64))
		}
		res, err := s.eval(ctx, opUsage, keys[0], pipeline.Call{Script: usageScript, Keys: keys, Args: args}, s.m.usageDur)
		if err != nil {
			return fmt.Errorf("eval usage: %w", err)
		}
		if len(res) != 4*len(idx)+1 {
			s.m.errors[opUsage].Inc()
			return fmt.Errorf("eval usage: reply has %d elements for %d buckets", len(res), len(idx))
		}
		at := res[len(res)-1]
		for k, i := range idx {
			d, err := parseDecision(append(res[4*k:4*k+4:4*k+4], at), reqs[i].Limit)
			if err != nil {
				s.m.errors[opUsage].Inc()
				return fmt.Errorf("eval usage: %w", err)
			}
			d.Reserved = reserved(d, reqs[i], res[4*k+1])
			out[i] = d
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// LeaseUsage answers, per request, the leases its key holds now and what
// an Acquire keeping its Keep would see (bucket.Leases.UsageKeeping),
// changing nothing.
func (s *Store) LeaseUsage(ctx context.Context, reqs []bucket.LeaseRequest) ([]bucket.LeaseDecision, error) {
	if len(reqs) == 0 {
		return nil, nil
	}
	out := make([]bucket.LeaseDecision, len(reqs))
	groups := leaseGroups(reqs)
	err := each(len(groups), func(gi int) error {
		g := groups[gi]
		res, err := s.eval(ctx, opUsage, g.keys[0], pipeline.Call{Script: leaseUsageScript, Keys: slices.Concat(g.keys, g.akeys), Args: LeaseUsageArgs(g.reqs)}, s.m.usageDur)
		if err != nil {
			return fmt.Errorf("eval lease usage: %w", err)
		}
		if len(res) != 5*len(g.keys) {
			s.m.errors[opUsage].Inc()
			return fmt.Errorf("eval lease usage: reply has %d elements for %d keys", len(res), len(g.keys))
		}
		for k, i := range g.idx {
			d, err := leaseUsage(res, k)
			if err != nil {
				s.m.errors[opUsage].Inc()
				return fmt.Errorf("eval lease usage: %w", err)
			}
			out[i] = d
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// LeaseUsageArgs are the lease usage script's arguments of reqs (keys of
// one client): each request's limit and adaptive range, then each one's
// Keep, in the shortest form that reads back the same float64.
func LeaseUsageArgs(reqs []bucket.LeaseRequest) []any {
	args := make([]any, 0, 4*len(reqs))
	for _, r := range reqs {
		args = append(args, strconv.Itoa(r.Limit.Limit), strconv.Itoa(r.Limit.Adaptive.Min), strconv.Itoa(r.Limit.Adaptive.Max))
	}
	for _, r := range reqs {
		args = append(args, strconv.FormatFloat(r.Keep, 'g', -1, 64))
	}
	return args
}

// leaseUsage reads the lease usage script's reply for key k: allowed (1;
// 0 refused at the limit, 2 refused for what the class keeps), held,
// retry (µs), the latest expiry (µs since the epoch, 0 for none) and the
// key's limit.
func leaseUsage(res []any, k int) (bucket.LeaseDecision, error) {
	var v [5]int64
	for i := range v {
		n, ok := res[5*k+i].(int64)
		if !ok {
			return bucket.LeaseDecision{}, fmt.Errorf("unexpected lease usage reply %v", res)
		}
		v[i] = n
	}
	d := bucket.LeaseDecision{Allowed: v[0] == 1, Reserved: v[0] == 2, InFlight: int(v[1]), Limit: int(v[4]), RetryAfter: time.Duration(v[2]) * time.Microsecond}
	if v[3] > 0 {
		d.Expires = time.UnixMicro(v[3])
	}
	return d, nil
}
