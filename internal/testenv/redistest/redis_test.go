package redistest_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// newClusterClient returns a go-redis cluster client with short timeouts,
// closed when the test ends.
//
// go-redis v9.23 reloads the slot map on MOVED, READONLY and every
// ClusterStateReloadInterval (60 s by default), but not when a primary
// refuses connections: after a failover it keeps dialing the dead primary
// until the next reload. Hence the short interval.
func newClusterClient(t *testing.T, addrs []string) *redis.ClusterClient {
	t.Helper()
	c := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs:                      addrs,
		DialTimeout:                time.Second,
		ReadTimeout:                time.Second,
		WriteTimeout:               time.Second,
		ClusterStateReloadInterval: time.Second,
	})
	t.Cleanup(func() { c.Close() })
	return c
}

// newClient returns a go-redis client for one node, closed when the test
// ends.
func newClient(t *testing.T, addr string) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{
		Addr:         addr,
		DialTimeout:  time.Second,
		ReadTimeout:  time.Second,
		WriteTimeout: time.Second,
		MaxRetries:   -1,
	})
	t.Cleanup(func() { c.Close() })
	return c
}

// setGet writes and reads back n keys spread over the cluster's slots.
func setGet(t *testing.T, c *redis.ClusterClient, prefix string, n int) {
	t.Helper()
	ctx := t.Context()
	for i := range n {
		key := fmt.Sprintf("%s:%d", prefix, i)
		if err := c.Set(ctx, key, i, 0).Err(); err != nil {
			t.Fatalf("SET %s: %v", key, err)
		}
		got, err := c.Get(ctx, key).Int()
		if err != nil {
			t.Fatalf("GET %s: %v", key, err)
		}
		if got != i {
			t.Fatalf("GET %s = %d, want %d", key, got, i)
		}
	}
}

func nodeByAddr(t *testing.T, c *redistest.Cluster, addr string) *redistest.Node {
	t.Helper()
	for _, n := range c.Nodes() {
		if n.Addr() == addr {
			return n
		}
	}
	t.Fatalf("no node at %s", addr)
	return nil
}

func role(t *testing.T, addr string) string {
	t.Helper()
	info, err := newClient(t, addr).Info(t.Context(), "replication").Result()
	if err != nil {
		t.Fatalf("INFO replication on %s: %v", addr, err)
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "role:"); ok {
			return v
		}
	}
	t.Fatalf("no role in INFO replication of %s:\n%s", addr, info)
	return ""
}

func TestClusterServesKeysInManySlots(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)

	addrs := c.Addrs()
	if len(addrs) != 3 || len(c.Nodes()) != 3 {
		t.Fatalf("Addrs() = %v, %d nodes; want 3 of each", addrs, len(c.Nodes()))
	}
	primaries := c.PrimaryAddrs()
	if !slices.Equal(slices.Sorted(slices.Values(primaries)), slices.Sorted(slices.Values(addrs))) {
		t.Fatalf("PrimaryAddrs() = %v, want the nodes %v", primaries, addrs)
	}
	pids := make(map[int]bool)
	for _, n := range c.Nodes() {
		if n.Pid() <= 0 || pids[n.Pid()] {
			t.Fatalf("node %s: pid %d, want a distinct positive pid", n.Addr(), n.Pid())
		}
		pids[n.Pid()] = true
	}

	const keys = 1000
	client := newClusterClient(t, addrs)
	setGet(t, client, "key", keys)

	// Each primary must hold part of the keys: the client really routed
	// them by slot.
	total := int64(0)
	for _, addr := range primaries {
		size, err := newClient(t, addr).DBSize(t.Context()).Result()
		if err != nil {
			t.Fatalf("DBSIZE on %s: %v", addr, err)
		}
		if size == 0 {
			t.Errorf("primary %s holds no key", addr)
		}
		total += size
	}
	if total != keys {
		t.Errorf("primaries hold %d keys in all, want %d", total, keys)
	}
}

func TestClusterFailover(t *testing.T) {
	c := redistest.NewCluster(t, 3, 1)
	ctx := t.Context()

	if n := len(c.Nodes()); n != 6 {
		t.Fatalf("%d nodes, want 6", n)
	}
	primaries := c.PrimaryAddrs()
	if len(primaries) != 3 {
		t.Fatalf("PrimaryAddrs() = %v, want 3", primaries)
	}
	for _, n := range c.Nodes() {
		want := "slave"
		if slices.Contains(primaries, n.Addr()) {
			want = "master"
		}
		if got := role(t, n.Addr()); got != want {
			t.Errorf("node %s: role %s, want %s", n.Addr(), got, want)
		}
	}

	client := newClusterClient(t, c.Addrs())
	victim := primaries[0]
	key := ""
	for i := 0; key == ""; i++ {
		k := fmt.Sprintf("failover:%d", i)
		m, err := client.MasterForKey(ctx, k)
		if err != nil {
			t.Fatalf("MasterForKey(%s): %v", k, err)
		}
		if m.Options().Addr == victim {
			key = k
		}
	}
	if err := client.Set(ctx, key, "before", 0).Err(); err != nil {
		t.Fatalf("SET %s: %v", key, err)
	}

	node := nodeByAddr(t, c, victim)
	node.Stop()
	if pid := node.Pid(); pid != 0 {
		t.Fatalf("Pid() = %d after Stop, want 0", pid)
	}
	stopped := time.Now()
	const within = 10 * time.Second
	for {
		attempt, cancel := context.WithTimeout(ctx, time.Second)
		err := client.Set(attempt, key, "after", 0).Err()
		cancel()
		if err == nil {
			break
		}
		if time.Since(stopped) > within {
			t.Fatalf("SET %s still failing %v after stopping primary %s: %v (primaries now %v)", key, within, victim, err, c.PrimaryAddrs())
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("writes succeeded again %v after stopping primary %s", time.Since(stopped).Round(time.Millisecond), victim)

	c.WaitHealthy(t)
	promoted := c.PrimaryAddrs()
	if len(promoted) != 3 || slices.Contains(promoted, victim) {
		t.Fatalf("PrimaryAddrs() = %v after failover, want 3 without %s", promoted, victim)
	}

	// The old primary comes back as a replica of the one that replaced it.
	node.Start()
	if node.Pid() == 0 {
		t.Fatal("Pid() = 0 after Start")
	}
	c.WaitHealthy(t)
	if got := role(t, victim); got != "slave" {
		t.Errorf("restarted old primary %s: role %s, want slave", victim, got)
	}
	if got, err := client.Get(ctx, key).Result(); err != nil || got != "after" {
		t.Errorf("GET %s = %q, %v; want %q", key, got, err, "after")
	}
}

func TestClusterStopAllStartAll(t *testing.T) {
	c := redistest.NewCluster(t, 3, 1)
	ctx := t.Context()

	before := make(map[int]bool)
	for _, n := range c.Nodes() {
		before[n.Pid()] = true
	}
	c.StopAll()
	for _, n := range c.Nodes() {
		if pid := n.Pid(); pid != 0 {
			t.Errorf("node %s: Pid() = %d after StopAll, want 0", n.Addr(), pid)
		}
		if err := newClient(t, n.Addr()).Ping(ctx).Err(); err == nil {
			t.Errorf("node %s answers PING after StopAll", n.Addr())
		}
	}

	c.StartAll()
	c.WaitHealthy(t)
	for _, n := range c.Nodes() {
		if pid := n.Pid(); pid == 0 || before[pid] {
			t.Errorf("node %s: Pid() = %d after StartAll, want a new pid", n.Addr(), pid)
		}
		info, err := newClient(t, n.Addr()).ClusterInfo(ctx).Result()
		if err != nil {
			t.Fatalf("CLUSTER INFO on %s: %v", n.Addr(), err)
		}
		if !strings.Contains(info, "cluster_state:ok") {
			t.Errorf("node %s after StartAll:\n%s", n.Addr(), info)
		}
	}
	if n := len(c.PrimaryAddrs()); n != 3 {
		t.Errorf("%d primaries after StartAll, want 3", n)
	}
	setGet(t, newClusterClient(t, c.Addrs()), "again", 200)
}

func TestNode(t *testing.T) {
	n := redistest.NewNode(t)
	ctx := t.Context()
	client := newClient(t, n.Addr())

	info, err := client.Info(ctx, "cluster").Result()
	if err != nil {
		t.Fatalf("INFO cluster: %v", err)
	}
	if !strings.Contains(info, "cluster_enabled:0") {
		t.Errorf("standalone node has cluster mode on:\n%s", info)
	}
	if err := client.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if got, err := client.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Fatalf("GET = %q, %v; want v", got, err)
	}

	pid := n.Pid()
	n.Stop()
	if err := client.Ping(ctx).Err(); err == nil {
		t.Fatal("PING succeeds after Stop")
	}
	n.Start()
	if n.Pid() == 0 || n.Pid() == pid {
		t.Errorf("Pid() = %d after restart, was %d", n.Pid(), pid)
	}
	if err := client.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING after Start: %v", err)
	}
	// No persistence: a restarted node is empty.
	if err := client.Get(ctx, "k").Err(); !errors.Is(err, redis.Nil) {
		t.Errorf("GET after restart: %v, want redis.Nil", err)
	}
}
