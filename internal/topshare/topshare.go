// Package topshare merges the keys each rule refused most (package
// topkeys) over a region's limiterd instances, through the region's
// Redis: every Interval each instance writes its summary of every rule
// that refused a key into a hash per rule (one field per instance), and a
// read merges the fields still fresh.
package topshare

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/engine/topkeys"
)

// Interval is how often an instance writes its summaries.
const Interval = 10 * time.Second

// fresh is how old an instance's summary may be and still count: an
// instance gone stops counting after it.
const fresh = 3 * Interval

// Key is the Redis key of a rule's summaries.
func Key(ruleID string) string { return "limiter:top:{" + ruleID + "}" }

// Source is what a Share reads this instance's summaries from (the
// engine).
type Source interface {
	TopLimited(ruleID string, k int) []topkeys.Entry
	TopLimitedRules() []string
	TopLimitedSize() int
}

// Share writes this instance's summaries and reads the region's. Safe for
// concurrent use; Run is called once.
type Share struct {
	src      Source
	client   redis.UniversalClient // nil: this instance alone
	instance string
	log      *slog.Logger
	errs     prometheus.Counter
}

// New returns the share of instance's summaries from src through client
// (nil: none, reads give this instance's alone), with its metrics on reg.
func New(src Source, client redis.UniversalClient, instance string, log *slog.Logger, reg prometheus.Registerer) (*Share, error) {
	s := &Share{src: src, client: client, instance: instance, log: log,
		errs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_top_limited_write_errors_total",
			Help: "Failed writes of this instance's most refused keys to the region's Redis (the region's view misses them until the next one).",
		})}
	if err := reg.Register(s.errs); err != nil {
		return nil, fmt.Errorf("topshare metrics: %w", err)
	}
	return s, nil
}

// record is one instance's summary of a rule, as stored.
type record struct {
	At      int64           `json:"at"` // Unix ms
	Entries []topkeys.Entry `json:"entries"`
}

// Run writes the summaries every Interval until ctx ends.
func (s *Share) Run(ctx context.Context) {
	if s.client == nil || s.src.TopLimitedSize() == 0 {
		return
	}
	t := time.NewTicker(Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := s.Write(ctx); err != nil && ctx.Err() == nil {
				s.errs.Inc()
				s.log.Warn("could not share the most refused keys", "err", err)
			}
		}
	}
}

// Write writes this instance's summary of every rule that refused a key,
// in one pipeline.
func (s *Share) Write(ctx context.Context) error {
	ids := s.src.TopLimitedRules()
	if len(ids) == 0 || s.client == nil {
		return nil
	}
	now := time.Now().UnixMilli()
	_, err := s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, id := range ids {
			b, err := json.Marshal(record{At: now, Entries: s.src.TopLimited(id, -1)})
			if err != nil {
				return err
			}
			p.HSet(ctx, Key(id), s.instance, b)
			p.PExpire(ctx, Key(id), fresh)
		}
		return nil
	})
	return err
}

// Top returns the k keys ruleID refused most over the region's instances
// whose summaries are fresh, this one's as it is now, and how many
// instances that is. Without Redis, or when it fails, it is this
// instance's alone (err tells which).
func (s *Share) Top(ctx context.Context, ruleID string, k int) ([]topkeys.Entry, int, error) {
	size := s.src.TopLimitedSize()
	mine := s.src.TopLimited(ruleID, -1)
	if s.client == nil {
		return cut(topkeys.Merge(size, mine), k), 1, nil
	}
	fields, err := s.client.HGetAll(ctx, Key(ruleID)).Result()
	if err != nil {
		return cut(topkeys.Merge(size, mine), k), 1, fmt.Errorf("read the region's summaries: %w", err)
	}
	all := [][]topkeys.Entry{mine}
	oldest := time.Now().Add(-fresh).UnixMilli()
	for inst, v := range fields {
		if inst == s.instance {
			continue
		}
		var r record
		if json.Unmarshal([]byte(v), &r) != nil || r.At < oldest || len(r.Entries) > size {
			continue // another version's, or too old: not counted
		}
		all = append(all, r.Entries)
	}
	return cut(topkeys.Merge(size, all...), k), len(all), nil
}

func cut(e []topkeys.Entry, k int) []topkeys.Entry {
	if k >= 0 && len(e) > k {
		return e[:k]
	}
	return e
}
