package redistest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// warm holds Redis Clusters formed before a test asks for them, up to
// warmDepth per shape (primaries, replicas) NewCluster was asked for. A primary of a new
// cluster reports cluster_state:ok only a cluster-node-timeout (2 s here)
// after it last saw itself in a minority (Redis's rejoin delay), so every
// cluster of fresh processes spends 2 s settling: over a package's tests,
// minutes. NewCluster takes a formed cluster of its shape when one is
// ready and forms the next in the background, while the test runs.
//
// An idle cluster's servers are killed with the test binary (Pdeathsig,
// see testenv.StartProcess); its directories are outside any test's,
// removed by the test that takes it, or, left by a binary that ended,
// by the next binary that forms one (see removeStale).
var warm struct {
	mu      sync.Mutex
	ready   map[shape][]*Cluster
	forming map[shape]int
}

// warmDepth is how many clusters of a shape are kept formed or forming:
// three, since a test often takes less time than forming one, and the
// multi-region tests take three at once.
const warmDepth = 3

type shape struct{ primaries, replicas int }

// takeWarm returns a formed cluster of shape s, now owned by t (its nodes
// stopped and removed when t ends), or nil when none is ready; either way
// it starts forming the next one of s.
func takeWarm(t testing.TB, server string, s shape) *Cluster {
	warm.mu.Lock()
	if warm.forming == nil {
		warm.ready, warm.forming = map[shape][]*Cluster{}, map[shape]int{}
	}
	var c *Cluster
	if r := warm.ready[s]; len(r) > 0 {
		c, warm.ready[s] = r[0], r[1:]
	}
	for len(warm.ready[s])+warm.forming[s] < warmDepth {
		warm.forming[s]++
		go formWarm(server, s)
	}
	warm.mu.Unlock()
	if c == nil {
		return nil
	}
	c.t = t
	for _, n := range c.nodes {
		n.t = t
		dir := n.dir
		t.Cleanup(func() {
			n.Stop()
			os.RemoveAll(dir)
		})
	}
	return c
}

// formWarm forms a cluster of shape s with no test and makes it the
// ready one of s. A cluster that fails to form is given up (NewCluster
// then forms its own).
func formWarm(server string, s shape) {
	c, err := formIdle(server, s)
	warm.mu.Lock()
	defer warm.mu.Unlock()
	warm.forming[s]--
	if err == nil {
		warm.ready[s] = append(warm.ready[s], c)
	}
}

// warmPrefix names the directories of warm clusters' nodes; each holds
// warmOwner, the pid of the test binary that started it.
const (
	warmPrefix = "redistest-warm-"
	warmOwner  = "owner.pid"
)

var removeStaleOnce sync.Once

// removeStale removes the warm directories whose test binary has ended.
func removeStale() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), warmPrefix+"*"))
	for _, dir := range dirs {
		b, err := os.ReadFile(filepath.Join(dir, warmOwner))
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 || !alive(pid) {
			os.RemoveAll(dir)
		}
	}
}

func alive(pid int) bool {
	p, err := os.FindProcess(pid)
	if err != nil {
		return false
	}
	return !errors.Is(p.Signal(syscall.Signal(0)), os.ErrProcessDone)
}

func formIdle(server string, s shape) (*Cluster, error) {
	removeStaleOnce.Do(removeStale)
	ctx, cancel := context.WithTimeout(context.Background(), createTimeout+healthyTimeout)
	defer cancel()
	c := &Cluster{nodes: make([]*Node, s.primaries*(1+s.replicas))}
	discard := func(err error) (*Cluster, error) {
		for _, n := range c.nodes {
			if n != nil {
				n.Stop()
				os.RemoveAll(n.dir)
			}
		}
		return nil, err
	}
	for i := range c.nodes {
		dir, err := os.MkdirTemp("", fmt.Sprintf("%s%d-", warmPrefix, i))
		if err != nil {
			return discard(err)
		}
		if err := os.WriteFile(filepath.Join(dir, warmOwner), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
			os.RemoveAll(dir)
			return discard(err)
		}
		if c.nodes[i], err = startNode(ctx, server, dir, true, nil, nil); err != nil {
			os.RemoveAll(dir)
			return discard(err)
		}
	}
	if err := c.form(ctx, s.primaries); err != nil {
		return discard(err)
	}
	for {
		err := c.check(ctx)
		if err == nil {
			return c, nil
		}
		select {
		case <-ctx.Done():
			return discard(errors.Join(err, ctx.Err()))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// IgnoreWarm are the goroutines of clusters formed ahead, which outlive
// the tests that start them, for goleak.
func IgnoreWarm() []goleak.Option {
	return []goleak.Option{
		goleak.IgnoreAnyFunction("github.com/limiterd/limiterd/internal/testenv/redistest.formWarm"),
		goleak.IgnoreAnyFunction("github.com/limiterd/limiterd/internal/testenv.StartProcess.func1"),
	}
}
