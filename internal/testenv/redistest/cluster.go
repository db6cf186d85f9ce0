package redistest

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

const (
	// healthyTimeout bounds WaitHealthy.
	healthyTimeout = 30 * time.Second
	// createTimeout bounds forming the cluster (Cluster.form).
	createTimeout = 30 * time.Second
)

// Cluster is a Redis Cluster of redis-server processes started by
// NewCluster on loopback.
//
// Addrs and Nodes are safe for concurrent use. The other methods report
// failures with Fatalf on the test that created the cluster (or, for
// WaitHealthy, the test given), so call them from that test's goroutine.
// A Cluster is only made by this package.
type Cluster struct {
	t     testing.TB
	nodes []*Node
}

// NewCluster starts primaries*(1+replicasPerPrimary) redis-server processes
// in cluster mode on free loopback ports, forms a cluster of them (the
// first primaries nodes become primaries, each with replicasPerPrimary
// replicas; see form), and returns once WaitHealthy succeeds. The servers are killed when the test ends.
//
// It skips the test when redis-server is missing, or fails it
// if CI is true. A failover needs at least 3 primaries; one primary, which
// serves every slot, suits a test of costs rather than of faults.
func NewCluster(t testing.TB, primaries, replicasPerPrimary int) *Cluster {
	t.Helper()
	server := lookBinary(t, "redis-server")
	if primaries < 1 {
		t.Fatalf("redistest: a redis cluster needs a primary, got %d", primaries)
	}
	if replicasPerPrimary < 0 {
		t.Fatalf("redistest: negative replicas per primary %d", replicasPerPrimary)
	}
	began := time.Now()
	// A cluster formed ahead of this one, when ready (see warm).
	if c := takeWarm(t, server, shape{primaries, replicasPerPrimary}); c != nil {
		c.WaitHealthy(t)
		t.Logf("redistest: redis cluster of %d primaries and %d replicas, formed ahead, healthy in %v",
			primaries, primaries*replicasPerPrimary, time.Since(began).Round(time.Millisecond))
		return c
	}
	root := t.TempDir()
	c := &Cluster{t: t, nodes: make([]*Node, primaries*(1+replicasPerPrimary))}
	errs := make([]error, len(c.nodes))
	var wg sync.WaitGroup
	for i := range c.nodes {
		wg.Go(func() {
			dir := filepath.Join(root, fmt.Sprintf("node%d", i))
			c.nodes[i], errs[i] = newNode(t, server, dir, true)
		})
	}
	wg.Wait()
	for _, n := range c.nodes {
		if n != nil {
			t.Cleanup(n.Stop)
		}
	}
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("redistest: start redis cluster nodes: %v", err)
	}

	started := time.Now()
	ctx, cancel := context.WithTimeout(t.Context(), createTimeout)
	defer cancel()
	if err := c.form(ctx, primaries); err != nil {
		t.Fatalf("redistest: form redis cluster: %v\n%s", err, c.logTails())
	}
	created := time.Now()
	c.WaitHealthy(t)
	t.Logf("redistest: redis cluster of %d primaries and %d replicas healthy in %v (processes %v, forming %v, settling %v)",
		primaries, primaries*replicasPerPrimary, time.Since(began).Round(time.Millisecond),
		started.Sub(began).Round(time.Millisecond), created.Sub(started).Round(time.Millisecond),
		time.Since(created).Round(time.Millisecond))
	return c
}

// form makes the started nodes one cluster, as redis-cli --cluster create
// does but polling where it sleeps a second a step (its create took 2-4 s
// of every cluster's start): each primary takes an equal range of the
// 16384 slots and its own config epoch, the first node meets every other,
// and replica k (node primaries+k) replicates primary k mod primaries once
// it has heard of it.
func (c *Cluster) form(ctx context.Context, primaries int) error {
	ids := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		id, err := command(ctx, n.Addr(), "CLUSTER", "MYID")
		if err != nil {
			return fmt.Errorf("%s: cluster myid: %w", n.Addr(), err)
		}
		ids[i] = id
		// Before any meeting, so that no two nodes claim one epoch.
		if _, err := command(ctx, n.Addr(), "CLUSTER", "SET-CONFIG-EPOCH", strconv.Itoa(i+1)); err != nil {
			return fmt.Errorf("%s: cluster set-config-epoch: %w", n.Addr(), err)
		}
	}
	for i := range primaries {
		lo, hi := i*clusterSlots/primaries, (i+1)*clusterSlots/primaries-1
		addr := c.nodes[i].Addr()
		if _, err := command(ctx, addr, "CLUSTER", "ADDSLOTSRANGE", strconv.Itoa(lo), strconv.Itoa(hi)); err != nil {
			return fmt.Errorf("%s: cluster addslotsrange %d %d: %w", addr, lo, hi, err)
		}
	}
	first := c.nodes[0].Addr()
	for _, n := range c.nodes[1:] {
		if _, err := command(ctx, first, "CLUSTER", "MEET", "127.0.0.1", strconv.Itoa(n.port)); err != nil {
			return fmt.Errorf("%s: cluster meet %s: %w", first, n.Addr(), err)
		}
	}
	for k, n := range c.nodes[primaries:] {
		primary := ids[k%primaries]
		for {
			_, err := command(ctx, n.Addr(), "CLUSTER", "REPLICATE", primary)
			if err == nil {
				break
			}
			// "Unknown node" until gossip has reached it.
			select {
			case <-ctx.Done():
				return fmt.Errorf("%s: cluster replicate %s: %w (%w)", n.Addr(), primary, err, ctx.Err())
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	return nil
}

// clusterSlots is the number of hash slots of a Redis Cluster.
const clusterSlots = 16384

// Addrs returns the addresses of all nodes, primaries and replicas, stopped
// ones included, in creation order.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		addrs[i] = n.Addr()
	}
	return addrs
}

// Nodes returns all nodes in creation order: the primaries at creation
// first, then the replicas.
func (c *Cluster) Nodes() []*Node {
	return slices.Clone(c.nodes)
}

// PrimaryAddrs returns the addresses of the primaries that own slots, as the
// first running node that answers sees them, ordered by their first slot.
// After a failover it names the promoted replicas; call WaitHealthy first
// for a settled answer.
func (c *Cluster) PrimaryAddrs() []string {
	c.t.Helper()
	lastErr := errors.New("no node is running")
	for _, n := range c.nodes {
		if !n.running() {
			continue
		}
		text, err := command(c.t.Context(), n.Addr(), "CLUSTER", "NODES")
		if err != nil {
			lastErr = fmt.Errorf("%s: cluster nodes: %w", n.Addr(), err)
			continue
		}
		entries, err := parseClusterNodes(text)
		if err != nil {
			lastErr = fmt.Errorf("%s: %w", n.Addr(), err)
			continue
		}
		var primaries []clusterNode
		for _, e := range entries {
			if e.flags["master"] && !e.flags["fail"] && len(e.slots) > 0 {
				primaries = append(primaries, e)
			}
		}
		slices.SortFunc(primaries, func(a, b clusterNode) int { return a.firstSlot() - b.firstSlot() })
		addrs := make([]string, len(primaries))
		for i, e := range primaries {
			addrs[i] = e.addr
		}
		return addrs
	}
	c.t.Fatalf("redistest: list redis cluster primaries: %v", lastErr)
	return nil
}

// StopAll kills every node, for tests of a whole-store outage.
func (c *Cluster) StopAll() {
	for _, n := range c.nodes {
		n.Stop()
	}
}

// StartAll restarts every stopped node (see Node.Start) and returns once
// each accepts connections. Call WaitHealthy to wait for the cluster to
// settle.
func (c *Cluster) StartAll() {
	c.t.Helper()
	errs := make([]error, len(c.nodes))
	var wg sync.WaitGroup
	for i, n := range c.nodes {
		wg.Go(func() { errs[i] = n.start() })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		c.t.Fatalf("redistest: restart redis cluster nodes: %v", err)
	}
}

// WaitHealthy waits until the running nodes form a settled cluster, and fails
// t with the last problem seen and the nodes' log tails after 30 s. Settled
// means: every running node reports cluster_state:ok, knows every other
// running node as connected and not failing, and all of them agree on roles
// and slots; no slot belongs to a stopped node; and every running replica
// reports master_link_status:up. Stopped nodes are otherwise ignored.
func (c *Cluster) WaitHealthy(t testing.TB) {
	t.Helper()
	if err := c.Settle(t.Context()); err != nil {
		t.Fatalf("redistest: %v\n%s", err, c.logTails())
	}
}

// Settle is WaitHealthy for a goroutine other than the test's: it returns
// the last problem seen after 30 s (or when ctx ends) instead of failing
// the test. After a primary is stopped, it returns once a replica holds
// every slot of the stopped node: a node restarted before that comes back
// empty and still owning its slots, and its replica then copies the empty
// data set.
func (c *Cluster) Settle(ctx context.Context) error {
	deadline := time.Now().Add(healthyTimeout)
	for {
		err := c.check(ctx)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("redis cluster not healthy after %v: %w", healthyTimeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// check returns nil when the cluster is healthy as WaitHealthy defines it,
// or the first problem found.
func (c *Cluster) check(ctx context.Context) error {
	running := make(map[string]bool)
	ours := make(map[string]bool)
	for _, n := range c.nodes {
		ours[n.Addr()] = true
		if n.running() {
			running[n.Addr()] = true
		}
	}
	if len(running) == 0 {
		return errors.New("no node is running")
	}

	var want, wantFrom string
	for _, n := range c.nodes {
		addr := n.Addr()
		if !running[addr] {
			continue
		}
		info, err := command(ctx, addr, "CLUSTER", "INFO")
		if err != nil {
			return fmt.Errorf("%s: cluster info: %w", addr, err)
		}
		if state := infoField(info, "cluster_state"); state != "ok" {
			return fmt.Errorf("%s: cluster_state:%s", addr, state)
		}
		text, err := command(ctx, addr, "CLUSTER", "NODES")
		if err != nil {
			return fmt.Errorf("%s: cluster nodes: %w", addr, err)
		}
		entries, err := parseClusterNodes(text)
		if err != nil {
			return fmt.Errorf("%s: %w", addr, err)
		}
		idAddr := make(map[string]string, len(entries))
		for _, e := range entries {
			idAddr[e.id] = e.addr
		}

		var view []string
		seen := make(map[string]bool)
		replica := false
		for _, e := range entries {
			switch {
			case !ours[e.addr]:
				return fmt.Errorf("%s: knows a node %s at %q that this helper did not start", addr, e.id, e.addr)
			case !running[e.addr]:
				if e.flags["master"] && len(e.slots) > 0 {
					return fmt.Errorf("%s: slots %s still belong to stopped node %s", addr, strings.Join(e.slots, ","), e.addr)
				}
				continue
			}
			for _, bad := range []string{"fail", "fail?", "handshake", "noaddr"} {
				if e.flags[bad] {
					return fmt.Errorf("%s: sees %s as %s", addr, e.addr, bad)
				}
			}
			if e.link != "connected" {
				return fmt.Errorf("%s: link to %s is %s", addr, e.addr, e.link)
			}
			seen[e.addr] = true
			role := "primary"
			if e.flags["slave"] {
				role = "replica-of " + idAddr[e.master]
				if e.flags["myself"] {
					replica = true
				}
			}
			view = append(view, strings.TrimSpace(e.addr+" "+role+" "+strings.Join(e.slots, " ")))
		}
		for a := range running {
			if !seen[a] {
				return fmt.Errorf("%s: does not know %s yet", addr, a)
			}
		}
		slices.Sort(view)
		v := strings.Join(view, "\n")
		if wantFrom == "" {
			want, wantFrom = v, addr
		} else if v != want {
			return fmt.Errorf("nodes disagree: %s sees\n%s\nwhile %s sees\n%s", wantFrom, want, addr, v)
		}

		if replica {
			info, err := command(ctx, addr, "INFO", "replication")
			if err != nil {
				return fmt.Errorf("%s: info replication: %w", addr, err)
			}
			if link := infoField(info, "master_link_status"); link != "up" {
				return fmt.Errorf("%s: master_link_status:%s", addr, link)
			}
		}
	}
	return nil
}

// logTails returns the log tails of all nodes.
func (c *Cluster) logTails() string {
	var b strings.Builder
	for _, n := range c.nodes {
		if n != nil {
			fmt.Fprintf(&b, "=== node %s (pid %d)\n%s", n.Addr(), n.Pid(), n.logTail())
		}
	}
	return b.String()
}

// clusterNode is one line of CLUSTER NODES.
type clusterNode struct {
	id     string
	addr   string // host:port, without the bus port and hostname
	flags  map[string]bool
	master string // id of the primary of a replica, "-" for a primary
	link   string // "connected" or "disconnected"
	slots  []string
}

// parseClusterNodes parses the reply of CLUSTER NODES.
func parseClusterNodes(text string) ([]clusterNode, error) {
	var nodes []clusterNode
	for line := range strings.Lines(text) {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if len(f) < 8 {
			return nil, fmt.Errorf("short cluster nodes line %q", line)
		}
		addr, _, _ := strings.Cut(f[1], "@")
		addr, _, _ = strings.Cut(addr, ",")
		e := clusterNode{id: f[0], addr: addr, flags: make(map[string]bool), master: f[3], link: f[7], slots: f[8:]}
		for flag := range strings.SplitSeq(f[2], ",") {
			e.flags[flag] = true
		}
		nodes = append(nodes, e)
	}
	return nodes, nil
}

// firstSlot returns the first slot the node owns, or 1<<14 if none.
func (e clusterNode) firstSlot() int {
	for _, s := range e.slots {
		if strings.HasPrefix(s, "[") {
			continue // a slot being migrated or imported
		}
		lo, _, _ := strings.Cut(s, "-")
		if n, err := strconv.Atoi(lo); err == nil {
			return n
		}
	}
	return 1 << 14
}
