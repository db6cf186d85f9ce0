package redisstore

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// messagesOf are n messages from seq 1 of per clients each of clients,
// the clients of message m starting at m*step: with step < per, a client
// is in several messages.
func messagesOf(clients []ClientDebits, n, per, step int) []MessageDebits {
	out := make([]MessageDebits, n)
	for m := range out {
		out[m].Pos = Position{Epoch: 1, Seq: uint64(m + 1)}
		for i := range per {
			c := clients[(m*step+i)%len(clients)]
			out[m].Clients = append(out[m].Clients, ClientDebits{Key: c.Key, Debits: []Debit{c.Debits[0]}})
		}
	}
	return out
}

// debitedTimes is how many of msgs each client is in.
func debitedTimes(msgs []MessageDebits) map[string]float64 {
	out := map[string]float64{}
	for _, m := range msgs {
		for _, c := range m.Clients {
			out[c.Key]++
		}
	}
	return out
}

// TestApplyMessagesOneRoundTrip: 8 messages of 5 clients on 3 primaries
// cost one record call and one debit call per primary, not two calls per
// message; each client is debited once per message it is in, and the
// same messages delivered again debit nothing.
func TestApplyMessagesOneRoundTrip(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	s, _ := newTestStore(t, Options{Addrs: c.Addrs(), Timeout: time.Second})
	ctx := context.Background()
	clients := windowClients("o-", 24)
	msgs := messagesOf(clients, 8, 5, 3) // clients in one or two messages
	recs := make([]Record, len(msgs))
	for i, m := range msgs {
		recs[i] = Record{Instance: "i-1", Seq: uint64(i + 1), Pos: m.Pos}
	}
	resetStats(t, c.PrimaryAddrs())
	firsts, errs := s.FirstSeenMany(ctx, "eu.0", recs, time.Minute)
	for i := range recs {
		if errs[i] != nil || firsts[i] != recs[i].Pos.String() {
			t.Fatalf("record %d: %q, %v", i, firsts[i], errs[i])
		}
	}
	if got := scriptCalls(t, c.PrimaryAddrs()); got > 3 {
		t.Errorf("8 messages' records took %d script calls, want one per primary (3) at most", got)
	}
	resetStats(t, c.PrimaryAddrs())
	res, err := s.ApplyMessages(ctx, "eu", time.Minute, msgs)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		if r.Applied != 5 {
			t.Errorf("message %d: %+v, want 5 applied", i, r)
		}
	}
	if got := scriptCalls(t, c.PrimaryAddrs()); got != 3 {
		t.Errorf("8 messages' debits took %d script calls, want one per primary (3)", got)
	}
	times := debitedTimes(msgs)
	for _, cl := range clients {
		wantDebited(t, s, []ClientDebits{cl}, times[cl.Key])
	}
	res, err = s.ApplyMessages(ctx, "eu", time.Minute, msgs)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		if r.Duplicates != 5 {
			t.Errorf("message %d delivered again: %+v, want 5 duplicates", i, r)
		}
	}
	for _, cl := range clients {
		wantDebited(t, s, []ClientDebits{cl}, times[cl.Key])
	}
}

// TestFirstSeenManyReplay: a flush delivered again under a new position
// in the same batch, or after it, is a replay; a redelivery of a message
// is not.
func TestFirstSeenManyReplay(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	s, _ := newTestStore(t, Options{Addrs: c.Addrs(), Timeout: time.Second})
	ctx := context.Background()
	pos := func(seq uint64) Position { return Position{Epoch: 1, Seq: seq} }
	recs := []Record{
		{Instance: "a", Seq: 1, Pos: pos(10)},
		{Instance: "a", Seq: 2, Pos: pos(11)},
		{Instance: "a", Seq: 1, Pos: pos(12)}, // flush 1 again: a replay
		{Instance: "b", Seq: 1, Pos: pos(13)},
	}
	want := []string{pos(10).String(), pos(11).String(), pos(10).String(), pos(13).String()}
	firsts, errs := s.FirstSeenMany(ctx, "eu.0", recs, time.Minute)
	for i := range recs {
		if errs[i] != nil || firsts[i] != want[i] {
			t.Errorf("record %d: %q, %v; want %q", i, firsts[i], errs[i], want[i])
		}
	}
	// Delivered again: the first three, with a fourth new one.
	recs = append(recs[:3:3], Record{Instance: "b", Seq: 2, Pos: pos(14)})
	want = []string{pos(10).String(), pos(11).String(), pos(10).String(), pos(14).String()}
	firsts, errs = s.FirstSeenMany(ctx, "eu.0", recs, time.Minute)
	for i := range recs {
		if errs[i] != nil || firsts[i] != want[i] {
			t.Errorf("again, record %d: %q, %v; want %q", i, firsts[i], errs[i], want[i])
		}
	}
}

// TestApplyMessagesClientOrder: a client whose debit of a message fails
// (its slot set migrating to a node that does not import it: the call
// bounces between the two until go-redis gives up) is not debited by the
// later messages of the batch, which fail with it, so that what goes to
// the retry stream keeps its order; the other clients are applied once
// per message, in order, by the batched call or by the fallback. Applied
// again, the failed messages debit it in order.
func TestApplyMessagesClientOrder(t *testing.T) {
	c := redistest.NewCluster(t, 2, 0)
	s, _ := newTestStore(t, Options{Addrs: c.Addrs(), Timeout: 300 * time.Millisecond})
	ctx := context.Background()
	admin, err := s.nodes.Admin()
	if err != nil {
		t.Fatal(err)
	}
	cc := admin.(*redis.ClusterClient)
	nodeOf := func(key string) string {
		n, err := cc.MasterForKey(ctx, PartitionMarkerKey(key, "eu", 0))
		if err != nil {
			t.Fatal(err)
		}
		return n.Options().Addr
	}
	// Clients 0, 2, 3, 4 on one primary, client 1 (bad) on the other.
	all := windowClients("c-", 64)
	var clients []ClientDebits
	var bad ClientDebits
	for _, cl := range all {
		switch {
		case len(clients) > 0 && nodeOf(cl.Key) != nodeOf(clients[0].Key):
			if bad.Key == "" {
				bad = cl
			}
		case len(clients) < 4:
			clients = append(clients, cl)
		}
	}
	clients = append(clients[:1], append([]ClientDebits{bad}, clients[1:]...)...)
	msgs := messagesOf(clients, 3, 5, 0) // every client in every message
	// Every client grouped on one node: the batched call fails at the bad
	// one, and all go again one call each.
	s.debitNode = func(string) string { return "one" }
	from := nodeOf(bad.Key)
	var to string
	for _, a := range c.PrimaryAddrs() {
		if a != from {
			to = a
		}
	}
	command := func(addr string, args ...any) string {
		rc := redis.NewClient(&redis.Options{Addr: addr})
		defer rc.Close()
		v, err := rc.Do(ctx, args...).Text()
		if err != nil {
			t.Fatalf("%s %v: %v", addr, args, err)
		}
		return v
	}
	slot := Slot(bad.Key)
	s.beforeDebitRound = func(round int) {
		switch round {
		case 0:
			command(from, "CLUSTER", "SETSLOT", slot, "MIGRATING", command(to, "CLUSTER", "MYID"))
		case 1:
			command(from, "CLUSTER", "SETSLOT", slot, "STABLE")
		}
	}
	res, err := s.ApplyMessages(ctx, "eu", time.Minute, msgs)
	if err == nil {
		t.Fatal("no error, want the paused client's")
	}
	for m, r := range res {
		if len(r.Failed) != 1 || r.Failed[0] != 1 || r.Applied+r.Duplicates != 4 {
			t.Errorf("message %d: %+v, want client 1 failed, the 4 others applied", m, r)
		}
	}
	good := append([]ClientDebits{clients[0]}, clients[2:]...)
	for _, cl := range good {
		wantDebited(t, s, []ClientDebits{cl}, 3)
	}
	wantDebited(t, s, []ClientDebits{bad}, 0)
	s.beforeDebitRound = nil
	res, err = s.ApplyMessages(ctx, "eu", time.Minute, msgs)
	if err != nil {
		t.Fatal(err)
	}
	for m, r := range res {
		if r.Applied != 1 || r.Duplicates != 4 {
			t.Errorf("again, message %d: %+v, want the failed client applied, 4 duplicates", m, r)
		}
	}
	wantDebited(t, s, []ClientDebits{bad}, 3)
	for _, cl := range good {
		wantDebited(t, s, []ClientDebits{cl}, 3)
	}
}

// TestApplyMessagesChunks: 3 messages of the same 100 clients are 300
// client calls, sent as chunks of at most 128 in which each client's 3
// stay together: 42 clients (126 calls), 42, then 16, 3 script calls;
// each client is debited 3 times.
func TestApplyMessagesChunks(t *testing.T) {
	node := redistest.NewNode(t)
	addrs := []string{node.Addr()}
	s, _ := newTestStore(t, Options{Addrs: addrs, Timeout: time.Second})
	clients := windowClients("k-", 100)
	msgs := messagesOf(clients, 3, 100, 0)
	resetStats(t, addrs)
	res, err := s.ApplyMessages(context.Background(), "eu", time.Minute, msgs)
	if err != nil {
		t.Fatal(err)
	}
	for m, r := range res {
		if r.Applied != 100 {
			t.Errorf("message %d: %+v, want 100 applied", m, r)
		}
	}
	if got := scriptCalls(t, addrs); got != 3 {
		t.Errorf("300 client calls took %d script calls, want 3", got)
	}
	for _, cl := range clients {
		wantDebited(t, s, []ClientDebits{cl}, 3)
	}
}
