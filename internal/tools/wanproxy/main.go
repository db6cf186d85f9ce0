// Command wanproxy puts wide-area delays between the regions of the local
// stack (scripts/stack.sh, `make up WAN=...`): one process, a listener per
// route, each forwarding to its target over a wanproxy.Link.
//
//	--tcp LISTEN=TARGET,DELAY          a plain TCP route (a Peer link), DELAY each way
//	--nats-gateway LISTEN=TARGET,CLUSTER:DELAY,...
//	                                   a NATS server's gateway port: a connection
//	                                   dialed by a server of CLUSTER takes its DELAY
//	                                   each way; another cluster's takes none
//
// It answers GET /healthz on --http.listen-address once every listener is
// up, and stops on SIGINT or SIGTERM.
//
//	go run ./internal/tools/wanproxy --http.listen-address 127.0.0.1:9290 \
//	  --tcp 127.0.0.1:18182=127.0.0.1:8082,40ms \
//	  --nats-gateway 127.0.0.1:17222=127.0.0.1:7222,eu-west:40ms,ap-south:110ms
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/limiterd/limiterd/internal/wanproxy"
	"github.com/limiterd/limiterd/internal/wanproxy/natsgateway"
)

func main() { os.Exit(run(os.Args[1:])) }

// routes is a repeatable flag.
type routes []string

func (r *routes) String() string     { return strings.Join(*r, " ") }
func (r *routes) Set(s string) error { *r = append(*r, s); return nil }

// route is one listener: a plain TCP route has delay, a gateway route
// delays by dialing cluster.
type route struct {
	listen, target string
	delay          time.Duration
	clusters       map[string]time.Duration // nil for a plain TCP route
}

// parseRoute parses LISTEN=TARGET,OPT,...: for a plain route one OPT, the
// delay; for a gateway route CLUSTER:DELAY each.
func parseRoute(s string, gateway bool) (route, error) {
	listen, rest, ok := strings.Cut(s, "=")
	if !ok || listen == "" {
		return route{}, fmt.Errorf("%q: want LISTEN=TARGET,OPT[,OPT]", s)
	}
	parts := strings.Split(rest, ",")
	r := route{listen: listen, target: parts[0]}
	if _, _, err := net.SplitHostPort(r.listen); err != nil {
		return route{}, fmt.Errorf("%q: listen address: %w", s, err)
	}
	if _, _, err := net.SplitHostPort(r.target); err != nil {
		return route{}, fmt.Errorf("%q: target address: %w", s, err)
	}
	if !gateway {
		if len(parts) != 2 {
			return route{}, fmt.Errorf("%q: want LISTEN=TARGET,DELAY", s)
		}
		d, err := parseDelay(parts[1])
		if err != nil {
			return route{}, fmt.Errorf("%q: %w", s, err)
		}
		r.delay = d
		return r, nil
	}
	r.clusters = map[string]time.Duration{}
	for _, p := range parts[1:] {
		name, ds, ok := strings.Cut(p, ":")
		if !ok || name == "" {
			return route{}, fmt.Errorf("%q: %q: want CLUSTER:DELAY", s, p)
		}
		d, err := parseDelay(ds)
		if err != nil {
			return route{}, fmt.Errorf("%q: %s: %w", s, name, err)
		}
		r.clusters[name] = d
	}
	return r, nil
}

func parseDelay(s string) (time.Duration, error) {
	if s == "0" {
		return 0, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, err
	}
	if d < 0 {
		return 0, fmt.Errorf("delay %v: negative", d)
	}
	return d, nil
}

func run(args []string) int {
	fs := flag.NewFlagSet("wanproxy", flag.ContinueOnError)
	httpAddr := fs.String("http.listen-address", "127.0.0.1:9290", "address of GET /healthz")
	jitter := fs.Duration("jitter", 0, "random extra delay per chunk, uniform in [0, jitter), on every route")
	var tcp, gw routes
	fs.Var(&tcp, "tcp", "a plain TCP route LISTEN=TARGET,DELAY (repeatable)")
	fs.Var(&gw, "nats-gateway", "a NATS gateway route LISTEN=TARGET,CLUSTER:DELAY,... (repeatable)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	var rs []route
	var errs []error
	for _, s := range tcp {
		r, err := parseRoute(s, false)
		errs = append(errs, err)
		rs = append(rs, r)
	}
	for _, s := range gw {
		r, err := parseRoute(s, true)
		errs = append(errs, err)
		rs = append(rs, r)
	}
	if len(rs) == 0 {
		errs = append(errs, errors.New("no route: give --tcp or --nats-gateway"))
	}
	if err := errors.Join(errs...); err != nil {
		fmt.Fprintln(os.Stderr, "wanproxy:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := serve(ctx, *httpAddr, *jitter, rs); err != nil {
		fmt.Fprintln(os.Stderr, "wanproxy:", err)
		return 1
	}
	return 0
}

// serve starts every route and the health endpoint, and stops them all
// when ctx ends.
func serve(ctx context.Context, httpAddr string, jitter time.Duration, rs []route) error {
	var closers []func() error
	defer func() {
		for _, c := range closers {
			_ = c()
		}
	}()
	shape := func(d time.Duration) wanproxy.Shape { return wanproxy.Shape{Delay: d, Jitter: jitter} }
	for _, r := range rs {
		if r.clusters == nil {
			p, err := wanproxy.Listen(r.listen, r.target, wanproxy.NewLink(shape(r.delay), shape(r.delay)))
			if err != nil {
				return err
			}
			closers = append(closers, p.Close)
			fmt.Printf("wanproxy: %s -> %s, %v each way\n", r.listen, r.target, r.delay)
			continue
		}
		links := map[string]*wanproxy.Link{}
		for name, d := range r.clusters {
			links[name] = wanproxy.NewLink(shape(d), shape(d))
		}
		direct := wanproxy.NewLink(shape(0), shape(0))
		p, err := natsgateway.Listen(r.listen, r.target, func(from string) *wanproxy.Link {
			if l := links[from]; l != nil {
				return l
			}
			return direct
		})
		if err != nil {
			return err
		}
		closers = append(closers, p.Close)
		fmt.Printf("wanproxy: %s -> %s (NATS gateway), by dialing cluster %v\n", r.listen, r.target, r.clusters)
	}
	lis, err := net.Listen("tcp", httpAddr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(lis) }()
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return srv.Shutdown(sctx)
}
