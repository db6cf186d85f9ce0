// Package spendpub publishes what a limiterd admitted for reconciled rules
// to its region's local spends stream, for the reconcilers to relay to the
// other regions: every gossip interval, within BudgetTick for a key whose
// spend reached its rule's accuracy budget, and, for a key still under its
// budget, at the interval its wait reaches the max-defer bound. A flush
// carries the span context of the last sampled check whose spends were
// recorded since the flush before, in its headers (W3C traceparent).
package spendpub

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/limiterd/limiterd/internal/tracing"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// maxSpendBacklog bounds the flushes kept while NATS is unreachable; past it
// the oldest are dropped (and counted): a partition then costs accuracy,
// never memory.
const maxSpendBacklog = 600

// BudgetTick is the longest a key whose unpublished spend reached its
// rule's budget (max_overshoot × capacity) waits to be published: every
// key that reaches it within the tick goes out in the same message.
const BudgetTick = 20 * time.Millisecond

// DefaultMaxDefer is the default of --gossip.max-defer: the longest a key
// under its budget waits past the interval it was admitted in.
const DefaultMaxDefer = 10 * time.Second

// MaxWaitingKeys bounds the keys waiting to be published (about 150 bytes
// each): when that many are waiting, every one of them is published within
// BudgetTick, held or not. Without deferral the bound is one interval's
// distinct keys; with it, up to max-defer's, hence a bound.
const MaxWaitingKeys = 250_000

// Publisher flushes the accumulated spends of this instance to the
// region's local stream every interval, for the reconcilers to relay, and
// the keys that reached their budget within BudgetTick of it. With a
// max-defer of more than one interval, a key still under its budget at an
// interval waits for the next, up to max-defer: it goes out at the first
// interval its wait would pass max-defer at, or within BudgetTick of
// reaching its budget. A crash loses what was admitted since the last
// flush: at most one interval of this instance's spends, and the held
// keys' (each under its budget).
//
// Its Accumulator is safe for concurrent use; Run is called once.
type Publisher struct {
	acc      gossip.Accumulator
	region   string
	instance string
	interval time.Duration
	// holdDrains is how many interval flushes a key under its budget may
	// wait for (1: none).
	holdDrains int
	subject    string
	nc         *nats.Conn
	js         jetstream.JetStream
	// send publishes one message to the local stream with its id and
	// headers (nil: none).
	send func(ctx context.Context, data []byte, id string, header nats.Header) error
	log  *slog.Logger
	// sampled is the span context of the last sampled check whose spends
	// were recorded since the last flush (SampledSpend); nil: none.
	sampled atomic.Pointer[trace.SpanContext]

	seq     uint64
	backlog []pendingFlush
	spool   string

	published, dropped, failures prometheus.Counter
	backlogGauge                 prometheus.Gauge
	// messages counts the messages flushed, by what flushed them.
	intervalMsgs, budgetMsgs, fullMsgs prometheus.Counter
}

type pendingFlush struct {
	id   string
	data []byte
	// trace is the span context of a sampled check whose spends the flush
	// carries; invalid: none (always, for a flush read back from the
	// spool at a start).
	trace trace.SpanContext
	// file is where the flush is spooled, once a publish of it failed;
	// "" while it is in memory only.
	file string
}

// New returns a publisher for region's local stream. With spoolDir set,
// a flush that could not be published is written there before the next
// interval, and the flushes found there at start are published first (their
// message ids unchanged, so a flush published before a crash is dropped as
// a duplicate): a crash during a NATS outage then loses at most the last
// interval. Without it, the unpublished backlog lives in memory only.
// maxDefer is the longest a key under its budget waits past its interval
// (0, or under two intervals: none).
func New(nc *nats.Conn, region, instance string, interval, maxDefer time.Duration, spoolDir string, log *slog.Logger, reg prometheus.Registerer) (*Publisher, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("--nats.url: %w", err)
	}
	p, err := newPublisher(region, instance, interval, maxDefer, spoolDir, log, reg)
	if err != nil {
		return nil, err
	}
	p.nc, p.js = nc, js
	p.send = func(ctx context.Context, data []byte, id string, header nats.Header) error {
		_, err := js.PublishMsg(ctx, &nats.Msg{Subject: p.subject, Data: data, Header: header}, jetstream.WithMsgID(id))
		return err
	}
	return p, nil
}

// newPublisher is New without its NATS connection: send is left to set.
func newPublisher(region, instance string, interval, maxDefer time.Duration, spoolDir string, log *slog.Logger, reg prometheus.Registerer) (*Publisher, error) {
	if interval <= 0 {
		return nil, fmt.Errorf("--gossip.interval: must be > 0, got %v", interval)
	}
	if maxDefer < 0 {
		return nil, fmt.Errorf("--gossip.max-defer: must be >= 0, got %v", maxDefer)
	}
	p := &Publisher{
		region: region, instance: instance, interval: interval,
		holdDrains: max(1, int(maxDefer/interval)),
		subject:    gossip.LocalSubject(region), log: log,
		published: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_spends_flushed_total",
			Help: "Spend entries (rule, key) this instance published for reconciliation.",
		}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_spend_flushes_dropped_total",
			Help: "Spend messages dropped because the backlog was full while NATS was unreachable.",
		}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_spend_publish_errors_total",
			Help: "Failed attempts to publish a spend message (retried next interval).",
		}),
		backlogGauge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "limiter_spend_backlog_messages",
			Help: "Spend messages waiting to be published.",
		}),
	}
	msgs := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "limiter_spend_messages_total",
		Help: "Spend messages this instance queued for publication, by trigger: interval (every gossip interval), budget (keys that reached their rule's max_overshoot) or full (as many keys waiting as the publisher holds).",
	}, []string{"trigger"})
	p.intervalMsgs, p.budgetMsgs, p.fullMsgs = msgs.WithLabelValues("interval"), msgs.WithLabelValues("budget"), msgs.WithLabelValues("full")
	p.acc.MaxKeys = MaxWaitingKeys
	for _, c := range []prometheus.Collector{p.published, p.dropped, p.failures, p.backlogGauge, msgs} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	if spoolDir != "" {
		p.spool = spoolDir
		if err := p.loadSpool(); err != nil {
			return nil, fmt.Errorf("--gossip.spool-dir: %w", err)
		}
	}
	return p, nil
}

const spoolExt = ".spend"

// loadSpool reads the flushes a previous run spooled, oldest first.
func (p *Publisher) loadSpool() error {
	if err := os.MkdirAll(p.spool, 0o700); err != nil {
		return err
	}
	names, err := filepath.Glob(filepath.Join(p.spool, "*"+spoolExt))
	if err != nil {
		return err
	}
	slices.Sort(names)
	for _, name := range names {
		data, err := os.ReadFile(name)
		if err != nil {
			return err
		}
		// The name is <unix nanoseconds>_<message id>.spend.
		_, id, ok := strings.Cut(strings.TrimSuffix(filepath.Base(name), spoolExt), "_")
		if !ok || id == "" {
			p.log.Warn("spool file with an unexpected name skipped", "file", name)
			continue
		}
		p.backlog = append(p.backlog, pendingFlush{id: id, data: data, file: name})
	}
	if len(p.backlog) > 0 {
		p.log.Info("spooled spends found, publishing them first", "messages", len(p.backlog))
	}
	return nil
}

// spoolBacklog writes the flushes not yet spooled to the spool directory.
func (p *Publisher) spoolBacklog() {
	if p.spool == "" {
		return
	}
	for i := range p.backlog {
		f := &p.backlog[i]
		if f.file != "" {
			continue
		}
		name := filepath.Join(p.spool, fmt.Sprintf("%019d_%s%s", time.Now().UnixNano(), f.id, spoolExt))
		if err := writeSynced(name, f.data); err != nil {
			p.log.Warn("spends not spooled: a crash now loses them", "err", err)
			return
		}
		f.file = name
	}
}

func writeSynced(name string, data []byte) error {
	tmp := name + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, name)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

func (p *Publisher) unspool(f pendingFlush) {
	if f.file != "" {
		if err := os.Remove(f.file); err != nil && !errors.Is(err, fs.ErrNotExist) {
			p.log.Warn("spool file not removed: it is published again (a duplicate) at the next start", "file", f.file, "err", err)
		}
	}
}

// Run flushes every interval until ctx ends, then flushes every key once
// more, held ones included; a key reaching its budget is flushed, with
// every other such key, within BudgetTick, and every key when
// MaxWaitingKeys are waiting.
func (p *Publisher) Run(ctx context.Context) {
	t := time.NewTicker(p.interval)
	defer t.Stop()
	hot := p.acc.Hot()
	var tick <-chan time.Time // armed by the first hot key
	for {
		select {
		case <-ctx.Done():
			final, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			p.flushAll(final, p.intervalMsgs)
			cancel()
			if n := len(p.backlog); n > 0 {
				p.log.Warn("spends not published at shutdown", "messages", n)
			}
			return
		case <-t.C:
			p.flush(ctx)
		case <-hot:
			if tick == nil {
				tick = time.After(BudgetTick)
			}
		case <-tick:
			tick = nil
			p.flushHot(ctx)
		}
	}
}

// flush queues what accumulated since the last flush, but the keys under
// their budget that may wait longer, and publishes the backlog in order,
// stopping at the first failure. A full accumulator is drained whole.
func (p *Publisher) flush(ctx context.Context) {
	if p.acc.Full() {
		p.flushAll(ctx, p.fullMsgs)
		return
	}
	spends, first := p.acc.DrainDue(p.holdDrains, time.Now().UnixMicro())
	p.queue(spends, first, p.intervalMsgs)
	p.publish(ctx)
}

// flushAll queues every key waiting, held or not, and publishes the
// backlog.
func (p *Publisher) flushAll(ctx context.Context, msgs prometheus.Counter) {
	spends, first := p.acc.Drain()
	p.queue(spends, first, msgs)
	p.publish(ctx)
}

// flushHot queues the keys that reached their budget and publishes them.
// While an earlier message waits (NATS unreachable) they wait too, for the
// interval, so that an outage does not fill the backlog with ticks.
func (p *Publisher) flushHot(ctx context.Context) {
	if len(p.backlog) > 0 {
		return
	}
	if p.acc.Full() {
		p.flushAll(ctx, p.fullMsgs)
		return
	}
	spends, first := p.acc.DrainHot()
	if len(spends) == 0 {
		return
	}
	p.queue(spends, first, p.budgetMsgs)
	p.publish(ctx)
}

// queue encodes spends as the next flush, in as few messages as fit, at
// the end of the backlog.
func (p *Publisher) queue(spends []gossip.Spend, first int64, msgs prometheus.Counter) {
	if len(spends) == 0 {
		return
	}
	p.seq++
	var sc trace.SpanContext
	if last := p.sampled.Swap(nil); last != nil {
		sc = *last
	}
	parts, err := gossip.Split(gossip.Header{
		Region: p.region, Instance: p.instance, Sequence: p.seq,
		FirstAdmitted: first, Flushed: time.Now().UnixMicro(),
	}, spends, gossip.DefaultMaxMessageBytes)
	if err != nil {
		p.log.Error("spends not encoded", "err", err)
	}
	for i, data := range parts {
		p.backlog = append(p.backlog, pendingFlush{id: fmt.Sprintf("%s-%d-%d", p.instance, p.seq, i), data: data, trace: sc})
	}
	p.published.Add(float64(len(spends)))
	msgs.Add(float64(len(parts)))
}

// publish publishes the backlog in order, stopping at the first failure.
func (p *Publisher) publish(ctx context.Context) {
	if over := len(p.backlog) - maxSpendBacklog; over > 0 {
		for _, f := range p.backlog[:over] {
			p.unspool(f)
		}
		p.backlog = p.backlog[over:]
		p.dropped.Add(float64(over))
	}
	sent := 0
	for _, f := range p.backlog {
		pctx, cancel := context.WithTimeout(ctx, max(p.interval, time.Second))
		err := p.send(pctx, f.data, f.id, f.header())
		cancel()
		if err != nil {
			p.failures.Inc()
			if sent == 0 {
				p.log.Warn("spends not published, retrying next interval", "backlog", len(p.backlog), "err", err)
			}
			break
		}
		p.unspool(f)
		sent++
	}
	p.backlog = p.backlog[sent:]
	p.spoolBacklog()
	p.backlogGauge.Set(float64(len(p.backlog)))
}

// header is f's message headers: its span context, when it has one (a
// map of its own each time: a publish writes its id there).
func (f pendingFlush) header() nats.Header {
	if !f.trace.IsValid() {
		return nil
	}
	h := nats.Header{}
	tracing.InjectHeader(h, f.trace)
	return h
}

// SampledSpend keeps sc, the span context of a sampled check whose spends
// the Accumulator just recorded, for the next flush: the flush names the
// last such check (one of its keys may be held for a later flush, by
// --gossip.max-defer). Unsampled checks do not call it.
func (p *Publisher) SampledSpend(sc trace.SpanContext) { p.sampled.Store(&sc) }

// Accumulator collects what this instance admits, for the next flush.
func (p *Publisher) Accumulator() *gossip.Accumulator { return &p.acc }
