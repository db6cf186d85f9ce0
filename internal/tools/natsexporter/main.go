// Command natsexporter serves the figures of nats-server's monitoring
// endpoints (/varz, /gatewayz, /jsz) as Prometheus metrics, for the local
// stack's monitoring (make up MONITORING=1): the servers' CPU, memory and
// traffic, each gateway's round-trip time and pending bytes, and each
// JetStream stream's and consumer's backlog.
//
// It is a multi-target exporter: GET /scrape?target=host:port reads the
// monitoring endpoint at host:port, which must be one of --targets (it
// never fetches an address it was not given). Its own metrics are on
// /metrics.
//
//	natsexporter --listen 127.0.0.1:9180 --targets 127.0.0.1:8222,127.0.0.1:8223
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// The bounds of one scrape: each endpoint's answer is read for at most
// fetchTimeout and maxBody bytes.
const (
	fetchTimeout = 5 * time.Second
	maxBody      = 32 << 20
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "natsexporter:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("natsexporter", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:9180", "the address to serve /scrape and /metrics on")
	targets := fs.String("targets", "", "the nats-server monitoring endpoints (host:port, comma-separated) that /scrape may read")
	if err := fs.Parse(args); err != nil {
		return err
	}
	allowed, err := parseTargets(*targets)
	if err != nil {
		return err
	}
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	srv := &http.Server{Handler: handler(allowed, http.DefaultClient), ReadHeaderTimeout: 5 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	slog.Info("natsexporter serving", "listen", lis.Addr().String(), "targets", allowed)
	if err := srv.Serve(lis); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// parseTargets validates --targets: at least one host:port, each with a port.
func parseTargets(s string) ([]string, error) {
	var out []string
	for t := range strings.SplitSeq(s, ",") {
		t = strings.TrimSpace(t)
		if t == "" {
			continue
		}
		if _, port, err := net.SplitHostPort(t); err != nil || port == "" {
			return nil, fmt.Errorf("--targets: %q is not host:port", t)
		}
		out = append(out, t)
	}
	if len(out) == 0 {
		return nil, errors.New("--targets: at least one nats-server monitoring address (host:port)")
	}
	return out, nil
}

// handler serves /scrape?target= for the allowed targets and /metrics.
func handler(allowed []string, client *http.Client) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.Handler())
	mux.HandleFunc("GET /scrape", func(w http.ResponseWriter, r *http.Request) {
		target := r.URL.Query().Get("target")
		if !slices.Contains(allowed, target) {
			http.Error(w, fmt.Sprintf("target: %q is not one of --targets", target), http.StatusBadRequest)
			return
		}
		reg := prometheus.NewRegistry()
		reg.MustRegister(&collector{target: target, client: client, ctx: r.Context()})
		promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(w, r)
	})
	return mux
}

var (
	descUp          = prometheus.NewDesc("nats_up", "Whether the server's monitoring endpoint answered (1) or not (0).", nil, nil)
	descCPU         = prometheus.NewDesc("nats_cpu_percent", "The server process's CPU use, percent of one core.", nil, nil)
	descMem         = prometheus.NewDesc("nats_memory_bytes", "The server process's resident memory.", nil, nil)
	descConns       = prometheus.NewDesc("nats_connections", "Client connections open now.", nil, nil)
	descInMsgs      = prometheus.NewDesc("nats_in_messages_total", "Messages received (clients, routes, gateways).", nil, nil)
	descOutMsgs     = prometheus.NewDesc("nats_out_messages_total", "Messages sent (clients, routes, gateways).", nil, nil)
	descInBytes     = prometheus.NewDesc("nats_in_bytes_total", "Bytes received.", nil, nil)
	descOutBytes    = prometheus.NewDesc("nats_out_bytes_total", "Bytes sent.", nil, nil)
	descSlow        = prometheus.NewDesc("nats_slow_consumers_total", "Clients disconnected for being slow consumers.", nil, nil)
	descGwRTT       = prometheus.NewDesc("nats_gateway_rtt_seconds", "Round-trip time of the outbound connection to each gateway (another region's cluster).", []string{"gateway"}, nil)
	descGwPending   = prometheus.NewDesc("nats_gateway_pending_bytes", "Bytes waiting to be written to each gateway.", []string{"gateway"}, nil)
	descStreamMsgs  = prometheus.NewDesc("nats_jetstream_stream_messages", "Messages held by each stream.", []string{"stream"}, nil)
	descStreamBytes = prometheus.NewDesc("nats_jetstream_stream_bytes", "Bytes held by each stream.", []string{"stream"}, nil)
	descConsPending = prometheus.NewDesc("nats_jetstream_consumer_pending_messages", "Messages of the stream not yet delivered to each consumer: its lag.", []string{"stream", "consumer"}, nil)
	descConsAck     = prometheus.NewDesc("nats_jetstream_consumer_ack_pending_messages", "Messages delivered to each consumer and not acknowledged yet.", []string{"stream", "consumer"}, nil)
)

// collector reads one server's endpoints at each scrape.
type collector struct {
	target string
	client *http.Client
	ctx    context.Context
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descUp, descCPU, descMem, descConns, descInMsgs, descOutMsgs, descInBytes, descOutBytes,
		descSlow, descGwRTT, descGwPending, descStreamMsgs, descStreamBytes, descConsPending, descConsAck} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	var v server.Varz
	if err := c.get("/varz", &v); err != nil {
		slog.Warn("scrape", "target", c.target, "err", err)
		ch <- prometheus.MustNewConstMetric(descUp, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(descUp, prometheus.GaugeValue, 1)
	ch <- prometheus.MustNewConstMetric(descCPU, prometheus.GaugeValue, v.CPU)
	ch <- prometheus.MustNewConstMetric(descMem, prometheus.GaugeValue, float64(v.Mem))
	ch <- prometheus.MustNewConstMetric(descConns, prometheus.GaugeValue, float64(v.Connections))
	ch <- prometheus.MustNewConstMetric(descInMsgs, prometheus.CounterValue, float64(v.InMsgs))
	ch <- prometheus.MustNewConstMetric(descOutMsgs, prometheus.CounterValue, float64(v.OutMsgs))
	ch <- prometheus.MustNewConstMetric(descInBytes, prometheus.CounterValue, float64(v.InBytes))
	ch <- prometheus.MustNewConstMetric(descOutBytes, prometheus.CounterValue, float64(v.OutBytes))
	ch <- prometheus.MustNewConstMetric(descSlow, prometheus.CounterValue, float64(v.SlowConsumers))

	var g server.Gatewayz
	if err := c.get("/gatewayz", &g); err == nil {
		for name, gw := range g.OutboundGateways {
			if gw == nil || gw.Connection == nil {
				continue
			}
			if rtt, err := time.ParseDuration(gw.Connection.RTT); err == nil {
				ch <- prometheus.MustNewConstMetric(descGwRTT, prometheus.GaugeValue, rtt.Seconds(), name)
			}
			ch <- prometheus.MustNewConstMetric(descGwPending, prometheus.GaugeValue, float64(gw.Connection.Pending), name)
		}
	}
	var js server.JSInfo
	if err := c.get("/jsz?accounts=true&streams=true&consumers=true", &js); err == nil {
		for _, acc := range js.AccountDetails {
			if acc == nil {
				continue
			}
			for _, st := range acc.Streams {
				ch <- prometheus.MustNewConstMetric(descStreamMsgs, prometheus.GaugeValue, float64(st.State.Msgs), st.Name)
				ch <- prometheus.MustNewConstMetric(descStreamBytes, prometheus.GaugeValue, float64(st.State.Bytes), st.Name)
				for _, ci := range st.Consumer {
					if ci == nil {
						continue
					}
					ch <- prometheus.MustNewConstMetric(descConsPending, prometheus.GaugeValue, float64(ci.NumPending), st.Name, ci.Name)
					ch <- prometheus.MustNewConstMetric(descConsAck, prometheus.GaugeValue, float64(ci.NumAckPending), st.Name, ci.Name)
				}
			}
		}
	}
}

// get decodes the JSON of path on the target.
func (c *collector) get(path string, into any) error {
	ctx, cancel := context.WithTimeout(c.ctx, fetchTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+c.target+path, nil)
	if err != nil {
		return err
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", path, resp.Status)
	}
	return json.NewDecoder(io.LimitReader(resp.Body, maxBody)).Decode(into)
}
