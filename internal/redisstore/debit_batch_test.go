package redisstore

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// keysOn returns n keys of distinct slots that client serves, and one key
// that it does not.
func keysOn(t *testing.T, cc *redis.ClusterClient, addr string, n int) (local []string, remote string) {
	t.Helper()
	ctx := context.Background()
	slots := map[int]bool{}
	for i := 0; len(local) < n || remote == ""; i++ {
		k := fmt.Sprint("probe-", i)
		c, err := cc.MasterForKey(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case c.Options().Addr != addr:
			remote = k
		case len(local) < n && !slots[Slot(k)]:
			slots[Slot(k)] = true
			local = append(local, k)
		}
	}
	return local, remote
}

// TestScriptUndeclaredKeys holds the server to what the batched debit
// relies on: a script without a shebang line, sent to the node of its one
// declared key, may write undeclared keys of other slots on that node; an
// undeclared key of another node raises "Script attempted to access a non
// local key in a cluster node", and the writes made before it stay. A
// script with a shebang may not cross slots at all.
func TestScriptUndeclaredKeys(t *testing.T) {
	c := redistest.NewCluster(t, 2, 0)
	ctx := context.Background()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { cc.Close() })
	addr := c.PrimaryAddrs()[0]
	node := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { node.Close() })
	local, remote := keysOn(t, cc, addr, 3)

	const set = "for i = 1, #ARGV do redis.call('SET', ARGV[i], 'v') end return #ARGV"
	if n, err := node.Eval(ctx, set, []string{local[0]}, local[1], local[2]).Int(); err != nil || n != 2 {
		t.Fatalf("undeclared keys of other slots on the node: %v, %v", n, err)
	}
	for _, k := range local[1:] {
		if v, err := node.Get(ctx, k).Result(); err != nil || v != "v" {
			t.Fatalf("GET %s after the script: %q, %v", k, v, err)
		}
	}
	node.Del(ctx, local[1])
	err := node.Eval(ctx, set, []string{local[0]}, local[1], remote).Err()
	if err == nil || !strings.Contains(err.Error(), "Script attempted to access a non local key in a cluster node") {
		t.Fatalf("undeclared key of another node: %v, want the non local key error", err)
	}
	if v, err := node.Get(ctx, local[1]).Result(); err != nil || v != "v" {
		t.Fatalf("the write before the error: %q, %v; want kept", v, err)
	}
	err = node.Eval(ctx, "#!lua\n"+set, []string{local[0]}, local[1]).Err()
	if err == nil || !strings.Contains(err.Error(), "same slot") {
		t.Fatalf("a script with a shebang crossing slots: %v, want refused", err)
	}
}
