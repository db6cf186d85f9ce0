package redisstore

import (
	"context"
	"errors"
	"fmt"
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
	admin, err := s.nodes.Admin()
	if err != nil {
		return "", err
	}
	keys := recordKeys(ctx, admin, src, instance, seq, part)
	calls := make([]pipeline.Call, len(keys))
	for i, k := range keys {
		calls[i] = pipeline.Call{Script: seenScript, Keys: []string{k}, Args: []any{pos.String(), strconv.FormatInt(max(ttl.Milliseconds(), 1), 10)}}
	}
	cmds, _ := pipeline.RunScripts(ctx, admin, calls)
	first := ""
	var errs []error
	for _, cmd := range cmds {
		v, err := cmd.Text()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if first == "" || v != pos.String() {
			first = v
		}
	}
	if first == "" {
		s.m.errors[opDebit].Inc()
		return "", fmt.Errorf("record message: %w: %w", ErrNotRecorded, errors.Join(errs...))
	}
	return first, nil
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
// The clients are grouped by the node that serves them, and each group's
// clients go in chunks (batchClients, batchBytes) of one script call each;
// the calls are pipelined, one pipeline per node, so a node that is down
// fails only its own clients. A chunk whose call fails (its node down, a
// slot moved since the grouping: any error) is applied again client by
// client, one script each: the markers make the clients the failed call
// applied before its error duplicates. Messages of one source region must
// be applied to each client in sequence order. The error, if any, is the
// first client's failure; the others debited are debited.
func (s *Store) ApplyDebits(ctx context.Context, src string, pos Position, markerTTL time.Duration, clients []ClientDebits) (DebitResult, error) {
	var res DebitResult
	if len(clients) == 0 {
		return res, nil
	}
	admin, err := s.nodes.Admin()
	if err == nil && pos.Epoch <= 0 {
		err = fmt.Errorf("debit at %v: epoch must be above 0", pos)
	}
	if err != nil {
		for i := range clients {
			res.Failed = append(res.Failed, i)
		}
		return res, err
	}
	seqArg := strconv.FormatUint(pos.Seq, 10)
	epochArg := strconv.FormatInt(pos.Epoch, 10)
	ttlArg := strconv.FormatInt(max(markerTTL.Milliseconds(), 1), 10)
	markerRule := pos.markerRule(src)
	limits := limitArgs{}
	calls := make([]pipeline.Call, len(clients))
	for i, c := range clients {
		keys, args := debitArgs(Key(markerRule, c.Key), seqArg, ttlArg, epochArg, c, limits)
		calls[i] = pipeline.Call{Script: debitScript, Keys: keys, Args: args}
	}
	start := time.Now()
	outs := make([]debitReply, len(clients))
	alone := s.debitBatches(ctx, admin, calls, outs)
	if len(alone) > 0 {
		one := make([]pipeline.Call, len(alone))
		for k, i := range alone {
			one[k] = calls[i]
		}
		cmds, _ := pipeline.RunScripts(ctx, admin, one)
		for k, i := range alone {
			outs[i].out, outs[i].err = cmds[k].Slice()
		}
	}
	s.m.debitDuration.Observe(time.Since(start).Seconds())
	var first error
	for i, r := range outs {
		out, e := r.out, r.err
		if e == nil && !validDebitReply(out, len(clients[i].Debits)) {
			e = fmt.Errorf("debit reply %v", out)
		}
		switch {
		case e != nil:
			res.Failed = append(res.Failed, i)
			if first == nil {
				first = e
			}
		case out[0] == int64(2):
			res.Refilled++
		case out[0] == int64(1):
			res.Applied++
			for j := range clients[i].Debits {
				s, _ := out[1+j].(string)
				clients[i].Debits[j].Overshoot, _ = strconv.ParseFloat(s, 64)
			}
		default:
			res.Duplicates++
		}
	}
	if len(res.Failed) > 0 {
		s.m.errors[opDebit].Add(float64(len(res.Failed)))
		return res, fmt.Errorf("debit %d of %d clients failed: %w", len(res.Failed), len(clients), first)
	}
	return res, nil
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
		for len(g) > 0 {
			n, size := 0, 0
			for n < len(g) && n < batchClients {
				size += callBytes(calls[g[n]])
				if n > 0 && size > batchBytes {
					break
				}
				n++
			}
			if n == 1 {
				alone = append(alone, g[0])
			} else {
				chunks = append(chunks, g[:n])
			}
			g = g[n:]
		}
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
	for i, c := range calls {
		var addr string
		if s.debitNode != nil {
			addr = s.debitNode(c.Keys[0])
		} else if n, err := cc.MasterForKey(ctx, c.Keys[0]); err == nil {
			addr = n.Options().Addr
		}
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
// each client's marker, bucket count, bucket keys and arguments follow
// the message's sequence, expiry and epoch.
func batchCall(calls []pipeline.Call, chunk []int) pipeline.Call {
	first := calls[chunk[0]]
	size := 4
	for _, i := range chunk {
		size += 1 + len(calls[i].Keys) + len(calls[i].Args) - 3
	}
	args := make([]any, 0, size)
	args = append(args, first.Args[0], first.Args[1], first.Args[2], strconv.Itoa(len(chunk)))
	for _, i := range chunk {
		c := calls[i]
		args = append(args, c.Keys[0], strconv.Itoa(len(c.Keys)-1))
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
	args := make([]any, 3, 3+5*len(c.Debits))
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
		args = append(args, alg, l[0], l[1], strconv.FormatFloat(d.Amount, 'g', -1, 64), strconv.FormatInt(max(d.At, 0), 10))
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
