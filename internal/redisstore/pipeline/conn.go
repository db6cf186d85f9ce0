package pipeline

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// Mode says whether Options.Addrs name a Redis Cluster or one standalone
// server.
type Mode int

const (
	// ModeAuto: more than one address is a cluster; one address is asked
	// (INFO cluster) when it first answers, and checks fail with
	// ErrNotConnected until then.
	ModeAuto Mode = iota
	// ModeCluster: the addresses are seeds of a Redis Cluster.
	ModeCluster
	// ModeStandalone: the one address is a standalone server.
	ModeStandalone
)

const (
	// ProbeInterval is how often the store probes its nodes in the
	// background: it connects when Redis first answers, loads the scripts
	// on a node that comes (back) up, and updates Health.
	ProbeInterval = time.Second
	// probeTimeout bounds one probe.
	probeTimeout = time.Second
	// adminTimeout is the socket timeout of admin commands (INFO, SCRIPT
	// LOAD, the slot map) when their context sets no earlier deadline.
	adminTimeout = 3 * time.Second
)

// backend is what the nodes know once Redis first answered: the mode, and
// the admin client, which routes keys to nodes (its slot map) and runs
// admin commands and the scripts run with RunScripts, with context deadlines.
type backend struct {
	cluster bool
	admin   redis.UniversalClient
}

// connPhase records, for one call through a pooled client, whether it
// opened a new connection and whether that connection's handshake
// completed; see classifyPooled.
type connPhase struct{ dialed, connected atomic.Bool }

type connPhaseKey struct{}

func withConnPhase(ctx context.Context, p *connPhase) context.Context {
	return context.WithValue(ctx, connPhaseKey{}, p)
}

// dialer opens connections for every client of the nodes and marks the
// dial on the call's connPhase, if it has one.
func (ns *Nodes) dialer(timeout time.Duration) func(ctx context.Context, network, addr string) (net.Conn, error) {
	d := &net.Dialer{Timeout: timeout, KeepAlive: 5 * time.Minute}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		if p, ok := ctx.Value(connPhaseKey{}).(*connPhase); ok {
			p.dialed.Store(true)
		}
		if ns.opts.TLS == nil {
			return d.DialContext(ctx, network, addr)
		}
		td := &tls.Dialer{NetDialer: d, Config: ns.opts.TLS}
		return td.DialContext(ctx, network, addr)
	}
}

// onConnect marks a completed handshake on the call's connPhase.
func onConnect(ctx context.Context, _ *redis.Conn) error {
	if p, ok := ctx.Value(connPhaseKey{}).(*connPhase); ok {
		p.connected.Store(true)
	}
	return nil
}

// nodeOptions are the options of a client of one node. Each command is
// sent once: a retry spends the latency budget and could run a script
// twice; the caller decides what a failure means.
func (ns *Nodes) nodeOptions(addr string) *redis.Options {
	return &redis.Options{
		Addr: addr, Username: ns.opts.Username, Password: ns.opts.Password,
		PoolSize: ns.opts.PoolSize, MaxRetries: -1, DialerRetries: 1, DialTimeout: ns.dialTimeout,
		Dialer: ns.dialer(ns.dialTimeout), OnConnect: onConnect,
		ReadTimeout: adminTimeout, WriteTimeout: adminTimeout, ContextTimeoutEnabled: true,
		// Pipelines share the main pool, so PoolSize and PoolTimeout bound them.
		PipelinePoolSize: -1,
		DisableIdentity:  true,
		// TLS, when set, is done by the dialer: TLSConfig stays nil.
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
	}
}

// newBackend makes the admin client for the mode. A cluster client's
// pipeline sends a node's whole batch again when its first command is
// answered TRYAGAIN, LOADING, CLUSTERDOWN, MASTERDOWN or READONLY, or when
// a reply cannot be read (up to MaxRedirects times): it carries only
// scripts that may run twice (debits, kept once by their markers) and
// reads. Scripts that must run once go through Nodes.EvalOnce.
func (ns *Nodes) newBackend(cluster bool) *backend {
	if !cluster {
		return &backend{admin: redis.NewClient(ns.nodeOptions(ns.opts.Addrs[0]))}
	}
	o := ns.nodeOptions("")
	return &backend{cluster: true, admin: redis.NewClusterClient(&redis.ClusterOptions{
		Addrs: ns.opts.Addrs, Username: o.Username, Password: o.Password,
		PoolSize: o.PoolSize, MaxRetries: o.MaxRetries, DialerRetries: o.DialerRetries, DialTimeout: o.DialTimeout,
		Dialer: o.Dialer, OnConnect: o.OnConnect, ReadTimeout: o.ReadTimeout, WriteTimeout: o.WriteTimeout,
		ContextTimeoutEnabled: true, PipelinePoolSize: -1, DisableIdentity: true,
		MaintNotificationsConfig: o.MaintNotificationsConfig,
		// go-redis refreshes its slot map on MOVED, not when a primary
		// stops answering: reload often, so a failover costs seconds.
		ClusterStateReloadInterval: time.Second,
	})}
}

// health is the last probe's finding.
type health struct {
	err   error
	nodes []NodeState
}

// NodeState is one primary as the background probe last found it.
type NodeState struct {
	// Addr is the primary's address.
	Addr string
	// Err is why it did not answer the probe (or load the scripts); ""
	// when it answered.
	Err string
}

// NodeStates lists the primaries the last probe reached or tried, by
// address (no I/O here); nil before the first probe, or when no node
// answered with a slot map (Health then says why).
func (ns *Nodes) NodeStates() []NodeState {
	if h := ns.health.Load(); h != nil {
		return slices.Clone(h.nodes)
	}
	return nil
}

// Health reports the nodes' reachability as the background probe last
// found it (every ProbeInterval; no I/O here), for a readiness detail or a
// log line. It is nil when every primary answered; otherwise its error
// names the nodes that did not, and wraps ErrNotConnected while the store
// is not connected (see Connected). A store that is not healthy still
// serves: checks bound for a node that is down fail at once (not applied),
// so a caller's on_failure policy decides them.
func (ns *Nodes) Health() error {
	if h := ns.health.Load(); h != nil {
		return h.err
	}
	return ErrNotConnected
}

// Connected reports whether the store sends checks: it knows the mode and,
// for a cluster, the slot map, learnt from a node that answered (with
// ModeStandalone, from New on). Until then every check fails at once with
// ErrNotConnected. It stays true through a later outage, when the nodes'
// breakers fail the checks instead.
func (ns *Nodes) Connected() bool { return ns.ready.Load() }

// run probes the nodes every ProbeInterval until they are closed.
func (ns *Nodes) run(life context.Context) {
	t := time.NewTicker(ProbeInterval)
	defer t.Stop()
	for {
		select {
		case <-life.Done():
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(life, probeTimeout)
		ns.probe(ctx)
		cancel()
	}
}

// probe learns the mode when it is not known yet, pings every primary,
// loads the scripts on a primary that answers for the first time since it
// last did not, and records the result for Health.
func (ns *Nodes) probe(ctx context.Context) {
	be := ns.be.Load()
	if be == nil {
		cluster, err := ns.detectMode(ctx)
		if err != nil {
			ns.setHealth(fmt.Errorf("%w: %s: %w", ErrNotConnected, ns.opts.Addrs[0], err))
			return
		}
		ns.beMu.Lock()
		if ns.closed.Load() {
			ns.beMu.Unlock()
			return
		}
		be = ns.newBackend(cluster)
		ns.be.Store(be)
		ns.beMu.Unlock()
	}
	var (
		mu      sync.Mutex
		down    []string
		states  []NodeState
		answers []*redis.Client
	)
	ping := func(ctx context.Context, c *redis.Client) error {
		err := c.Ping(ctx).Err()
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			down = append(down, fmt.Sprintf("%s: %v", c.Options().Addr, err))
			states = append(states, NodeState{Addr: c.Options().Addr, Err: err.Error()})
		} else {
			answers = append(answers, c)
		}
		return nil
	}
	if cc, ok := be.admin.(*redis.ClusterClient); ok {
		if err := cc.ForEachMaster(ctx, ping); err != nil {
			// No slot map: no seed answered.
			err = fmt.Errorf("no node of %s answers: %w", strings.Join(ns.opts.Addrs, ","), err)
			if !ns.ready.Load() {
				err = fmt.Errorf("%w: %w", ErrNotConnected, err)
			}
			ns.setHealth(err)
			ns.markDown(nil)
			return
		}
	} else {
		_ = ping(ctx, be.admin.(*redis.Client))
	}
	ns.ready.Store(true)
	up := make([]string, 0, len(answers))
	for _, c := range answers {
		addr := c.Options().Addr
		up = append(up, addr)
		if !ns.wasUp(addr) {
			// A node seen for the first time, or back: it may have lost
			// the scripts. (EVALSHA falls back to EVAL anyway.)
			if err := ns.loadScripts(ctx, c); err != nil {
				down = append(down, err.Error())
				states = append(states, NodeState{Addr: addr, Err: err.Error()})
				up = up[:len(up)-1]
				continue
			}
		}
		states = append(states, NodeState{Addr: addr})
	}
	ns.markDown(up)
	slices.SortFunc(states, func(a, b NodeState) int { return strings.Compare(a.Addr, b.Addr) })
	if len(down) == 0 {
		ns.setHealthNodes(nil, states)
		return
	}
	slices.Sort(down)
	ns.setHealthNodes(fmt.Errorf("redis nodes not answering: %s", strings.Join(down, "; ")), states)
}

// detectMode asks the one address whether it is a cluster node.
func (ns *Nodes) detectMode(ctx context.Context) (cluster bool, err error) {
	switch {
	case ns.opts.Mode == ModeCluster || len(ns.opts.Addrs) > 1:
		return true, nil
	case ns.opts.Mode == ModeStandalone:
		return false, nil
	}
	c := redis.NewClient(ns.nodeOptions(ns.opts.Addrs[0]))
	defer c.Close()
	info, err := c.Info(ctx, "cluster").Result()
	if err != nil {
		return false, err
	}
	return strings.Contains(info, "cluster_enabled:1"), nil
}

func (ns *Nodes) setHealth(err error) { ns.setHealthNodes(err, nil) }

// setHealthNodes records a probe's finding, err and the primaries' states,
// and sets the store's up gauge.
func (ns *Nodes) setHealthNodes(err error, nodes []NodeState) {
	ns.health.Store(&health{err: err, nodes: nodes})
	if err == nil {
		ns.m.up.Set(1)
	} else {
		ns.m.up.Set(0)
	}
}

// wasUp reports whether the last probe found addr answering.
func (ns *Nodes) wasUp(addr string) bool {
	ns.upMu.Lock()
	defer ns.upMu.Unlock()
	return ns.up[addr]
}

// markDown records the primaries that answered this probe; the others are
// down until they answer again.
func (ns *Nodes) markDown(up []string) {
	ns.upMu.Lock()
	defer ns.upMu.Unlock()
	clear(ns.up)
	for _, a := range up {
		ns.up[a] = true
	}
}

// Load loads every script given to New on every primary that answers, so
// checks run by hash. A node that lost them (a restart, a failover) is
// served by EVAL until the background probe loads them again. Its error
// names the nodes that could not load them.
func (ns *Nodes) Load(ctx context.Context) error {
	be := ns.be.Load()
	if be == nil {
		return ErrNotConnected
	}
	if cc, ok := be.admin.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, ns.loadScripts)
	}
	return ns.loadScripts(ctx, be.admin.(*redis.Client))
}

// Client returns the admin client, for health checks and admin reads; it is
// nil until the store has connected (see Connected) when the mode was left
// to ModeAuto with one address. Its commands take their deadline from their
// context.
func (ns *Nodes) Client() redis.UniversalClient {
	if be := ns.be.Load(); be != nil {
		return be.admin
	}
	return nil
}

// Admin returns the admin client once the nodes are connected: a closed
// Nodes answers redis.ErrClosed, one not connected yet ErrNotConnected. It
// routes keys to nodes (its slot map) and runs the commands and scripts
// given to it with their context's deadline.
func (ns *Nodes) Admin() (redis.UniversalClient, error) {
	if ns.closed.Load() {
		return nil, redis.ErrClosed
	}
	be := ns.be.Load()
	if be == nil || !ns.ready.Load() {
		return nil, ErrNotConnected
	}
	return be.admin, nil
}

// Ping reports whether every primary answers now.
func (ns *Nodes) Ping(ctx context.Context) error {
	be := ns.be.Load()
	if be == nil {
		return ErrNotConnected
	}
	if cc, ok := be.admin.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			return c.Ping(ctx).Err()
		})
	}
	return be.admin.Ping(ctx).Err()
}

// ForEachPrimary calls fn on every primary the admin client knows, at
// once, and returns the errors of the primaries it could not reach, joined.
func (ns *Nodes) ForEachPrimary(ctx context.Context, fn func(ctx context.Context, c *redis.Client) error) error {
	be := ns.be.Load()
	if be == nil {
		return ErrNotConnected
	}
	cc, ok := be.admin.(*redis.ClusterClient)
	if !ok {
		return fn(ctx, be.admin.(*redis.Client))
	}
	var mu sync.Mutex
	var errs []error
	err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		if err := fn(ctx, c); err != nil {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}
		return nil
	})
	if err != nil {
		return err
	}
	return errors.Join(errs...)
}
