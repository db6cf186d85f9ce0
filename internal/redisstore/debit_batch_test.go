package redisstore

import (
	"context"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
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

// debitLimits are a limit of every algorithm, small enough that the
// debits of the tests overshoot them.
var debitLimits = []bucket.Limit{
	{Algorithm: bucket.TokenBucket, Capacity: 5, RefillPerSecond: 2},
	{Algorithm: bucket.GCRA, Capacity: 5, RefillPerSecond: 2},
	{Algorithm: bucket.SlidingWindow, Capacity: 5, Window: 10 * time.Second},
	{Algorithm: bucket.FixedWindow, Capacity: 5, Window: 10 * time.Second},
	{Algorithm: bucket.SlidingLog, Capacity: 5, Window: 10 * time.Second},
}

// dumpKey is key's value and type as text, and its expiry in ms.
func dumpKey(t *testing.T, rc *redis.Client, key string) (string, int64) {
	t.Helper()
	ctx := context.Background()
	typ, err := rc.Type(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	var v any
	switch typ {
	case "none":
	case "string":
		v, err = rc.Get(ctx, key).Result()
	case "zset":
		v, err = rc.ZRangeWithScores(ctx, key, 0, -1).Result()
	case "hash":
		var h map[string]string
		h, err = rc.HGetAll(ctx, key).Result()
		v = fmt.Sprint(h) // sorted by fmt
	default:
		t.Fatalf("%s: type %s", key, typ)
	}
	if err != nil {
		t.Fatal(err)
	}
	ttl, err := rc.PTTL(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%s %v", typ, v), ttl.Milliseconds()
}

// TestDebitBatchScript: the batched debit script leaves every algorithm's
// buckets and the markers as the one-client script does, client by
// client, and replies for each client what that script replies: across
// messages, redeliveries (which debit nothing), older positions, a new
// epoch and an older one. Both run at the same fixed instants.
func TestDebitBatchScript(t *testing.T) {
	node := redistest.NewNode(t)
	rc := redis.NewClient(&redis.Options{Addr: node.Addr()})
	t.Cleanup(func() { rc.Close() })
	ctx := context.Background()
	one := redis.NewScript(lua.Debit(lua.FixedClock))
	batch := redis.NewScript(lua.DebitBatch(lua.FixedClock))
	// Client i has 1 to 5 buckets, of every algorithm over the clients,
	// and amounts that fit, overshoot, spend nothing or are fractions.
	amounts := []float64{1, 3.5, 0, 7, 2, 0.25, 12}
	const clients = 12
	buckets := func(side string, i int) []ClientDebits {
		c := ClientDebits{Key: side + "-" + strconv.Itoa(i)}
		for b := range 1 + i%5 {
			lim := debitLimits[(i+b)%len(debitLimits)]
			c.Debits = append(c.Debits, Debit{Rule: "r" + strconv.Itoa(b), Limit: lim, Amount: amounts[(i*3+b)%len(amounts)]})
		}
		return []ClientDebits{c}
	}
	t0 := time.Now().UnixMicro()
	for step, m := range []struct {
		epoch, seq int64
		at         time.Duration
		applied    bool
	}{
		{7, 1, 0, true},
		{7, 2, time.Second, true},
		{7, 2, 1500 * time.Millisecond, false}, // a redelivery
		{7, 1, 2 * time.Second, false},         // an older message
		{7, 3, 2 * time.Second, true},
		{9, 1, 3 * time.Second, true}, // the stream made again
		{7, 9, 4 * time.Second, false},
		{9, 2, 12 * time.Second, true}, // the windows moved on
		{9, 3, 30 * time.Second, true},
	} {
		seq, epoch, at := strconv.FormatInt(m.seq, 10), strconv.FormatInt(m.epoch, 10), strconv.FormatInt(t0+m.at.Microseconds(), 10)
		var want []any
		for i := range clients {
			c := buckets("one", i)[0]
			keys, args := debitArgs(PartitionMarkerKey(c.Key, "eu", 0), seq, "60000", epoch, c, limitArgs{})
			out, err := one.Run(ctx, rc, keys, append(args, at)...).Slice()
			if err != nil {
				t.Fatalf("step %d: one-client script: %v", step, err)
			}
			want = append(want, out)
		}
		var calls []pipeline.Call
		var chunk []int
		for i := range clients {
			c := buckets("batch", i)[0]
			keys, args := debitArgs(PartitionMarkerKey(c.Key, "eu", 0), seq, "60000", epoch, c, limitArgs{})
			calls = append(calls, pipeline.Call{Keys: keys, Args: args})
			chunk = append(chunk, i)
		}
		bc := batchCall(calls, chunk)
		got, err := batch.Run(ctx, rc, bc.Keys, append(bc.Args, at)...).Slice()
		if err != nil {
			t.Fatalf("step %d: batched script: %v", step, err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("step %d: batched replies\n%v\nwant the one-client script's\n%v", step, got, want)
		}
		for i, w := range want {
			if applied := w.([]any)[0] == int64(1); applied != m.applied {
				t.Fatalf("step %d: client %d applied %v, want %v", step, i, applied, m.applied)
			}
		}
		for i := range clients {
			a, b := buckets("one", i)[0], buckets("batch", i)[0]
			keys := [][2]string{{PartitionMarkerKey(a.Key, "eu", 0), PartitionMarkerKey(b.Key, "eu", 0)}}
			for j := range a.Debits {
				keys = append(keys, [2]string{Key(a.Debits[j].Rule, a.Key), Key(b.Debits[j].Rule, b.Key)})
			}
			for _, k := range keys {
				va, ta := dumpKey(t, rc, k[0])
				vb, tb := dumpKey(t, rc, k[1])
				if va != vb || math.Abs(float64(ta-tb)) > 1000 {
					t.Fatalf("step %d: %s is %s (ttl %d ms), want %s's %s (ttl %d ms)", step, k[1], vb, tb, k[0], va, ta)
				}
			}
		}
	}
}

// usedOf is what each bucket of clients counts now, in order.
func usedOf(t *testing.T, s *Store, clients []ClientDebits) []float64 {
	t.Helper()
	var reqs []bucket.Request
	for _, c := range clients {
		for _, d := range c.Debits {
			reqs = append(reqs, bucket.Request{Rule: d.Rule, Key: c.Key, Limit: d.Limit})
		}
	}
	used, err := s.Used(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	return used
}

// scriptCalls is the count of EVALSHA and EVAL calls addrs served since
// their stats were reset.
func scriptCalls(t *testing.T, addrs []string) int {
	t.Helper()
	n := 0
	for _, addr := range addrs {
		rc := redis.NewClient(&redis.Options{Addr: addr})
		info, err := rc.Info(context.Background(), "commandstats").Result()
		rc.Close()
		if err != nil {
			t.Fatal(err)
		}
		for line := range strings.Lines(info) {
			name, rest, _ := strings.Cut(strings.TrimSpace(line), ":")
			if name != "cmdstat_evalsha" && name != "cmdstat_eval" {
				continue
			}
			calls, _, _ := strings.Cut(strings.TrimPrefix(rest, "calls="), ",")
			c, _ := strconv.Atoi(calls)
			n += c
		}
	}
	return n
}

func resetStats(t *testing.T, addrs []string) {
	t.Helper()
	for _, addr := range addrs {
		rc := redis.NewClient(&redis.Options{Addr: addr})
		err := rc.ConfigResetStat(context.Background()).Err()
		rc.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
}

// spreadLimits are debitLimits with windows of an hour: the batched and
// the one-client debits of TestApplyDebitsBatched, seconds apart, fall in
// the same window (see awayFromHour).
var spreadLimits = func() []bucket.Limit {
	out := slices.Clone(debitLimits)
	for i := range out {
		if out[i].Window > 0 {
			out[i].Window = time.Hour
		}
	}
	return out
}()

// awayFromHour waits, when the next window of an hour starts within a
// minute, until it has started.
func awayFromHour(t *testing.T) {
	t.Helper()
	now := time.Now()
	if left := now.Truncate(time.Hour).Add(time.Hour).Sub(now); left < time.Minute {
		t.Logf("waiting %v for the next hour", left)
		time.Sleep(left + time.Second)
	}
}

// spread are n clients of every algorithm, with amounts 1 to 7.
func spread(prefix string, n int) []ClientDebits {
	out := make([]ClientDebits, n)
	for i := range out {
		lim := spreadLimits[i%len(spreadLimits)]
		out[i] = ClientDebits{Key: prefix + strconv.Itoa(i), Debits: []Debit{{Rule: "r", Limit: lim, Amount: float64(1 + i%7)}}}
	}
	return out
}

// TestApplyDebitsBatched: ApplyDebits sends a message of 300 clients as 3
// calls (128, 128, 44), on a standalone node as on a 1-primary cluster,
// and leaves each client's bucket and overshoot as a message of that
// client alone does (the one-client script); a redelivery debits nothing.
func TestApplyDebitsBatched(t *testing.T) {
	for _, mode := range []string{"standalone", "cluster"} {
		t.Run(mode, func(t *testing.T) {
			var addrs []string
			if mode == "standalone" {
				addrs = []string{redistest.NewNode(t).Addr()}
			} else {
				addrs = redistest.NewCluster(t, 1, 0).Addrs()
			}
			testApplyDebitsBatched(t, addrs)
		})
	}
}

func testApplyDebitsBatched(t *testing.T, addrs []string) {
	// A loaded machine may leave a call in the queue past the default
	// 50 ms, then fail it as a stalled node: this test is not about that.
	s, _ := newTestStore(t, Options{Addrs: addrs, Timeout: time.Second, MaxQueueWait: 500 * time.Millisecond})
	ctx := context.Background()
	awayFromHour(t)
	const n = 300
	batched, alone := spread("b-", n), spread("a-", n)
	pos := Position{Epoch: 1, Seq: 1}
	resetStats(t, addrs)
	batchedAt := time.Now()
	res, err := s.ApplyDebits(ctx, "eu", pos, time.Minute, batched)
	if err != nil || res.Applied != n {
		t.Fatalf("batched: %+v, %v", res, err)
	}
	if got := scriptCalls(t, addrs); got != 3 {
		t.Errorf("%d clients took %d script calls, want 3", n, got)
	}
	// The token buckets refill (2/s) between a client's two debits: by
	// 0.5 at most, or by what the time between them refilled when a
	// loaded machine took longer than 0.25 s to reach the client.
	tolerance := make([]float64, n)
	for i := range alone {
		if res, err := s.ApplyDebits(ctx, "eu", pos, time.Minute, alone[i:i+1]); err != nil || res.Applied != 1 {
			t.Fatalf("alone %d: %+v, %v", i, res, err)
		}
		tolerance[i] = max(0.5, 2*time.Since(batchedAt).Seconds()+0.05)
	}
	ub, ua := usedOf(t, s, batched), usedOf(t, s, alone)
	for i := range n {
		if math.Abs(ub[i]-ua[i]) > tolerance[i] {
			t.Errorf("client %d (%s): batched counts %v, alone %v", i, batched[i].Debits[0].Limit.Algorithm, ub[i], ua[i])
		}
		if ob, oa := batched[i].Debits[0].Overshoot, alone[i].Debits[0].Overshoot; math.Abs(ob-oa) > tolerance[i] {
			t.Errorf("client %d (%s): batched overshoot %v, alone %v", i, batched[i].Debits[0].Limit.Algorithm, ob, oa)
		}
	}
	if res, err := s.ApplyDebits(ctx, "eu", pos, time.Minute, batched); err != nil || res.Duplicates != n {
		t.Fatalf("redelivered: %+v, %v; want %d duplicates", res, err, n)
	}
	for i, u := range usedOf(t, s, batched) {
		if u > ub[i]+1e-9 {
			t.Errorf("client %d: %v after the redelivery, %v before", i, u, ub[i])
		}
	}
}

// windowClients are n clients of one fixed window that no test reaches
// (a count is exactly its debits), with amounts 1 to 7, of keys of
// distinct slots.
func windowClients(prefix string, n int) []ClientDebits {
	lim := bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 1e9, Window: 1000 * time.Hour}
	out := make([]ClientDebits, 0, n)
	slots := map[int]bool{}
	for i := 0; len(out) < n; i++ {
		k := prefix + strconv.Itoa(i)
		if slots[Slot(Key("w", k))] {
			continue
		}
		slots[Slot(Key("w", k))] = true
		out = append(out, ClientDebits{Key: k, Debits: []Debit{{Rule: "w", Limit: lim, Amount: float64(1 + len(out)%7)}}})
	}
	return out
}

// wantDebited fails t unless each client's bucket counts its amount times
// times.
func wantDebited(t *testing.T, s *Store, clients []ClientDebits, times float64) {
	t.Helper()
	for i, u := range usedOf(t, s, clients) {
		if want := times * clients[i].Debits[0].Amount; u != want {
			t.Errorf("client %s counts %v, want %v", clients[i].Key, u, want)
		}
	}
}

// TestApplyDebitsPrimaries: the clients of a message that span three
// primaries are debited once each, with one call per primary.
func TestApplyDebitsPrimaries(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	s, _ := newTestStore(t, Options{Addrs: c.Addrs(), Timeout: time.Second})
	ctx := context.Background()
	clients := windowClients("p-", 120)
	on := map[string]int{}
	admin, err := s.nodes.Admin()
	if err != nil {
		t.Fatal(err)
	}
	for _, cl := range clients {
		n, err := admin.(*redis.ClusterClient).MasterForKey(ctx, Key("w", cl.Key))
		if err != nil {
			t.Fatal(err)
		}
		on[n.Options().Addr]++
	}
	if len(on) != 3 {
		t.Fatalf("clients on %v, want 3 primaries", on)
	}
	resetStats(t, c.PrimaryAddrs())
	for range 2 {
		res, err := s.ApplyDebits(ctx, "eu", Position{Epoch: 1, Seq: 4}, time.Minute, clients)
		if err != nil || res.Applied+res.Duplicates != len(clients) {
			t.Fatalf("%+v, %v", res, err)
		}
	}
	if got := scriptCalls(t, c.PrimaryAddrs()); got != 6 {
		t.Errorf("two messages on 3 primaries took %d script calls, want 6", got)
	}
	wantDebited(t, s, clients, 1)
}

// TestApplyDebitsFallback: a batched call that fails, here because one
// of its clients is not on the node it went to, is sent again client by
// client, and each client is debited once: the ones the failed call
// applied before its error are duplicates.
func TestApplyDebitsFallback(t *testing.T) {
	t.Run("misgrouped", func(t *testing.T) {
		c := redistest.NewCluster(t, 3, 0)
		s, reg := newTestStore(t, Options{Addrs: c.Addrs(), Timeout: time.Second})
		s.debitNode = func(string) string { return "one" } // every client on one node
		clients := windowClients("m-", 60)
		res, err := s.ApplyDebits(context.Background(), "eu", Position{Epoch: 1, Seq: 1}, time.Minute, clients)
		if err != nil || res.Applied+res.Duplicates != len(clients) || res.Duplicates == 0 {
			t.Fatalf("%+v, %v; want all applied, some by the failed call (duplicates)", res, err)
		}
		if got := testenv.MetricValue(t, reg, "limiter_store_debit_fallbacks_total"); got != 1 {
			t.Errorf("limiter_store_debit_fallbacks_total = %v, want 1", got)
		}
		wantDebited(t, s, clients, 1)
	})
	t.Run("slot moved", func(t *testing.T) {
		c := redistest.NewCluster(t, 2, 0)
		s, reg := newTestStore(t, Options{Addrs: c.Addrs(), Timeout: time.Second})
		ctx := context.Background()
		admin, err := s.nodes.Admin()
		if err != nil {
			t.Fatal(err)
		}
		cc := admin.(*redis.ClusterClient)
		clients := windowClients("s-", 40)
		var from, to string
		var moved int // the second client of the first one's node
		for i, cl := range clients {
			n, err := cc.MasterForKey(ctx, PartitionMarkerKey(cl.Key, "eu", 0))
			if err != nil {
				t.Fatal(err)
			}
			if i == 0 {
				from = n.Options().Addr
			} else if n.Options().Addr == from {
				moved = i
				break
			}
		}
		for _, a := range c.PrimaryAddrs() {
			if a != from {
				to = a
			}
		}
		id := func(addr string) string {
			rc := redis.NewClient(&redis.Options{Addr: addr})
			defer rc.Close()
			v, err := rc.Do(ctx, "CLUSTER", "MYID").Text()
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
		slot := Slot(Key("w", clients[moved].Key))
		toID := id(to)
		s.beforeDebitBatch = func() {
			// Between the grouping and the call: the slot, empty, is
			// given to the other primary.
			for _, addr := range []string{from, to} {
				rc := redis.NewClient(&redis.Options{Addr: addr})
				err := rc.Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", toID).Err()
				rc.Close()
				if err != nil {
					t.Errorf("%s: cluster setslot %d node %s: %v", addr, slot, toID, err)
				}
			}
			s.beforeDebitBatch = nil
		}
		res, err := s.ApplyDebits(ctx, "eu", Position{Epoch: 1, Seq: 1}, time.Minute, clients)
		if err != nil || res.Applied+res.Duplicates != len(clients) || res.Duplicates != 1 {
			t.Fatalf("%+v, %v; want all applied, one by the failed call", res, err)
		}
		if n, err := cc.MasterForKey(ctx, Key("w", clients[moved].Key)); err != nil || n.Options().Addr != to {
			t.Errorf("the moved client is on %v (%v), want %s", n, err, to)
		}
		if got := testenv.MetricValue(t, reg, "limiter_store_debit_fallbacks_total"); got != 1 {
			t.Errorf("limiter_store_debit_fallbacks_total = %v, want 1", got)
		}
		wantDebited(t, s, clients, 1)
		res, err = s.ApplyDebits(ctx, "eu", Position{Epoch: 1, Seq: 2}, time.Minute, clients)
		if err != nil || res.Applied != len(clients) {
			t.Fatalf("the next message: %+v, %v", res, err)
		}
		wantDebited(t, s, clients, 2)
	})
}
