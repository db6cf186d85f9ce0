package redisstore

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// Debit is one bucket's share of a client's spends in another region.
type Debit struct {
	Rule   string
	Limit  bucket.Limit
	Amount float64
	// Overshoot is set by ApplyDebits: by how much the admissions this
	// region knows of exceed the limit right after the debit.
	Overshoot float64
}

// ClientDebits are the debits of one client from one message.
type ClientDebits struct {
	Key    string
	Debits []Debit
}

// MarkerKey is the key that records the last message of region src applied
// to the buckets of key. It shares their hash tag, so one script checks it
// and debits them; no rule id starts with '~'.
func MarkerKey(key, src string) string {
	return Key("~from:"+src, key)
}

// MessageKey is the key that records the first stream sequence of the
// spend message part of flush seq of instance in region src. Its hash tag
// is the instance's, so one instance's records share a slot; no rule id
// starts with '~' and no region name holds '/'.
func MessageKey(src, instance string, seq uint64, part uint32) string {
	return Key("~msg:"+strconv.FormatUint(seq, 10)+":"+strconv.FormatUint(uint64(part), 10), src+"/"+instance)
}

// FirstSeen records that the spend message part of flush seq of instance
// in region src is delivered at stream sequence streamSeq, unless a record
// of it exists, and returns the stream sequence of its first delivery: a
// result other than streamSeq is a replay (the same flush published again
// as a new stream message), which must not be applied. The record lives
// ttl, which must outlast the stream's keeping of a message. One small key
// per message (about 180 bytes of Redis memory with its expiry, measured
// on Redis 7.0).
func (s *Store) FirstSeen(ctx context.Context, src, instance string, seq uint64, part uint32, streamSeq uint64, ttl time.Duration) (uint64, error) {
	admin, err := s.admin()
	if err != nil {
		return 0, err
	}
	v, err := seenScript.Run(ctx, admin, []string{MessageKey(src, instance, seq, part)},
		strconv.FormatUint(streamSeq, 10), strconv.FormatInt(max(ttl.Milliseconds(), 1), 10)).Text()
	if err != nil {
		s.m.errors[opDebit].Inc()
		return 0, fmt.Errorf("record message: %w", err)
	}
	first, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("record message: %q is not a sequence", v)
	}
	return first, nil
}

// ApplyDebits applies message seq of region src: per client, one script
// that debits every bucket unless the client's marker shows seq applied
// already. The scripts are pipelined, one pipeline per node. Messages of one
// source region must be applied in sequence order. It returns how many
// clients were debited and how many were duplicates; on error some may have
// been applied, and applying the message again is safe.
func (s *Store) ApplyDebits(ctx context.Context, src string, seq uint64, markerTTL time.Duration, clients []ClientDebits) (applied, duplicates int, err error) {
	if len(clients) == 0 {
		return 0, 0, nil
	}
	admin, err := s.admin()
	if err != nil {
		return 0, 0, err
	}
	seqArg := strconv.FormatUint(seq, 10)
	ttlArg := strconv.FormatInt(max(markerTTL.Milliseconds(), 1), 10)
	calls := make([]scriptCall, len(clients))
	for i, c := range clients {
		keys, args := debitArgs(src, seqArg, ttlArg, c)
		calls[i] = scriptCall{script: debitScript, keys: keys, args: args}
	}
	start := time.Now()
	cmds, _ := runScripts(ctx, admin, calls, nil)
	s.m.debitDuration.Observe(time.Since(start).Seconds())
	var errs []error
	for i, cmd := range cmds {
		res, e := cmd.Slice()
		if e == nil && (len(res) == 0 || (res[0] == int64(1) && len(res) != 1+len(clients[i].Debits))) {
			e = fmt.Errorf("debit reply %v", res)
		}
		switch {
		case e != nil:
			errs = append(errs, e)
		case res[0] == int64(1):
			applied++
			for j := range clients[i].Debits {
				s, _ := res[1+j].(string)
				clients[i].Debits[j].Overshoot, _ = strconv.ParseFloat(s, 64)
			}
		default:
			duplicates++
		}
	}
	if len(errs) > 0 {
		s.m.errors[opDebit].Add(float64(len(errs)))
		return applied, duplicates, fmt.Errorf("debit %d of %d clients failed: %w", len(errs), len(clients), errs[0])
	}
	return applied, duplicates, nil
}

// debitArgs are the debit script's KEYS and ARGV for one client.
func debitArgs(src, seq, ttl string, c ClientDebits) ([]string, []any) {
	keys := make([]string, 1, 1+len(c.Debits))
	keys[0] = MarkerKey(c.Key, src)
	args := make([]any, 2, 2+4*len(c.Debits))
	args[0], args[1] = seq, ttl
	for _, d := range c.Debits {
		keys = append(keys, Key(d.Rule, c.Key))
		a := scriptArgs(d.Limit, d.Amount)
		args = append(args, string(d.Limit.Algorithm), a[0], a[1], a[2])
	}
	return keys, args
}

// Refund gives amount leased tokens back to the bucket of key under rule,
// for a token bucket or GCRA; other algorithms keep what they spent. It
// takes its deadline from ctx.
func (s *Store) Refund(ctx context.Context, rule, key string, lim bucket.Limit, amount float64) error {
	if lim.Algorithm != bucket.TokenBucket && lim.Algorithm != bucket.GCRA {
		return nil
	}
	admin, err := s.admin()
	if err != nil {
		return err
	}
	_, err = runScripts(ctx, admin, []scriptCall{{script: refundScript, keys: []string{Key(rule, key)}, args: refundArgs(lim, amount)}}, nil)
	if err != nil {
		s.m.errors[opRefund].Inc()
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
