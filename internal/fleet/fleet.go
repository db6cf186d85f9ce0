// Package fleet counts the live limiterd instances of a region, through a
// heartbeat in the region's Redis, so that fail-open rules share a limit
// among the instances that are really there: each decides with limit / N
// when the store is down. The last count seen holds through a store outage.
package fleet

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// Defaults of Options.
const (
	// DefaultInterval is how often an instance says it is alive.
	DefaultInterval = time.Second
	// DefaultTTL is how long an instance counts after its last heartbeat.
	DefaultTTL = 5 * time.Second
)

// heartbeat adds this instance to the region's sorted set, scored by the
// instant (ms, the store's clock) it stops counting, drops the instances
// past theirs, and returns how many are left. One key, one slot.
var heartbeat = redis.NewScript(`
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl)
return redis.call('ZCARD', KEYS[1])
`)

// Key is the Redis key of a region's fleet.
func Key(region string) string { return "fleet:{" + region + "}" }

// Options configure a Fleet.
type Options struct {
	// Region and Instance name this instance's entry.
	Region, Instance string
	// Fixed, when > 0, is the size used instead of the live count.
	Fixed int
	// Interval and TTL of the heartbeat (0: the defaults).
	Interval, TTL time.Duration
	Logger        *slog.Logger
}

// Fleet is the live count of a region's instances. Size is safe for
// concurrent use; Run is called once.
type Fleet struct {
	opts   Options
	client redis.UniversalClient
	size   atomic.Int64
	known  atomic.Bool
	last   atomic.Pointer[error]
	gauge  prometheus.Gauge
	errs   prometheus.Counter
}

// New returns the fleet of opts.Region seen through client (nil: none, the
// size is then Fixed, or 1). Its metrics are registered on reg.
func New(client redis.UniversalClient, opts Options, reg prometheus.Registerer) (*Fleet, error) {
	if opts.Interval <= 0 {
		opts.Interval = DefaultInterval
	}
	if opts.TTL <= 0 {
		opts.TTL = DefaultTTL
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	f := &Fleet{opts: opts, client: client,
		gauge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "limiter_fleet_instances",
			Help: "Live limiterd instances of this region (or --fleet.size when set): a fail-open rule whose store is down decides here with limit / this.",
		}),
		errs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_fleet_heartbeat_errors_total",
			Help: "Fleet heartbeats that failed; the last count seen holds meanwhile.",
		}),
	}
	for _, c := range []prometheus.Collector{f.gauge, f.errs} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("fleet metrics: %w", err)
		}
	}
	f.size.Store(1)
	if opts.Fixed > 0 {
		f.size.Store(int64(opts.Fixed))
	}
	f.gauge.Set(float64(f.size.Load()))
	return f, nil
}

// Size is the number of instances sharing the region's limits, at least 1:
// the fixed size, or the last live count seen (1 until one is).
func (f *Fleet) Size() int { return int(f.size.Load()) }

// LastError is the error of the last heartbeat, nil when it succeeded (or
// none was sent yet).
func (f *Fleet) LastError() error {
	if p := f.last.Load(); p != nil {
		return *p
	}
	return nil
}

// Beat sends one heartbeat and updates the count.
func (f *Fleet) Beat(ctx context.Context) error {
	if f.client == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, f.opts.Interval)
	defer cancel()
	n, err := heartbeat.Run(ctx, f.client, []string{Key(f.opts.Region)}, f.opts.Instance,
		strconv.FormatInt(f.opts.TTL.Milliseconds(), 10)).Int64()
	if err != nil {
		f.errs.Inc()
		err = fmt.Errorf("fleet heartbeat: %w", err)
		f.last.Store(&err)
		return err
	}
	f.last.Store(nil)
	if f.opts.Fixed > 0 {
		return nil
	}
	n = max(n, 1)
	if old := f.size.Swap(n); old != n || !f.known.Load() {
		f.opts.Logger.Info("fleet size", "instances", n)
	}
	f.known.Store(true)
	f.gauge.Set(float64(n))
	return nil
}

// Run beats every interval until ctx ends, then leaves the fleet.
func (f *Fleet) Run(ctx context.Context) {
	if f.client == nil {
		return
	}
	t := time.NewTicker(f.opts.Interval)
	defer t.Stop()
	warned := false
	for {
		if err := f.Beat(ctx); err != nil && ctx.Err() == nil && !warned {
			f.opts.Logger.Warn("fleet heartbeat failed; the last count seen holds", "instances", f.Size(), "err", err)
			warned = true
		} else if err == nil {
			warned = false
		}
		select {
		case <-ctx.Done():
			lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			f.client.ZRem(lctx, Key(f.opts.Region), f.opts.Instance)
			cancel()
			return
		case <-t.C:
		}
	}
}
