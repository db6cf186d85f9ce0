package reconciler

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limiterd/limiterd/internal/reconciler/apply"
	"github.com/limiterd/limiterd/internal/reconciler/lease"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// Each partition of each source is applied by the reconciler of the
// region that holds its lease (package lease), in batches, from the
// position stored in Redis: an ephemeral consumer, made at that position,
// delivers the partition's messages in stream order, without acks; each
// batch is applied in one round trip per Redis node (apply.ApplyBatch),
// then the position moves to its last message done. Whatever stops a
// batch short (a record or the retry stream not answering, a gap in the
// consumer's sequence, a consumer gone) drops the consumer: the loop reads
// again from the stored position, so no message is applied after a later
// one of its partition. Messages applied whose position was not stored (a
// reconciler that died in between) are read again by the next holder, and
// are known by the clients' markers and the flush records.

const (
	// applyBatch is the most messages applied in one batch, and
	// applyBatchBytes the most bytes (a first message larger goes alone):
	// 64 messages of a few clients, or about 3,000 clients of large
	// messages, some ms of Redis work, well within a lease's validity
	// left when a batch starts (a quarter of the TTL at least), which is
	// the deadline of its writes. At 256 KiB (24,000 clients) a batch
	// outlasted it on a busy machine: every debit of the batch went to the
	// retry stream, applied one entry at a time.
	applyBatch      = 64
	applyBatchBytes = 32 << 10
	// applyLinger is how long a batch waits for one more message already
	// on its way once it has one.
	applyLinger = time.Millisecond
	// readerExpiry and readerHeartbeat are a partition reader's pull
	// requests' life and the server's heartbeat within them: a reader
	// whose consumer is gone (a server restarted) hears no heartbeat and
	// is made again within two.
	readerExpiry    = 5 * time.Second
	readerHeartbeat = time.Second
	// readerIdle is how long the server keeps a reader's consumer once
	// nothing pulls from it (its reconciler gone).
	readerIdle = 30 * time.Second
)

// readerPrefix is how the ephemeral consumers that read partition p of
// src's spends into self's inbound stream are named: the reader's token and
// a count follow.
func readerPrefix(self, src string, p int) string {
	return "apply-" + self + "-from-" + src + "-p" + strconv.Itoa(p) + "-"
}

// partitionConsumer is the durable apply consumer of partition p of src's
// spends of earlier releases: a partition with no position stored starts
// after its acknowledgement floor, when it is still there.
func partitionConsumer(self, src string, p int) string {
	return "apply-" + self + "-from-" + src + "-p" + strconv.Itoa(p)
}

// readers counts the readers this process made, to name each.
var readers atomic.Uint64

// applyPartition applies partition h.Item of its source while this
// reconciler holds the lease and the source's loops run: it waits for the
// loops (the streams set up), and returns when the lease is lost or
// released, or the loops stop (the lease manager runs it again then).
func (r *Reconciler) applyPartition(ctx context.Context, h *lease.Held) {
	it := h.Item
	if it.Partition >= r.opts.Partitions {
		return
	}
	var l *sourceLoops
	for {
		r.srcMu.Lock()
		if l = r.loops[it.Source]; l != nil {
			// Under srcMu: a stop takes the loops out of r.loops under it
			// before it waits for them.
			l.wg.Add(1)
		}
		r.srcMu.Unlock()
		if l != nil {
			break
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
	defer l.wg.Done()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(l.ctx, cancel)()
	as := l.src.partition(it.Partition)
	for ctx.Err() == nil {
		if err := r.readPartition(ctx, l, as, h); err != nil {
			r.log.Warn("partition read again from its stored position", "source", it.Source, "partition", it.Partition, "err", err)
			r.pause(ctx, "partition", err)
		}
	}
}

// errStopped ends readPartition when a batch could not be finished: read
// again from the stored position.
var errStopped = errors.New("a batch stopped short")

// readPartition reads as's partition from the position stored for it,
// applying batch after batch, until ctx ends (nil) or something calls for
// reading again from the stored position (its error).
func (r *Reconciler) readPartition(ctx context.Context, l *sourceLoops, as apply.Source, h *lease.Held) error {
	it := h.Item
	pos, err := r.leases.Position(ctx, it, as.Epoch)
	if err != nil {
		return err
	}
	if pos == 0 {
		pos = r.legacyFloor(ctx, it)
	}
	cons, err := r.newReader(ctx, it, pos)
	if err != nil {
		return err
	}
	// The epoch is read after the reader is made: a stream made again
	// since the set-up would have its own sequences, which the markers
	// would take for the old stream's.
	if info, err := r.js.Stream(ctx, gossip.InStream(r.opts.Region)); err != nil {
		return fmt.Errorf("stream %s: %w", gossip.InStream(r.opts.Region), err)
	} else if epoch := max(info.CachedInfo().Created.UnixMicro(), 1); epoch != as.Epoch {
		l.lost()
		return fmt.Errorf("stream %s made again: epoch %d, applying %d", gossip.InStream(r.opts.Region), epoch, as.Epoch)
	}
	msgs, err := cons.Messages(jetstream.PullMaxMessagesWithBytesLimit(2*applyBatch, max(2*r.opts.MaxMessageBytes, applyBatchBytes)),
		jetstream.PullExpiry(readerExpiry), jetstream.PullHeartbeat(readerHeartbeat), jetstream.WithMessagesErrOnMissingHeartbeat(true))
	if err != nil {
		return err
	}
	defer msgs.Stop()
	defer context.AfterFunc(ctx, msgs.Stop)()
	var cseq uint64 // the consumer's sequence of the last message read
	last := pos     // the stream sequence of the last message applied
	batch := make([]apply.Message, 0, applyBatch)
	for ctx.Err() == nil {
		batch = batch[:0]
		if err := nextBatch(msgs, &batch); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		// In order, without a gap: each message follows the last one
		// read, on the consumer's count and in the stream.
		n, gap := 0, false
		for _, m := range batch {
			meta, err := m.Metadata()
			if err != nil || meta.Sequence.Consumer != cseq+1 || meta.Sequence.Stream <= last {
				gap = true
				break
			}
			cseq++
			n++
		}
		batch = batch[:n]
		if n > 0 {
			done, err := r.applyBatch(ctx, as, h, batch)
			if ctx.Err() != nil {
				return nil
			}
			if err != nil {
				return err
			}
			if done > 0 {
				meta, _ := batch[done-1].Metadata()
				last = meta.Sequence.Stream
			}
			if done < n {
				return errStopped
			}
		}
		if gap {
			return errors.New("a gap in the reader's delivery")
		}
	}
	return nil
}

// applyBatch applies batch once the lease is valid for a tick more, with
// the lease's end as the deadline of every write, then stores the
// position of the last message done. It returns how many were done.
func (r *Reconciler) applyBatch(ctx context.Context, as apply.Source, h *lease.Held, batch []apply.Message) (int, error) {
	until, err := h.WaitValid(ctx, r.leases.Tick())
	if err != nil {
		return 0, nil // stopped
	}
	if r.beforeApply != nil {
		r.beforeApply(ctx, as)
	}
	if r.afterApply != nil {
		defer r.afterApply(as)
	}
	if ctx.Err() != nil {
		// Stopped (a switch removed the source, the lease was lost or
		// released, or the reconciler stops): not begun, so read again
		// by the next holder.
		return 0, nil
	}
	// A batch begun is finished, within the lease.
	wctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), until)
	defer cancel()
	done := r.applier.ApplyBatch(wctx, as, batch)
	r.m.batches.Observe(float64(done))
	if done == 0 {
		return 0, nil
	}
	meta, err := batch[done-1].Metadata()
	if err != nil {
		return done, err
	}
	if _, err := r.leases.SetPosition(wctx, h.Item, as.Epoch, meta.Sequence.Stream); err != nil {
		// The next position stored covers this one; until then, a
		// holder after this one reads these messages again.
		r.log.Warn("partition position not stored", "source", as.Name, "partition", as.Partition, "seq", meta.Sequence.Stream, "err", err)
	}
	return done, nil
}

// nextBatch waits for a message of msgs, then adds to batch those that
// follow at once, up to applyBatch messages and applyBatchBytes. Its error
// is the first Next's: msgs stopped, or its consumer gone (no heartbeat
// within two; a wait shorter than that would never see one missing).
func nextBatch(msgs jetstream.MessagesContext, batch *[]apply.Message) error {
	m, err := msgs.Next()
	if err != nil {
		return err
	}
	*batch = append(*batch, m)
	size := len(m.Data())
	for len(*batch) < applyBatch && size < applyBatchBytes {
		m, err := msgs.Next(jetstream.NextMaxWait(applyLinger))
		if err != nil {
			break
		}
		*batch = append(*batch, m)
		size += len(m.Data())
	}
	return nil
}

// newReader makes the ephemeral consumer that reads the item's partition
// from the message after pos.
func (r *Reconciler) newReader(ctx context.Context, it lease.Item, pos uint64) (jetstream.Consumer, error) {
	c := jetstream.ConsumerConfig{
		Name:              readerPrefix(r.opts.Region, it.Source, it.Partition) + r.leases.Token() + "-" + strconv.FormatUint(readers.Add(1), 10),
		FilterSubject:     gossip.PartitionSubject(it.Source, it.Partition),
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		AckPolicy:         jetstream.AckNonePolicy,
		InactiveThreshold: readerIdle,
		Replicas:          1,
		MemoryStorage:     true,
	}
	if pos > 0 {
		c.DeliverPolicy, c.OptStartSeq = jetstream.DeliverByStartSequencePolicy, pos+1
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cons, err := r.js.CreateConsumer(cctx, gossip.InStream(r.opts.Region), c)
	if err != nil {
		return nil, fmt.Errorf("reader of %s: %w", it, err)
	}
	return cons, nil
}

// legacyFloor is where a partition with no position stored starts: after
// the acknowledgement floor of its durable consumer of earlier releases
// when there is one (an upgrade), else at the stream's first message.
func (r *Reconciler) legacyFloor(ctx context.Context, it lease.Item) uint64 {
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	c, err := r.js.Consumer(cctx, gossip.InStream(r.opts.Region), partitionConsumer(r.opts.Region, it.Source, it.Partition))
	if err != nil {
		return 0
	}
	floor := c.CachedInfo().AckFloor.Stream
	if floor > 0 {
		r.log.Info("partition starts after the durable consumer of an earlier release", "source", it.Source, "partition", it.Partition, "seq", floor)
	}
	return floor
}
