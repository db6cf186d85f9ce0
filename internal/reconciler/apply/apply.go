// Package apply applies messages of another region's spends to this
// region's buckets: it validates each message, turns its spends into debits
// with this region's rules, runs them through the store at most once each,
// observes the lag and the overshoot, and defers the debits of clients
// whose Redis node fails to the retry stream. It tells its caller how far
// it got, in stream order; it acknowledges only the retry stream's entries.
// With a tracer, a message that carries a sampled check's span context
// (package spendpub) is applied in a span linked to it.
package apply

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/tracing"
	"github.com/limiterd/limiterd/pkg/gossip"
	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// DefaultTimeout bounds the store's work on one message.
const DefaultTimeout = 5 * time.Second

// Options configure an Applier.
type Options struct {
	// Region is this region: its retry stream's subjects name it.
	Region string
	// AckWait is how long a message may stay unacknowledged before it is
	// delivered again; an ack, a publish to the retry stream and a read
	// of it each wait half of it at most.
	AckWait time.Duration
	// StreamMaxAge is the oldest message the streams keep: with ten ack
	// waits, how long a client's marker and a flush's record live.
	StreamMaxAge time.Duration
	// MaxMessageBytes bounds a spend message.
	MaxMessageBytes int
	// ClockAllowance is added to each spend's last admission, read on its
	// source's clock: the instant it is debited as of (redisstore.Debit.At).
	ClockAllowance time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Now is the clock the lag is measured on (nil: time.Now).
	Now func() time.Time
	// BeforeDone, when set, runs after a message's debits are applied (or
	// deferred) and before the message counts as done; returning false
	// stops the batch there, as a reconciler that dies before storing its
	// position would: the message is read again.
	BeforeDone func(src string, seq uint64) bool
	// TracerProvider, when set, traces the apply of each message that
	// carries a span context (see ApplyBatch).
	TracerProvider trace.TracerProvider
}

// Store applies debits at most once each, by their stream position.
type Store interface {
	FirstSeen(ctx context.Context, src, instance string, seq uint64, part uint32, pos redisstore.Position, ttl time.Duration) (string, error)
	ApplyDebits(ctx context.Context, src string, pos redisstore.Position, markerTTL time.Duration, clients []redisstore.ClientDebits) (redisstore.DebitResult, error)
	// FirstSeenMany and ApplyMessages are FirstSeen and ApplyDebits of
	// several messages of one partition, in order, in one round trip.
	FirstSeenMany(ctx context.Context, src string, recs []redisstore.Record, ttl time.Duration) ([]string, []error)
	ApplyMessages(ctx context.Context, src string, markerTTL time.Duration, msgs []redisstore.MessageDebits) ([]redisstore.DebitResult, error)
}

// Publisher publishes to the retry stream.
type Publisher interface {
	Publish(ctx context.Context, subject string, payload []byte, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error)
}

// Rules are the rules in force.
type Rules interface {
	Current() *rules.Set
}

// RetryStream is the retry stream, as read for the buckets whose debits
// wait there: before every message with debits, so once per message of
// each partition.
type RetryStream interface {
	// Pending is how many entries wait under each subject matching
	// filter that has any.
	Pending(ctx context.Context, filter string) (map[string]uint64, error)
}

// Source is one other region whose spends are applied here, as one
// consumer reads them.
type Source struct {
	// Name is the region.
	Name string
	// Epoch is the creation (µs) of the inbound stream the messages come
	// from: with a message's stream sequence, its position.
	Epoch int64
	// Partition is the partition of the source's spends the consumer reads
	// (gossip.PartitionSubject). Each partition has its own markers and
	// records.
	Partition int
	// Retry is this region's retry stream.
	Retry RetryStream
}

// position is the position of the message at stream sequence seq.
func (src Source) position(seq uint64) redisstore.Position {
	return redisstore.Position{Epoch: src.Epoch, Seq: seq, Partition: src.Partition}
}

// recordSource is what a flush's record of partition p of src is kept
// under: the region and the partition ("us-east.3"; no region name holds
// '.'), since the relay splits one flush part into one message per
// partition, each with the flush's name, each to be applied once.
func recordSource(src string, p int) string {
	return src + "." + strconv.Itoa(p)
}

// Applier applies messages of spends. Its zero value is not usable: make
// it with New. It is safe for concurrent use; each partition's loop gives
// it its messages in stream order, a batch at a time.
type Applier struct {
	opts  Options
	log   *slog.Logger
	store Store
	js    Publisher
	rules Rules
	m     *Metrics
	// tracer traces the messages that carry a span context; nil: none.
	tracer trace.Tracer
}

// New returns an Applier of store, publishing retries with js, debiting
// with the limits of the rules rs has in force, and recording in m.
func New(opts Options, store Store, js Publisher, rs Rules, m *Metrics) *Applier {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	a := &Applier{opts: opts, log: opts.Logger, store: store, js: js, rules: rs, m: m}
	if opts.TracerProvider != nil {
		a.tracer = opts.TracerProvider.Tracer(tracerName)
	}
	return a
}

// Message is a spend message as ApplyBatch reads it: a jetstream.Msg, of
// which it uses no acknowledgement.
type Message interface {
	Data() []byte
	Subject() string
	Metadata() (*jetstream.MsgMetadata, error)
	Headers() nats.Header
}

// batchItem is one message of a batch, as ApplyBatch goes through it.
type batchItem struct {
	pos     redisstore.Position
	b       *gossipv1.SpendBatch
	clients []redisstore.ClientDebits
	entry   retryEntry
	// settled: rejected, or with nothing to debit; replay: a flush applied
	// already under another position.
	settled, replay bool
	// direct are applied now; waiting go to the retry stream.
	direct, waiting []redisstore.ClientDebits
	res             redisstore.DebitResult
	// link is the span context the message carries, read with a tracer
	// only; invalid: none.
	link trace.SpanContext
}

// ApplyBatch applies msgs, messages of one partition of src's spends in
// stream order, with one round trip for their flush records and one for
// their debits (per Redis node), then finishes each in order: it is done
// once its debits are applied or put in the retry stream, or it is
// rejected (malformed or misaddressed: counted, logged and passed). A
// message that cannot be finished now (its record or the retry stream not
// answering) stops the batch: ApplyBatch returns its index, done, and
// leaves it and every later one for the caller to read again, in order
// (what was applied of them is marked, and debits nothing again); done is
// len(msgs) when every message was finished. A later message is never
// debited for a client before an earlier one's debit of the client that
// failed: its marker would take the earlier one for a duplicate. The store
// calls take their deadline from ctx (DefaultTimeout when it has none),
// and are not cut short by its cancellation: a batch begun is finished.
//
// With a tracer, each message done that carries a span context (a sampled
// check's, in its headers) gets a span from the batch's start to its end:
// a new root, linked to that context (the check returned long before).
func (a *Applier) ApplyBatch(ctx context.Context, src Source, msgs []Message) (done int) {
	var began time.Time
	if a.tracer != nil {
		began = time.Now()
	}
	items := make([]*batchItem, 0, len(msgs))
	var recs []redisstore.Record
	var recItems []*batchItem
	for _, msg := range msgs {
		it := a.decode(src, msg)
		if a.tracer != nil {
			it.link = tracing.SpanContextFromHeader(msg.Headers())
		}
		items = append(items, it)
		if !it.settled {
			recs = append(recs, redisstore.Record{Instance: it.b.GetInstance(), Seq: it.b.GetSequence(), Part: it.b.GetPart(), Pos: it.pos})
			recItems = append(recItems, it)
		}
	}
	stop := len(items) // the first message not finished
	stopAt := func(it *batchItem) {
		if i := slices.Index(items, it); i < stop {
			stop = i
		}
	}
	actx, cancel := storeContext(ctx)
	defer cancel()
	// A flush is applied once by its name, (instance, sequence, part),
	// not only by its stream position: the same bytes published again are
	// a new stream message that the clients' markers would take for a new
	// flush.
	var firsts []string
	var errs []error
	if len(recs) > 0 {
		firsts, errs = a.store.FirstSeenMany(actx, recordSource(src.Name, src.Partition), recs, a.recordTTL())
	}
	// deferred are the buckets of the clients an earlier message of the
	// batch sends to the retry stream whole: a later debit of theirs
	// waits behind them.
	deferred := map[int]bool{}
	var toApply []*batchItem
	for k, it := range recItems {
		err := errs[k]
		switch {
		case errors.Is(err, redisstore.ErrNotRecorded):
			// Both copies of the record are on nodes that are down: every
			// client waits in the retry stream, which writes the record
			// first.
			it.entry.Flush = &flushName{Instance: it.b.GetInstance(), Sequence: it.b.GetSequence(), Part: it.b.GetPart()}
			a.log.Warn("message not recorded, its debits wait in the retry stream", "source", src.Name, "seq", it.pos.Seq, "err", err)
			it.waiting = it.clients
			for _, c := range it.clients {
				deferred[bucketOf(c.Key)] = true
			}
		case err != nil:
			a.log.Warn("message not recorded, will retry", "source", src.Name, "seq", it.pos.Seq, "err", err)
			stopAt(it)
		case firsts[k] != it.pos.String():
			it.replay = true
			a.m.Replays.WithLabelValues(src.Name).Inc()
			a.m.Duplicates.WithLabelValues(src.Name).Add(float64(len(it.clients)))
			a.log.Warn("spend message replayed: applied already, skipped", "source", src.Name, "seq", it.pos.Seq,
				"first", firsts[k], "instance", it.b.GetInstance(), "flush", it.b.GetSequence(), "part", it.b.GetPart())
		default:
			if len(deferred) > 0 {
				for _, c := range it.clients {
					if deferred[bucketOf(c.Key)] {
						it.waiting = append(it.waiting, c)
					} else {
						it.direct = append(it.direct, c)
					}
				}
			} else {
				it.direct = it.clients
			}
			toApply = append(toApply, it)
		}
	}
	toApply = slices.DeleteFunc(toApply, func(it *batchItem) bool { return slices.Index(items, it) >= stop })
	if len(toApply) > 0 {
		pending, err := a.pendingBuckets(actx, src)
		if err != nil {
			a.log.Warn("retry stream not read, will retry", "source", src.Name, "seq", toApply[0].pos.Seq, "err", err)
			stopAt(toApply[0])
			toApply = nil
		}
		if len(pending) > 0 {
			for _, it := range toApply {
				direct := it.direct
				it.direct = nil
				for _, c := range direct {
					if pending[bucketOf(c.Key)] {
						it.waiting = append(it.waiting, c)
					} else {
						it.direct = append(it.direct, c)
					}
				}
			}
		}
	}
	if len(toApply) > 0 {
		batch := make([]redisstore.MessageDebits, len(toApply))
		for k, it := range toApply {
			batch[k] = redisstore.MessageDebits{Pos: it.pos, Clients: it.direct}
		}
		res, err := a.store.ApplyMessages(actx, src.Name, a.MarkerTTL(), batch)
		for k, it := range toApply {
			it.res = res[k]
			a.observe(src.Name, it.b.GetFirstAdmittedUnixMicros(), it.res, it.direct)
			for _, i := range it.res.Failed {
				it.waiting = append(it.waiting, it.direct[i])
			}
			if len(it.res.Failed) > 0 {
				a.log.Warn("debits not applied, they wait in the retry stream", "source", src.Name, "seq", it.pos.Seq,
					"applied", it.res.Applied, "failed", len(it.res.Failed), "err", err)
			}
		}
	}
	// Finish each message in order, up to the first that cannot be.
	for i, it := range items {
		if i >= stop {
			break
		}
		if len(it.waiting) > 0 {
			if err := a.publishRetries(actx, it.entry, it.waiting); err != nil {
				a.log.Warn("debits not put in the retry stream, will retry", "source", src.Name, "seq", it.pos.Seq, "err", err)
				return i
			}
			a.m.Deferred.WithLabelValues(src.Name).Add(float64(len(it.waiting)))
		}
		if !it.settled && !it.replay && a.opts.BeforeDone != nil && !a.opts.BeforeDone(src.Name, it.pos.Seq) {
			return i
		}
		if it.link.IsValid() {
			a.traceDone(src, it, began)
		}
	}
	return stop
}

// tracerName names the tracer of the apply's spans.
const tracerName = "github.com/limiterd/limiterd/internal/reconciler/apply"

// traceDone records the apply of it, a message of src done, from began to
// now, in a span linked to the span context it carries.
func (a *Applier) traceDone(src Source, it *batchItem, began time.Time) {
	_, span := a.tracer.Start(context.Background(), "apply", trace.WithNewRoot(), trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithTimestamp(began), trace.WithLinks(trace.Link{SpanContext: it.link}),
		trace.WithAttributes(attribute.String("limiter.apply.source_region", src.Name), attribute.Int("limiter.apply.partition", src.Partition),
			attribute.Int64("limiter.apply.stream_seq", int64(it.pos.Seq)), attribute.Int("limiter.apply.clients_debited", it.res.Applied),
			attribute.Int("limiter.apply.clients_deferred", len(it.waiting)), attribute.Bool("limiter.apply.replay", it.replay)))
	if it.b == nil {
		span.SetStatus(codes.Error, "rejected")
	}
	span.End()
}

// storeContext is ctx for the store's calls: its deadline (DefaultTimeout
// from now when it has none), without its cancellation.
func storeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if d, ok := ctx.Deadline(); ok {
		return context.WithDeadline(context.WithoutCancel(ctx), d)
	}
	return context.WithTimeout(context.WithoutCancel(ctx), DefaultTimeout)
}

// decode reads msg of src into a batch item: rejected or with nothing to
// debit (settled), or with clients to debit.
func (a *Applier) decode(src Source, msg Message) *batchItem {
	meta, err := msg.Metadata()
	if err != nil {
		a.reject(msg, src.Name, err)
		return &batchItem{settled: true}
	}
	b, bad, err := gossip.DecodeEntries(msg.Data(), a.opts.MaxMessageBytes)
	if err == nil && b.GetRegion() != src.Name {
		err = fmt.Errorf("%w: region: %q on %s's subject", gossip.ErrInvalidBatch, b.GetRegion(), src.Name)
	}
	if err != nil {
		a.reject(msg, src.Name, err)
		return &batchItem{settled: true}
	}
	pos := src.position(meta.Sequence.Stream)
	if len(bad) > 0 && meta.NumDelivered == 1 {
		a.m.Invalid.WithLabelValues(src.Name).Add(float64(len(bad)))
		a.log.Warn("invalid spends skipped", "source", src.Name, "seq", pos.Seq, "count", len(bad), "first", bad[0])
	}
	clients, skipped := a.debits(b.GetSpends(), b.GetFlushedUnixMicros())
	if skipped > 0 && meta.NumDelivered == 1 {
		a.m.Skipped.WithLabelValues(src.Name).Add(float64(skipped))
	}
	return &batchItem{pos: pos, b: b, clients: clients, settled: len(clients) == 0,
		entry: retryEntry{Source: src.Name, Epoch: pos.Epoch, Seq: pos.Seq, Partition: &pos.Partition,
			FirstAdmitted: b.GetFirstAdmittedUnixMicros(), Flushed: b.GetFlushedUnixMicros()}}
}

// observe records what one application of debits did.
func (a *Applier) observe(src string, firstAdmitted int64, res redisstore.DebitResult, clients []redisstore.ClientDebits) {
	a.m.Applied.WithLabelValues(src).Add(float64(res.Applied))
	a.m.Duplicates.WithLabelValues(src).Add(float64(res.Duplicates))
	a.m.Refilled.WithLabelValues(src).Add(float64(res.Refilled))
	failed := make(map[int]bool, len(res.Failed))
	for _, i := range res.Failed {
		failed[i] = true
	}
	for i, c := range clients {
		if failed[i] {
			continue
		}
		for _, d := range c.Debits {
			a.m.Overshoot.WithLabelValues(d.Rule, src).Observe(d.Overshoot)
		}
	}
	if res.Applied > 0 {
		lag := a.opts.Now().Sub(time.UnixMicro(firstAdmitted))
		a.m.Lag.WithLabelValues(src).Observe(max(lag.Seconds(), 0))
	}
}

// ack acknowledges an applied (or skipped) retry entry. It does not wait
// for the server's confirmation, a round trip per entry: the consumer
// delivers the next entry once the ack is in, and an ack lost is a
// redelivery after the ack wait, a duplicate the markers and records
// catch.
func (a *Applier) ack(_ context.Context, src string, seq uint64, msg jetstream.Msg) {
	if err := msg.Ack(); err != nil {
		a.log.Warn("ack failed", "source", src, "seq", seq, "err", err)
	}
}

// MarkerTTL is how long a client's marker lives: as long as a message can
// be read again, which is as long as the stream keeps it, with ten ack
// waits as a margin for one read again near the end of it.
func (a *Applier) MarkerTTL() time.Duration { return a.opts.StreamMaxAge + 10*a.opts.AckWait }

// recordTTL is how long a flush's record lives: as long as a marker.
func (a *Applier) recordTTL() time.Duration { return a.MarkerTTL() }

// debits groups spends by client, with this region's limits; spends of
// rules this region does not have or does not reconcile are skipped. An
// entry that resets its key makes its debit a reset, forgiving the
// entries of the key and rule before it.
func (a *Applier) debits(spends []*gossipv1.Spend, flushed int64) (clients []redisstore.ClientDebits, skipped int) {
	byKey := make(map[string]int)
	set := a.rules.Current()
	for _, s := range spends {
		rule := set.Get(s.GetRuleId())
		if rule == nil || !rule.Reconciled() {
			skipped++
			continue
		}
		i, ok := byKey[s.GetKey()]
		if !ok {
			i = len(clients)
			byKey[s.GetKey()] = i
			clients = append(clients, redisstore.ClientDebits{Key: s.GetKey()})
		}
		d := &clients[i]
		var at, seen int64 // unknown: now, and no hold
		if flushed > 0 {
			seen = gossip.LastAdmitted(s, flushed)
			at = seen + a.opts.ClockAllowance.Microseconds()
		}
		if j := slices.IndexFunc(d.Debits, func(x redisstore.Debit) bool { return x.Rule == rule.ID }); j >= 0 {
			if s.GetResetBefore() {
				// The reset forgives what came before it in the message.
				d.Debits[j].Amount, d.Debits[j].Reset = 0, true
			}
			d.Debits[j].Amount += s.GetCost()
			d.Debits[j].At = max(d.Debits[j].At, at)
			d.Debits[j].Seen = max(d.Debits[j].Seen, seen)
			continue
		}
		d.Debits = append(d.Debits, redisstore.Debit{Rule: rule.ID, Limit: rule.BucketFor(s.GetKey()), Amount: s.GetCost(), Reset: s.GetResetBefore(), At: at, Seen: seen})
	}
	return clients, skipped
}

// Reject terminates a message of a consumer with acknowledgements (the
// relay's, the retry stream's) that can never be applied or relayed: it
// is counted and logged, and the stream moves on. where names the
// consumer.
func (a *Applier) Reject(msg jetstream.Msg, where string, err error) {
	a.reject(msg, where, err)
	msg.Term()
}

// reject counts and logs a message that can never be applied.
func (a *Applier) reject(msg Message, where string, err error) {
	a.m.Rejected.Inc()
	a.log.Warn("spend message rejected", "from", where, "subject", msg.Subject(), "err", err)
}
