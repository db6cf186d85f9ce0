package redisstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// Debit is one bucket's share of a client's spends in another region.
type Debit struct {
	Rule   string
	Limit  bucket.Limit
	Amount float64
	// Reset says the source region put the bucket back to full before it
	// admitted Amount: the bucket is put back to full here too, then
	// debited, in the same script and at most once.
	Reset bool
	// At is the instant (µs since the epoch) Amount is debited as of: its
	// last admission, read on the source's clock, with the clock allowance
	// added. 0, or an instant after the store's now, is now. A spend that
	// has refilled by now writes nothing (see bucket.Limit.DebitAt).
	At int64
	// Seen is the last admission (µs since the epoch, on the source's
	// clock, without the allowance), or 0 when unknown. A token bucket's,
	// GCRA's or window's debit that leaves it near empty records, with Seen, how
	// much the source spends and how late its spends arrive: a check near
	// the limit leaves that much for the spends still in flight (the hold,
	// lua/hold.lua). A debit with Seen 0 records nothing.
	Seen int64
	// Overshoot is set by ApplyDebits: by how much the admissions this
	// region knows of exceed the limit right after the debit.
	Overshoot float64
}

// ClientDebits are the debits of one client from one message.
type ClientDebits struct {
	Key    string
	Debits []Debit
}

// PartitionMarkerKey is the key that records the position ("<epoch> <seq>")
// of the last message of partition p of region src applied to the buckets
// of key from this region's inbound stream. It shares the buckets' hash
// tag, so one script checks it and debits them; no rule id starts with '~'.
// A key changes partition only when the partition count does; a marker per
// partition keeps each partition's order its own, so a message of the old
// partition applied after one of the new is still applied. No region name
// holds '.'.
func PartitionMarkerKey(key, src string, p int) string {
	return Key(Position{Partition: p}.markerRule(src), key)
}

// Position is a message's place in the stream it is applied from.
type Position struct {
	// Epoch is the stream's creation (µs since the epoch), which tells a
	// stream made again, whose sequences restart at 1, from the one it
	// replaces. It is above 0.
	Epoch int64
	// Seq is the message's stream sequence.
	Seq uint64
	// Partition is the partition of the source's spends whose subject the
	// message came on: each partition has its own markers, since the
	// partitions are applied side by side, not in one stream order.
	Partition int
}

// String is the position as a flush's record holds it.
func (p Position) String() string {
	return strconv.FormatInt(p.Epoch, 10) + ":" + strconv.FormatUint(p.Seq, 10)
}

// markerRule is what stands for a rule in the marker keys of src at p
// (PartitionMarkerKey): the marker of key is Key(p.markerRule(src), key).
func (p Position) markerRule(src string) string {
	return "~in:" + src + "." + strconv.Itoa(p.Partition)
}

// MessageKey is the key that records the first stream position of the
// spend message part of flush seq of instance in region src. Its hash tag
// is the instance's, so one instance's records share a slot; no rule id
// starts with '~' and no region name holds '/'.
func MessageKey(src, instance string, seq uint64, part uint32) string {
	return messageKey(src+"/"+instance, seq, part)
}

func messageKey(tag string, seq uint64, part uint32) string {
	return Key("~msg:"+strconv.FormatUint(seq, 10)+":"+strconv.FormatUint(uint64(part), 10), tag)
}

// recordKeys are the two keys of a flush's record: MessageKey, and a copy
// on another primary (a tag suffix chosen by where the cluster puts it), so
// that one primary down still leaves a record to read and write.
func recordKeys(ctx context.Context, admin redis.UniversalClient, src, instance string, seq uint64, part uint32) []string {
	tag := src + "/" + instance
	keys := []string{messageKey(tag, seq, part)}
	cc, ok := admin.(*redis.ClusterClient)
	if !ok {
		return keys
	}
	first, err := cc.MasterForKey(ctx, keys[0])
	if err != nil {
		return append(keys, messageKey(tag+"/1", seq, part))
	}
	for i := 1; i <= 32; i++ {
		k := messageKey(tag+"/"+strconv.Itoa(i), seq, part)
		if c, err := cc.MasterForKey(ctx, k); err == nil && c.Options().Addr != first.Options().Addr {
			return append(keys, k)
		}
	}
	return append(keys, messageKey(tag+"/1", seq, part))
}

// ErrNotRecorded says that no copy of a flush's record could be read or
// written: whether the message is a replay is unknown.
var ErrNotRecorded = errors.New("flush record unavailable")

// FirstSeen records that the spend message part of flush seq of instance
// in region src is delivered at pos, unless a record of it exists, and
// returns the position of its first delivery: a result other than
// pos.String() is a replay (the same flush published again as a new stream
// message), which must not be applied. The record is kept twice, on two
// primaries; one copy answering is enough (an error wrapping
// ErrNotRecorded when none does). It lives ttl, which must outlast the
// stream's keeping of a message. One small key per message and copy (about
// 180 bytes of Redis memory with its expiry, measured on Redis 7.0).
func (s *Store) FirstSeen(ctx context.Context, src, instance string, seq uint64, part uint32, pos Position, ttl time.Duration) (string, error) {
	firsts, errs := s.FirstSeenMany(ctx, src, []Record{{Instance: instance, Seq: seq, Part: part, Pos: pos}}, ttl)
	return firsts[0], errs[0]
}

// Record names one spend message for FirstSeenMany: part Part of flush
// Seq of Instance, delivered at Pos.
type Record struct {
	Instance string
	Seq      uint64
	Part     uint32
	Pos      Position
}

// FirstSeenMany is FirstSeen of several messages of src, in their order,
// in one round trip: the records' copies are grouped by the node that
// serves them, and each node's go in one script call (of batchClients
// records at most), one pipeline for all. A call that fails is made again
// record by record. It returns, per record, the position of its first
// delivery, or an error wrapping ErrNotRecorded. A flush delivered twice
// among recs is recorded by the first.
func (s *Store) FirstSeenMany(ctx context.Context, src string, recs []Record, ttl time.Duration) ([]string, []error) {
	firsts, errs := make([]string, len(recs)), make([]error, len(recs))
	admin, err := s.nodes.Admin()
	if err != nil {
		for i := range recs {
			errs[i] = err
		}
		return firsts, errs
	}
	ttlArg := strconv.FormatInt(max(ttl.Milliseconds(), 1), 10)
	// One call per copy of each record, as seen.lua takes it.
	var calls []pipeline.Call
	var owner []int
	for r, rec := range recs {
		for _, k := range recordKeys(ctx, admin, src, rec.Instance, rec.Seq, rec.Part) {
			calls = append(calls, pipeline.Call{Script: seenScript, Keys: []string{k}, Args: []any{rec.Pos.String(), ttlArg}})
			owner = append(owner, r)
		}
	}
	replies := make([]debitReply, len(calls))
	groups, alone := s.debitGroups(ctx, admin, calls)
	var chunks [][]int
	for _, g := range groups {
		for len(g) > 0 {
			n := min(len(g), batchClients)
			if n == 1 {
				alone = append(alone, g[0])
			} else {
				chunks = append(chunks, g[:n])
			}
			g = g[n:]
		}
	}
	if len(chunks) > 0 {
		batch := make([]pipeline.Call, len(chunks))
		for k, chunk := range chunks {
			args := make([]any, 0, 1+2*len(chunk))
			args = append(args, ttlArg)
			for _, i := range chunk {
				args = append(args, calls[i].Keys[0], calls[i].Args[0])
			}
			batch[k] = pipeline.Call{Script: seenBatchScript, Keys: calls[chunk[0]].Keys, Args: args}
		}
		cmds, _ := pipeline.RunScripts(ctx, admin, batch)
		for k, chunk := range chunks {
			out, err := cmds[k].StringSlice()
			if err != nil || len(out) != len(chunk) {
				alone = append(alone, chunk...)
				continue
			}
			for m, i := range chunk {
				replies[i].out = []any{out[m]}
			}
		}
	}
	if len(alone) > 0 {
		slices.Sort(alone)
		one := make([]pipeline.Call, len(alone))
		for k, i := range alone {
			one[k] = calls[i]
		}
		cmds, _ := pipeline.RunScripts(ctx, admin, one)
		for k, i := range alone {
			v, err := cmds[k].Text()
			replies[i] = debitReply{out: []any{v}, err: err}
		}
	}
	copyErrs := make([][]error, len(recs))
	for i, r := range replies {
		rec := owner[i]
		if r.err != nil {
			copyErrs[rec] = append(copyErrs[rec], r.err)
			continue
		}
		v, _ := r.out[0].(string)
		if first := firsts[rec]; first == "" || v != recs[rec].Pos.String() {
			firsts[rec] = v
		}
	}
	for r := range recs {
		if firsts[r] == "" {
			s.m.errors[opDebit].Inc()
			errs[r] = fmt.Errorf("record message: %w: %w", ErrNotRecorded, errors.Join(copyErrs[r]...))
		}
	}
	return firsts, errs
}

// DebitResult is what ApplyDebits did.
type DebitResult struct {
	// Applied and Duplicates count the clients debited and those whose
	// marker showed the message applied already. Refilled counts those
	// whose every spend had refilled by the time it arrived, debited as of
	// its At: nothing was written for them, the marker neither.
	Applied, Duplicates, Refilled int
	// Failed are the indexes of the clients whose script failed (their
	// node down or unreachable): applying them again is safe.
	Failed []int
}

// ApplyDebits applies message pos of region src: per client, the debits
// of every bucket unless the client's marker shows pos applied already.
// It is ApplyMessages of one message.
func (s *Store) ApplyDebits(ctx context.Context, src string, pos Position, markerTTL time.Duration, clients []ClientDebits) (DebitResult, error) {
	res, err := s.ApplyMessages(ctx, src, markerTTL, []MessageDebits{{Pos: pos, Clients: clients}})
	return res[0], err
}

// MessageDebits are the debits of the clients of one message, at its
// position.
type MessageDebits struct {
	Pos     Position
	Clients []ClientDebits
}

// ApplyMessages applies messages of region src, in their order (the
// stream's): per message and client, the debits of every bucket unless the
// client's marker shows the message applied already. The clients of all
// the messages are grouped by the node that serves them, and each group's
// clients go in chunks (batchClients, batchBytes) of one script call each;
// the calls are pipelined, one pipeline per node, so a node that is down
// fails only its own clients, and several messages cost one round trip. A
// client of several messages comes once per message, in their order, and
// never across two chunks. A chunk whose call fails (its node down, a slot
// moved since the grouping: any error) is applied again client by client,
// one script each, a client's messages in their order; the markers make
// the clients the failed call applied before its error duplicates. Once a
// client's debit of a message fails, its debits of the later messages are
// failed without being sent: a client's debits are applied in order, and
// what failed goes to the retry stream in that order. Messages of one
// source region and partition must be applied in sequence order. It
// returns one result per message; the error, if any, is the first
// client's failure; the others debited are debited.
func (s *Store) ApplyMessages(ctx context.Context, src string, markerTTL time.Duration, msgs []MessageDebits) ([]DebitResult, error) {
	res := make([]DebitResult, len(msgs))
	var entries []debitEntry
	for m, msg := range msgs {
		for i := range msg.Clients {
			entries = append(entries, debitEntry{msg: m, client: i})
		}
	}
	if len(entries) == 0 {
		return res, nil
	}
	admin, err := s.nodes.Admin()
	for _, msg := range msgs {
		if err == nil && msg.Pos.Epoch <= 0 {
			err = fmt.Errorf("debit at %v: epoch must be above 0", msg.Pos)
		}
	}
	if err != nil {
		for _, e := range entries {
			res[e.msg].Failed = append(res[e.msg].Failed, e.client)
		}
		return res, err
	}
	ttlArg := strconv.FormatInt(max(markerTTL.Milliseconds(), 1), 10)
	limits := limitArgs{}
	calls := make([]pipeline.Call, len(entries))
	for k, e := range entries {
		pos, c := msgs[e.msg].Pos, msgs[e.msg].Clients[e.client]
		keys, args := debitArgs(Key(pos.markerRule(src), c.Key), strconv.FormatUint(pos.Seq, 10), ttlArg, strconv.FormatInt(pos.Epoch, 10), c, limits)
		calls[k] = pipeline.Call{Script: debitScript, Keys: keys, Args: args}
	}
	start := time.Now()
	outs := make([]debitReply, len(entries))
	alone := s.debitBatches(ctx, admin, calls, outs)
	if len(alone) > 0 {
		s.debitAlone(ctx, admin, calls, alone, outs)
	}
	s.m.debitDuration.Observe(time.Since(start).Seconds())
	var first error
	failed := 0
	for k, r := range outs {
		e := entries[k]
		c := msgs[e.msg].Clients[e.client]
		out, err := r.out, r.err
		if err == nil && !validDebitReply(out, len(c.Debits)) {
			err = fmt.Errorf("debit reply %v", out)
		}
		rm := &res[e.msg]
		switch {
		case err != nil:
			rm.Failed = append(rm.Failed, e.client)
			failed++
			if first == nil {
				first = err
			}
		case out[0] == int64(2):
			rm.Refilled++
		case out[0] == int64(1):
			rm.Applied++
			for j := range c.Debits {
				s, _ := out[1+j].(string)
				c.Debits[j].Overshoot, _ = strconv.ParseFloat(s, 64)
			}
		default:
			rm.Duplicates++
		}
	}
	if failed > 0 {
		s.m.errors[opDebit].Add(float64(failed))
		return res, fmt.Errorf("debit %d of %d clients failed: %w", failed, len(entries), first)
	}
	return res, nil
}

// debitEntry is one client of one message: ApplyMessages' unit.
type debitEntry struct{ msg, client int }

// errEarlierFailed fails a client's debit of a message when its debit of
// an earlier message failed: it is not sent, so that it does not pass that
// one.
var errEarlierFailed = errors.New("an earlier message's debit of the client failed")

// debitAlone sends the calls of alone one client each, in rounds: a
// client's first call in the first round, its second in the next, and so
// on, the calls of a round pipelined. A client whose call fails has its
// later calls failed without being sent. A client's calls share their
// marker key (calls[i].Keys[0]).
func (s *Store) debitAlone(ctx context.Context, admin redis.UniversalClient, calls []pipeline.Call, alone []int, outs []debitReply) {
	slices.Sort(alone) // the messages' order, which the chunks may have changed
	byClient := map[string][]int{}
	var order []string
	for _, i := range alone {
		k := calls[i].Keys[0]
		if _, ok := byClient[k]; !ok {
			order = append(order, k)
		}
		byClient[k] = append(byClient[k], i)
	}
	for round := 0; ; round++ {
		var send []int
		for _, k := range order {
			q := byClient[k]
			if round >= len(q) {
				continue
			}
			if round > 0 && outs[q[round-1]].err != nil {
				outs[q[round]].err = errEarlierFailed
				continue
			}
			send = append(send, q[round])
		}
		if len(send) == 0 {
			return
		}
		if s.beforeDebitRound != nil {
			s.beforeDebitRound(round)
		}
		one := make([]pipeline.Call, len(send))
		for k, i := range send {
			one[k] = calls[i]
		}
		cmds, _ := pipeline.RunScripts(ctx, admin, one)
		for k, i := range send {
			outs[i].out, outs[i].err = cmds[k].Slice()
		}
	}
}

// debitReply is one client's reply to the debit script, or its error.
type debitReply struct {
	out []any
	err error
}

// validDebitReply reports whether out is a debit script's reply for a
// client of n buckets: {1, n overshoots}, {0} or {2}.
func validDebitReply(out []any, n int) bool {
	return len(out) > 0 && (out[0] == int64(0) || out[0] == int64(2) || out[0] == int64(1) && len(out) == 1+n)
}

// Bounds of one batched debit call. A script holds its node while it runs:
// no check is served meanwhile. 128 clients of one token bucket, or 16 KiB
// of keys and arguments of clients with more rules, take about a
// millisecond of the node (measured on the 2 shared cores of
// BenchmarkDebitCost's figures): about what Redis runs of one
// connection's pipeline of one-client calls between two reads of 16 KiB.
// More clients a call would save little: the call's own cost, paid once
// per chunk, is already a few percent of it.
const (
	batchClients = 128
	batchBytes   = 16 << 10
)

// debitBatches sends the clients' debit calls (calls, one per client, as
// debitArgs makes them) in batched calls of one node's clients each, one
// pipeline per node, and puts each client's reply in outs. It returns the
// clients it could not apply so: those of a failed call, those whose node
// is unknown and the chunks of one client, to be sent one call each.
func (s *Store) debitBatches(ctx context.Context, admin redis.UniversalClient, calls []pipeline.Call, outs []debitReply) (alone []int) {
	groups, alone := s.debitGroups(ctx, admin, calls)
	var chunks [][]int
	for _, g := range groups {
		// A client's calls (one per message) go in one chunk, in order:
		// runs of one marker, each in one chunk, or alone when it does
		// not fit one.
		runs := clientRuns(calls, g)
		var chunk []int
		size := 0
		flush := func() {
			if len(chunk) == 1 {
				alone = append(alone, chunk[0])
			} else if len(chunk) > 1 {
				chunks = append(chunks, chunk)
			}
			chunk, size = nil, 0
		}
		for _, run := range runs {
			n := 0
			for _, i := range run {
				n += callBytes(calls[i])
			}
			if len(run) > batchClients || len(run) > 1 && n > batchBytes {
				alone = append(alone, run...)
				continue
			}
			if len(chunk) > 0 && (len(chunk)+len(run) > batchClients || size+n > batchBytes) {
				flush()
			}
			chunk = append(chunk, run...)
			size += n
		}
		flush()
	}
	if len(chunks) == 0 {
		return alone
	}
	batch := make([]pipeline.Call, len(chunks))
	for k, chunk := range chunks {
		batch[k] = batchCall(calls, chunk)
	}
	if s.beforeDebitBatch != nil {
		s.beforeDebitBatch()
	}
	cmds, _ := pipeline.RunScripts(ctx, admin, batch)
	for k, chunk := range chunks {
		out, err := cmds[k].Slice()
		ok := err == nil && len(out) == len(chunk)
		for m, i := range chunk {
			if !ok {
				break
			}
			var o []any
			o, ok = out[m].([]any)
			ok = ok && validDebitReply(o, len(calls[i].Keys)-1)
			outs[i].out = o
		}
		if !ok {
			s.m.debitFallbacks.Inc()
			alone = append(alone, chunk...)
		}
	}
	return alone
}

// debitGroups groups the clients by the primary that serves their slot as
// the admin client's slot map has it (one group when it is not a cluster
// client), in the order of their first client. Clients whose primary is
// unknown are returned apart.
func (s *Store) debitGroups(ctx context.Context, admin redis.UniversalClient, calls []pipeline.Call) (groups [][]int, unknown []int) {
	cc, ok := admin.(*redis.ClusterClient)
	if !ok && s.debitNode == nil {
		all := make([]int, len(calls))
		for i := range all {
			all[i] = i
		}
		return [][]int{all}, nil
	}
	index := map[string]int{}
	// A client's calls (one per message) go to one node, whatever the
	// slot map says meanwhile.
	nodeOf := map[string]string{}
	for i, c := range calls {
		addr, seen := nodeOf[c.Keys[0]]
		switch {
		case seen:
		case s.debitNode != nil:
			addr = s.debitNode(c.Keys[0])
		default:
			if n, err := cc.MasterForKey(ctx, c.Keys[0]); err == nil {
				addr = n.Options().Addr
			}
		}
		nodeOf[c.Keys[0]] = addr
		if addr == "" {
			unknown = append(unknown, i)
			continue
		}
		g, ok := index[addr]
		if !ok {
			g = len(groups)
			index[addr] = g
			groups = append(groups, nil)
		}
		groups[g] = append(groups[g], i)
	}
	return groups, unknown
}

// clientRuns are the calls of group g by client (their marker,
// calls[i].Keys[0]), each client's in g's order, the clients in the order
// of their first call.
func clientRuns(calls []pipeline.Call, g []int) [][]int {
	index := make(map[string]int, len(g))
	var runs [][]int
	for _, i := range g {
		k := calls[i].Keys[0]
		r, ok := index[k]
		if !ok {
			r = len(runs)
			index[k] = r
			runs = append(runs, nil)
		}
		runs[r] = append(runs[r], i)
	}
	return runs
}

// callBytes is about what a client's call sends: its keys' and arguments'
// bytes.
func callBytes(c pipeline.Call) int {
	n := 0
	for _, k := range c.Keys {
		n += len(k)
	}
	for _, a := range c.Args {
		if s, ok := a.(string); ok {
			n += len(s)
		}
	}
	return n
}

// batchCall is the batched debit script's call for the clients chunk of
// calls (see debit_batch_main.lua): the first client's marker routes it;
// the markers' expiry and the count of clients are followed, per client,
// by its marker, its message's sequence and epoch, its bucket count, its
// bucket keys and their arguments.
func batchCall(calls []pipeline.Call, chunk []int) pipeline.Call {
	first := calls[chunk[0]]
	size := 2
	for _, i := range chunk {
		size += 3 + len(calls[i].Keys) + len(calls[i].Args) - 3
	}
	args := make([]any, 0, size)
	args = append(args, first.Args[1], strconv.Itoa(len(chunk)))
	for _, i := range chunk {
		c := calls[i]
		args = append(args, c.Keys[0], c.Args[0], c.Args[2], strconv.Itoa(len(c.Keys)-1))
		for _, k := range c.Keys[1:] {
			args = append(args, k)
		}
		args = append(args, c.Args[3:]...)
	}
	return pipeline.Call{Script: debitBatchScript, Keys: first.Keys[:1], Args: args}
}

// debitArgs are the debit script's KEYS and ARGV for one client; limits
// keeps each rule's limit as scriptArgs formats it, for the next clients
// of one message.
func debitArgs(marker, seq, ttl, epoch string, c ClientDebits, limits limitArgs) ([]string, []any) {
	keys := make([]string, 1, 1+len(c.Debits))
	keys[0] = marker
	args := make([]any, 3, 3+6*len(c.Debits))
	args[0], args[1], args[2] = seq, ttl, epoch
	for _, d := range c.Debits {
		keys = append(keys, Key(d.Rule, c.Key))
		l, ok := limits[d.Limit]
		if !ok {
			a := scriptArgs(d.Limit, 0)
			l = [2]string{a[0], a[1]}
			limits[d.Limit] = l
		}
		alg := string(d.Limit.Algorithm)
		if d.Reset {
			alg = resetPrefix + alg
		}
		args = append(args, alg, l[0], l[1], strconv.FormatFloat(d.Amount, 'g', -1, 64), strconv.FormatInt(max(d.At, 0), 10), strconv.FormatInt(max(d.Seen, 0), 10))
	}
	return keys, args
}

// resetPrefix before a debit's algorithm tells the debit script to put
// the bucket back to full before it debits the amount (debit_client.lua).
const resetPrefix = "!"

// limitArgs are limits as scriptArgs formats them (capacity, then rate or
// window), by limit.
type limitArgs map[bucket.Limit][2]string

// Slot is the Redis Cluster hash slot of key (CRC16 of its hash tag, mod
// 16384), as the servers compute it.
func Slot(key string) int {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	return int(crc16(key) % 16384)
}

// crc16 is CRC-16/XMODEM, Redis Cluster's key hash.
func crc16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc ^= uint16(s[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

// Reset puts the buckets of reqs back to full: it deletes each bucket's
// key, one command per bucket, pipelined per node. A bucket's state is
// that one key for every algorithm, so nothing of it is left. It takes its
// deadline from ctx.
func (s *Store) Reset(ctx context.Context, reqs []bucket.Request) error {
	if len(reqs) == 0 {
		return nil
	}
	admin, err := s.nodes.Admin()
	if err == nil {
		_, err = admin.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, r := range reqs {
				p.Del(ctx, Key(r.Rule, r.Key))
			}
			return nil
		})
	}
	if err != nil {
		s.m.errors[opReset].Inc()
		return fmt.Errorf("reset: %w", err)
	}
	return nil
}

// Refund gives amount leased tokens back to the bucket of key under rule,
// for a token bucket or GCRA; other algorithms keep what they spent. It
// takes its deadline from ctx.
func (s *Store) Refund(ctx context.Context, rule, key string, lim bucket.Limit, amount float64) error {
	if lim.Algorithm != bucket.TokenBucket && lim.Algorithm != bucket.GCRA {
		return nil
	}
	if err := s.once(ctx, opRefund, pipeline.Call{Script: refundScript, Keys: []string{Key(rule, key)}, Args: refundArgs(lim, amount)}); err != nil {
		return fmt.Errorf("refund: %w", err)
	}
	return nil
}

// refundArgs are the refund script's ARGV: algorithm, capacity, rate
// (tokens/s) and amount.
func refundArgs(lim bucket.Limit, amount float64) []any {
	a := scriptArgs(lim, amount)
	return []any{string(lim.Algorithm), a[0], a[1], a[2]}
}
