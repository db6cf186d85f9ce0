package reconciler

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limiterd/limiterd/internal/reconciler/lease"
	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/tracing"
	"github.com/limiterd/limiterd/pkg/gossip"
	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// A region's relay forwards its limiterd flushes from its local stream to
// its spends stream, which the other regions source. One reconciler of the
// region relays at a time, under the lease of the item of the region
// itself (never a source). It reads the flushes in order and merges the
// flushes it reads in one go into one message per partition
// (gossip.Merger): the messages between regions number about one per
// partition per round, however many limiterd publish and however often.
//
// Each relayed message is published only if its partition's subject ends
// where the relay last saw it (JetStream's expected last subject
// sequence), and carries, in the relayedHeader, the local stream's epoch
// and the last flush merged into it. A new holder reads each partition's
// last message, drops the consumer of the holder before (whose delivered
// flushes come again, in order, to a new one), and merges a flush into a
// partition only when it is past that partition's last: a flush is
// relayed to each partition once, however the holders before grouped it.
// A holder that lost its lease and still publishes is refused by the
// expected sequence, as is a new holder that read a partition before the
// last publish of the old one landed: it reads the partitions again.
//
// A flush that limiterd published again past the local stream's duplicate
// window (from its spool, after a crash) has a record in this region's
// Redis, made the first time it was relayed, and is dropped.

const (
	// relayHeader names the local stream's epoch and the sequence of the
	// last flush a relayed message holds: "<epoch> <seq>".
	relayedHeader = "Limiter-Relayed"
	// relayConsumerPrefix names the consumers of the local stream, one per
	// holding; a holder deletes the others.
	relayConsumerPrefix = "relay-"
	// relayGather is the longest a relay round waits for more flushes
	// once it has one; relayLinger is how long it waits for the next.
	relayGather = 10 * time.Millisecond
	relayLinger = 2 * time.Millisecond
	// relayMaxFlushes bounds the flushes of one round.
	relayMaxFlushes = 256
)

// relayItem is the lease of this region's relay.
func (r *Reconciler) relayItem() lease.Item { return lease.Item{Source: r.opts.Region, Partition: 0} }

// holdLease runs what the lease h is for while it is held: the relay or
// one partition's apply.
func (r *Reconciler) holdLease(ctx context.Context, h *lease.Held) {
	if h.Item == r.relayItem() {
		r.relayHeld(ctx, h)
		return
	}
	r.applyPartition(ctx, h)
}

// relayHeld relays while the lease is held: each error reads the
// partitions and the local stream again.
func (r *Reconciler) relayHeld(ctx context.Context, h *lease.Held) {
	for ctx.Err() == nil {
		if err := r.relayFrom(ctx, h); err != nil && ctx.Err() == nil {
			r.log.Warn("relay starts again from its first flush not acknowledged", "err", err)
			r.pause(ctx, "relay", err)
		}
	}
}

// relayTail is where a partition's subject of the spends stream ends.
type relayTail struct {
	// seq is the stream sequence of its last message (0: none); through
	// is the local sequence of the last flush relayed to it, of the local
	// stream the relay reads (0: none).
	seq, through uint64
}

// relayConsumers counts the consumers this process made, to name each.
var relayConsumers atomic.Uint64

// relayFrom reads the partitions' ends, makes a consumer of the local
// stream, and relays round after round until ctx ends (nil) or something
// calls for starting again (its error).
func (r *Reconciler) relayFrom(ctx context.Context, h *lease.Held) error {
	self := r.opts.Region
	local, err := r.js.Stream(ctx, gossip.LocalStream(self))
	if err != nil {
		return fmt.Errorf("stream %s: %w", gossip.LocalStream(self), err)
	}
	epoch := max(local.CachedInfo().Created.UnixMicro(), 1)
	spends, err := r.js.Stream(ctx, gossip.RegionStream(self))
	if err != nil {
		return fmt.Errorf("stream %s: %w", gossip.RegionStream(self), err)
	}
	// The consumers of the holders before go first: their flushes
	// delivered but not acknowledged come again, in order, to the new
	// one (a work queue stream keeps a flush until it is acknowledged).
	name := relayConsumerPrefix + r.leases.Token() + "-" + strconv.FormatUint(relayConsumers.Add(1), 10)
	names := local.ConsumerNames(ctx)
	for n := range names.Name() {
		if n == "relay" || strings.HasPrefix(n, relayConsumerPrefix) {
			if err := local.DeleteConsumer(ctx, n); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
				return fmt.Errorf("consumer %s of %s: %w", n, local.CachedInfo().Config.Name, err)
			}
		}
	}
	if err := names.Err(); err != nil {
		return fmt.Errorf("consumers of %s: %w", local.CachedInfo().Config.Name, err)
	}
	tails := make([]relayTail, r.opts.Partitions)
	for p := range tails {
		m, err := spends.GetLastMsgForSubject(ctx, gossip.PartitionSubject(self, p))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return fmt.Errorf("last message of %s: %w", gossip.PartitionSubject(self, p), err)
		}
		tails[p] = relayTail{seq: m.Sequence, through: relayedThrough(m.Header, epoch)}
	}
	cons, err := local.CreateConsumer(ctx, jetstream.ConsumerConfig{
		Name:              name,
		AckPolicy:         jetstream.AckExplicitPolicy,
		AckWait:           r.opts.AckWait,
		MaxAckPending:     4 * relayMaxFlushes,
		MaxDeliver:        -1,
		InactiveThreshold: readerIdle,
	})
	if err != nil {
		return fmt.Errorf("consumer %s of %s: %w", name, local.CachedInfo().Config.Name, err)
	}
	msgs, err := cons.Messages(jetstream.PullMaxMessages(2*relayMaxFlushes),
		jetstream.PullExpiry(readerExpiry), jetstream.PullHeartbeat(readerHeartbeat), jetstream.WithMessagesErrOnMissingHeartbeat(true))
	if err != nil {
		return err
	}
	defer msgs.Stop()
	defer context.AfterFunc(ctx, msgs.Stop)()
	merger, err := gossip.NewMerger(self, r.opts.Partitions)
	if err != nil {
		return err
	}
	rd := &relayRound{r: r, h: h, epoch: epoch, tails: tails, merger: merger}
	var cseq uint64
	for ctx.Err() == nil {
		round, err := gatherFlushes(msgs)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		// In order, each once: a flush delivered again (an ack wait
		// passed) would be merged after later ones.
		for _, m := range round {
			meta, err := m.Metadata()
			if err != nil || meta.Sequence.Consumer != cseq+1 || meta.NumDelivered != 1 {
				return errors.New("a gap in the relay consumer's delivery")
			}
			cseq++
		}
		if err := rd.relay(ctx, round); err != nil {
			return err
		}
	}
	return nil
}

// gatherFlushes waits for a flush, then takes those that follow within
// relayLinger of each other, for relayGather at most, up to
// relayMaxFlushes.
func gatherFlushes(msgs jetstream.MessagesContext) ([]jetstream.Msg, error) {
	m, err := msgs.Next()
	if err != nil {
		return nil, err
	}
	round := []jetstream.Msg{m}
	end := time.Now().Add(relayGather)
	for len(round) < relayMaxFlushes {
		wait := min(relayLinger, time.Until(end))
		if wait <= 0 {
			break
		}
		m, err := msgs.Next(jetstream.NextMaxWait(wait))
		if err != nil {
			break
		}
		round = append(round, m)
	}
	return round, nil
}

// relayedThrough reads the local sequence a relayed message's header
// names, 0 when it names another local stream (made again since) or none.
func relayedThrough(h nats.Header, epoch int64) uint64 {
	e, s, ok := strings.Cut(h.Get(relayedHeader), " ")
	if !ok || e != strconv.FormatInt(epoch, 10) {
		return 0
	}
	seq, _ := strconv.ParseUint(s, 10, 64)
	return seq
}

// relayRound relays rounds of flushes of one holding.
type relayRound struct {
	r      *Reconciler
	h      *lease.Held
	epoch  int64
	tails  []relayTail
	merger *gossip.Merger
}

// relayFlush is one flush of a round as the relay reads it.
type relayFlush struct {
	msg jetstream.Msg
	seq uint64
	b   *gossipv1.SpendBatch
}

// relay relays the flushes of round, in order: merged into one message per
// partition, as many messages as the merge bounds call for, then
// acknowledged.
func (rd *relayRound) relay(ctx context.Context, round []jetstream.Msg) error {
	r := rd.r
	var flushes []relayFlush
	var recs []redisstore.Record
	for _, m := range round {
		meta, _ := m.Metadata()
		b, err := gossip.DecodeHeader(m.Data(), r.opts.MaxMessageBytes)
		if err == nil && b.GetRegion() != r.opts.Region {
			err = fmt.Errorf("%w: region: %q on %s's local stream", gossip.ErrInvalidBatch, b.GetRegion(), r.opts.Region)
		}
		if err != nil {
			r.applier.Reject(m, "relay", err)
			continue
		}
		flushes = append(flushes, relayFlush{msg: m, seq: meta.Sequence.Stream, b: b})
		recs = append(recs, redisstore.Record{Instance: b.GetInstance(), Seq: b.GetSequence(), Part: b.GetPart(),
			Pos: redisstore.Position{Epoch: rd.epoch, Seq: meta.Sequence.Stream}})
	}
	if len(flushes) == 0 {
		return nil
	}
	until, err := rd.h.WaitValid(ctx, r.leases.Tick())
	if err != nil {
		return nil // stopped
	}
	wctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), until)
	defer cancel()
	// A flush published again under a new local sequence is dropped: its
	// first delivery was relayed.
	firsts, errs := r.store.FirstSeenMany(wctx, "relay."+r.opts.Region, recs, r.applier.MarkerTTL())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("flush records: %w", err)
	}
	var header nats.Header
	var last uint64
	from := 0
	for i, f := range flushes {
		if firsts[i] != recs[i].Pos.String() {
			r.m.relayReplays.Inc()
			r.log.Warn("flush published again by limiterd: relayed already, dropped", "seq", f.seq, "first", firsts[i],
				"instance", recs[i].Instance, "flush", recs[i].Seq, "part", recs[i].Part)
			continue
		}
		b := f.b
		skip := func(p int) bool { return f.seq <= rd.tails[p].through }
		if !rd.merger.Add(b, skip) {
			if err := rd.publish(wctx, last, header); err != nil {
				return err
			}
			if err := rd.ack(flushes[from:i]); err != nil {
				return err
			}
			from, header = i, nil
			rd.merger.Add(b, skip)
		}
		if tracing.SpanContextFromHeader(f.msg.Headers()).IsValid() {
			header = f.msg.Headers()
		}
		last = f.seq
	}
	if rd.merger.Len() > 0 {
		if err := rd.publish(wctx, last, header); err != nil {
			return err
		}
	}
	return rd.ack(flushes[from:])
}

// publish publishes the merger's messages, the last flush in them at
// local sequence last, and empties it: each only if its partition ends
// where it was seen, and all at once, waiting for every ack.
func (rd *relayRound) publish(ctx context.Context, last uint64, header nats.Header) error {
	r := rd.r
	defer rd.merger.Reset()
	parts, err := rd.merger.Messages(gossip.RelayName(r.opts.Region, rd.epoch), last)
	if err != nil {
		return err
	}
	if r.beforeRelayPublish != nil && !r.beforeRelayPublish(last) {
		return errors.New("stopped before publishing (test)")
	}
	type pending struct {
		p int
		f jetstream.PubAckFuture
	}
	var acks []pending
	relayed := strconv.FormatInt(rd.epoch, 10) + " " + strconv.FormatUint(last, 10)
	for p, part := range parts {
		if part.Data == nil {
			continue
		}
		m := &nats.Msg{Subject: gossip.PartitionSubject(r.opts.Region, p), Data: part.Data, Header: tracing.TraceHeader(header)}
		if m.Header == nil {
			m.Header = nats.Header{}
		}
		m.Header.Set(relayedHeader, relayed)
		f, err := r.js.PublishMsgAsync(m, jetstream.WithMsgID(gossip.RelayName(r.opts.Region, rd.epoch)+"-"+strconv.FormatUint(last, 10)+"-p"+strconv.Itoa(p)),
			jetstream.WithExpectLastSequencePerSubject(rd.tails[p].seq))
		if err != nil {
			return err
		}
		acks = append(acks, pending{p, f})
	}
	var failed error
	for _, a := range acks {
		select {
		case ack := <-a.f.Ok():
			rd.tails[a.p] = relayTail{seq: ack.Sequence, through: last}
			r.m.relayMsgs.Inc()
			r.m.relayed.Add(float64(parts[a.p].Entries))
			r.m.relayClients.Add(float64(parts[a.p].Clients))
		case err := <-a.f.Err():
			failed = errors.Join(failed, fmt.Errorf("relay publish to partition %d: %w", a.p, err))
		case <-ctx.Done():
			return fmt.Errorf("relay publish: %w", ctx.Err())
		}
	}
	return failed
}

// ack acknowledges flushes, relayed: a work queue stream drops each.
func (rd *relayRound) ack(flushes []relayFlush) error {
	if rd.r.beforeRelayAck != nil && !rd.r.beforeRelayAck() {
		return errors.New("stopped before acknowledging (test)")
	}
	for _, f := range flushes {
		if err := f.msg.Ack(); err != nil {
			return fmt.Errorf("relay ack: %w", err)
		}
	}
	return nil
}
