package limiterd

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/pkg/gossip"
)

// maxSpendBacklog bounds the flushes kept while NATS is unreachable; past it
// the oldest are dropped (and counted): a partition then costs accuracy,
// never memory.
const maxSpendBacklog = 600

// spendPublisher flushes the accumulated spends of this instance to the
// region's local stream every interval, for the reconcilers to relay. A crash
// loses what was admitted since the last flush: at most one interval of
// this instance's spends.
type spendPublisher struct {
	acc      gossip.Accumulator
	region   string
	instance string
	interval time.Duration
	subject  string
	nc       *nats.Conn
	js       jetstream.JetStream
	log      *slog.Logger

	seq     uint64
	backlog []pendingFlush

	published, dropped, failures prometheus.Counter
	backlogGauge                 prometheus.Gauge
}

type pendingFlush struct {
	id   string
	data []byte
}

func newSpendPublisher(nc *nats.Conn, region, instance string, interval time.Duration, log *slog.Logger, reg prometheus.Registerer) (*spendPublisher, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("--nats.url: %w", err)
	}
	p := &spendPublisher{
		region: region, instance: instance, interval: interval,
		subject: gossip.LocalSubject(region), nc: nc, js: js, log: log,
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
	for _, c := range []prometheus.Collector{p.published, p.dropped, p.failures, p.backlogGauge} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// run flushes every interval until ctx ends, then flushes once more.
func (p *spendPublisher) run(ctx context.Context) {
	t := time.NewTicker(p.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			final, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			p.flush(final)
			cancel()
			if n := len(p.backlog); n > 0 {
				p.log.Warn("spends not published at shutdown", "messages", n)
			}
			return
		case <-t.C:
			p.flush(ctx)
		}
	}
}

// flush queues what accumulated since the last flush and publishes the
// backlog in order, stopping at the first failure.
func (p *spendPublisher) flush(ctx context.Context) {
	spends, first := p.acc.Drain()
	if len(spends) > 0 {
		p.seq++
		parts, err := gossip.Split(gossip.Header{
			Region: p.region, Instance: p.instance, Sequence: p.seq,
			FirstAdmitted: first, Flushed: time.Now().UnixMicro(),
		}, spends, gossip.DefaultMaxMessageBytes)
		if err != nil {
			p.log.Error("spends not encoded", "err", err)
		}
		for i, data := range parts {
			p.backlog = append(p.backlog, pendingFlush{id: fmt.Sprintf("%s-%d-%d", p.instance, p.seq, i), data: data})
		}
		p.published.Add(float64(len(spends)))
	}
	if over := len(p.backlog) - maxSpendBacklog; over > 0 {
		p.backlog = p.backlog[over:]
		p.dropped.Add(float64(over))
	}
	sent := 0
	for _, f := range p.backlog {
		pctx, cancel := context.WithTimeout(ctx, max(p.interval, time.Second))
		_, err := p.js.Publish(pctx, p.subject, f.data, jetstream.WithMsgID(f.id))
		cancel()
		if err != nil {
			p.failures.Inc()
			if sent == 0 {
				p.log.Warn("spends not published, retrying next interval", "backlog", len(p.backlog), "err", err)
			}
			break
		}
		sent++
	}
	p.backlog = p.backlog[sent:]
	p.backlogGauge.Set(float64(len(p.backlog)))
}
