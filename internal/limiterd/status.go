package limiterd

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/statuspage"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/gossip"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// The status page's bounds: the rules that refused keys it lists, and the
// keys of each.
const (
	statusTopRules = 20
	statusTopKeys  = 5
)

// statusPage is the status page (/), behind the admin authentication when
// one is configured.
func (d *Daemon) statusPage() *statuspage.Options {
	return &statuspage.Options{Status: d.status, Try: d.tryCheck, Logger: d.log}
}

// status gathers what the status page shows.
func (d *Daemon) status(ctx context.Context) statuspage.Status {
	st := statuspage.Status{Region: d.opts.Region.Name, Dependencies: d.dependencies()}
	if d.redis == nil {
		st.Store = "embedded in-memory store"
	} else {
		st.Store = "Redis " + strings.Join(d.opts.Redis.Addrs, ",")
		for _, n := range d.redis.NodeStates() {
			st.Nodes = append(st.Nodes, statuspage.Node{Addr: n.Addr, Err: n.Err})
		}
	}
	set := d.rules.Current()
	st.Version = set.Version()
	for _, r := range set.Rules() {
		st.Rules = append(st.Rules, statuspage.Rule{ID: r.ID, Algorithm: string(r.Algorithm), Limit: describeLimit(r),
			Home: cmp.Or(string(r.Home), string(rules.HomeLocal)), Source: r.Source(), Shadow: r.Shadow, Overrides: len(r.Overrides)})
	}
	if d.topo != nil {
		if t := d.topo.Active(); t != nil {
			d.peersMu.Lock()
			for _, r := range t.Regions() {
				reg := statuspage.Region{Name: r.Name, Address: r.LimiterAddress, Self: r.Name == d.opts.Region.Name}
				if pc := d.peers[r.Name]; pc != nil && !reg.Self {
					reg.State = pc.cc.GetState().String()
				} else if !reg.Self {
					reg.State = "no connection"
				}
				st.Regions = append(st.Regions, reg)
			}
			d.peersMu.Unlock()
		}
	}
	st.Lag, st.LagNote = d.reconcileLag(ctx)
	if e := d.currentEngine(); e != nil {
		ids := e.TopLimitedRules()
		slices.Sort(ids)
		if top := d.top.Load(); top != nil {
			for _, id := range ids[:min(len(ids), statusTopRules)] {
				keys, _, err := top.Top(ctx, id, statusTopKeys)
				t := statuspage.Top{Rule: id}
				if err != nil {
					t.Err = err.Error()
				}
				for _, k := range keys {
					t.Keys = append(t.Keys, statuspage.TopKey{Key: k.Key, Count: k.Count})
				}
				st.Top = append(st.Top, t)
			}
		}
	}
	return st
}

// currentEngine is the engine in force.
func (d *Daemon) currentEngine() interface{ TopLimitedRules() []string } {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.engine == nil {
		return nil
	}
	return d.engine
}

// reconcileLag reads the readers of this region's inbound stream that the
// reconcilers apply each partition with: per source region, the spends not
// yet read and the last one read. note says why there is nothing to show.
func (d *Daemon) reconcileLag(ctx context.Context) (lags []statuspage.Lag, note string) {
	if d.nc == nil {
		return nil, "No NATS (--nats.url): no reconciliation."
	}
	js, err := jetstream.New(d.nc)
	if err != nil {
		return nil, "Reconciliation: " + err.Error()
	}
	stream, err := js.Stream(ctx, gossip.InStream(d.opts.Region.Name))
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Sprintf("No reconciler has set up %s: nothing to reconcile yet.", gossip.InStream(d.opts.Region.Name))
	}
	if err != nil {
		return nil, "Reconciliation: " + err.Error()
	}
	var infos []*jetstream.ConsumerInfo
	list := stream.ListConsumers(ctx)
	for info := range list.Info() {
		infos = append(infos, info)
	}
	if err := list.Err(); err != nil {
		return nil, "Reconciliation: " + err.Error()
	}
	if lags = lagOf(infos); len(lags) == 0 {
		return nil, "No reconciler reads this region's inbound stream yet."
	}
	return lags, ""
}

// lagOf is the lag of each source region, sorted by name, from the
// consumers of the inbound stream: its partitions' readers, ephemeral
// consumers filtered to one partition's subject. A partition counts its
// reader furthest on (the current one's: a reader left by a reconciler
// gone falls behind); a durable consumer (an earlier release's) is not a
// reader.
func lagOf(infos []*jetstream.ConsumerInfo) []statuspage.Lag {
	type partition struct {
		pending uint64
		last    time.Time
	}
	parts := map[string]*partition{} // by subject
	for _, info := range infos {
		subject := info.Config.FilterSubject
		rest, ok := strings.CutPrefix(subject, gossip.RelaySubjectPrefix)
		if !ok || info.Config.Durable != "" {
			continue
		}
		i := strings.LastIndexByte(rest, '.')
		if i < 0 {
			continue
		}
		if _, err := strconv.Atoi(rest[i+1:]); err != nil {
			continue
		}
		p := parts[subject]
		if p == nil || info.NumPending < p.pending {
			p = &partition{pending: info.NumPending}
			parts[subject] = p
		}
		if last := info.Delivered.Last; last != nil && last.After(p.last) {
			p.last = *last
		}
	}
	by := map[string]*statuspage.Lag{}
	for subject, p := range parts {
		rest := strings.TrimPrefix(subject, gossip.RelaySubjectPrefix)
		src := rest[:strings.LastIndexByte(rest, '.')]
		l := by[src]
		if l == nil {
			l = &statuspage.Lag{Source: src}
			by[src] = l
		}
		l.Pending += p.pending
		if p.last.After(l.LastApplied) {
			l.LastApplied = p.last
		}
	}
	var lags []statuspage.Lag
	for _, l := range by {
		lags = append(lags, *l)
	}
	slices.SortFunc(lags, func(a, b statuspage.Lag) int { return strings.Compare(a.Source, b.Source) })
	return lags
}

// tryCheck answers the status page's form: a check, or its usage.
func (d *Daemon) tryCheck(ctx context.Context, req statuspage.TryRequest) (statuspage.TryResult, error) {
	if !req.Spend {
		resp, err := d.check.GetUsage(ctx, &limiterv1.GetUsageRequest{RuleId: req.Rule, Key: req.Key, Cost: req.Cost})
		if err != nil {
			return statuspage.TryResult{}, err
		}
		if len(resp.GetUsages()) == 0 {
			return statuspage.TryResult{}, fmt.Errorf("no usage for rule %q", req.Rule)
		}
		u := resp.GetUsages()[0]
		return statuspage.TryResult{Allowed: u.GetAllowed(), Remaining: u.GetRemaining(), Limit: u.GetLimit(),
			RetryAfter: msDuration(u.GetRetryAfterMs())}, nil
	}
	resp, err := d.check.Check(ctx, &limiterv1.CheckRequest{RuleId: req.Rule, Key: req.Key, Cost: req.Cost})
	if err != nil {
		return statuspage.TryResult{}, err
	}
	return statuspage.TryResult{Allowed: resp.GetAllowed(), Remaining: resp.GetRemaining(), Limit: resp.GetLimit(),
		RetryAfter: msDuration(resp.GetRetryAfterMs())}, nil
}

// describeLimit is a rule's limit in a few words.
func describeLimit(r *rules.Rule) string {
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
	amount := 0.0
	switch {
	case r.Capacity != nil:
		amount = *r.Capacity
	case r.Limit != nil:
		amount = *r.Limit
	}
	switch r.Algorithm {
	case bucket.TokenBucket, bucket.GCRA, "":
		return fmt.Sprintf("%s, +%s/s", f(amount), f(r.RefillPerSecond))
	case bucket.Concurrency:
		return f(amount) + " in flight"
	default:
		return fmt.Sprintf("%s per %s", f(amount), time.Duration(r.Window))
	}
}

// msDuration is a count of milliseconds as a duration.
func msDuration(ms int64) time.Duration { return time.Duration(ms) * time.Millisecond }
