// Command overload is `make overload`: it drives a model backend on
// loopback past its capacity, open loop, with a mix of priority classes,
// through limiterd (a process of ./cmd/limiterd, built first, on the
// embedded memory store) and pkg/httplimit, under four configurations: no
// shedding, a reserve (priority load shedding), an adaptive concurrency
// limit, and the adaptive limit with a reserve (its Acquire carrying the
// request's class). It reports
// each class's goodput, p99 latency and errors at 1x and 2x load, as a
// Markdown table and an SVG chart.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/pkg/client"
	"github.com/limiterd/limiterd/pkg/httplimit"
)

// Classes are the priority classes sent, most important first, with
// their share of the arrivals.
var (
	Classes = []string{"critical", "default", "sheddable"}
	shares  = []float64{0.2, 0.5, 0.3}
)

// Configs are the configurations compared, in order.
var Configs = []string{"none", "reserve", "adaptive", "adaptive+reserve"}

// parseConfigs reads a comma-separated list of Configs; "" is all of them.
func parseConfigs(s string) ([]string, error) {
	if strings.TrimSpace(s) == "" {
		return slices.Clone(Configs), nil
	}
	var out []string
	for c := range strings.SplitSeq(s, ",") {
		c = strings.TrimSpace(c)
		if !slices.Contains(Configs, c) {
			return nil, fmt.Errorf("no configuration %q (the configurations are %s)", c, strings.Join(Configs, ", "))
		}
		out = append(out, c)
	}
	return out, nil
}

// leased reports whether cfg's rule is a concurrency rule: its requests
// go through httplimit.Concurrency (an Acquire) rather than Middleware.
func leased(cfg string) bool { return strings.HasPrefix(cfg, "adaptive") }

// Options are the experiment's parameters: the model backend and the
// load.
type Options struct {
	// Base is the backend's latency with nothing else in flight; Capacity
	// and Exponent shape its growth: base × (1 + inflight/capacity)^k.
	Base     time.Duration
	Capacity int
	Exponent float64
	// Ceiling is the in-flight count past which the backend fails (500).
	Ceiling int
	// Rate is the 1x arrival rate (requests/s); Loads its multiples.
	Rate  float64
	Loads []float64
	// Warmup is run before each measured Duration; Timeout bounds a
	// request (a later answer is an error).
	Warmup, Duration, Timeout time.Duration
	Seed                      uint64
	// Configs are the configurations run, in order (of Configs).
	Configs []string
}

// DefaultOptions: a backend that serves at most 250 requests/s (20 in
// flight at 80 ms), 30 ms at 150/s, failing past 80 in flight.
func DefaultOptions() Options {
	return Options{Base: 20 * time.Millisecond, Capacity: 20, Exponent: 2, Ceiling: 80,
		Rate: 150, Loads: []float64{1, 2}, Warmup: 3 * time.Second, Duration: 10 * time.Second, Timeout: time.Second, Seed: 1,
		Configs: slices.Clone(Configs)}
}

// Row is one class's figures in one run.
type Row struct {
	Config string
	Load   float64
	Class  string
	// Offered and Goodput are requests/s sent and served (200 in time).
	Offered, Goodput float64
	// P99 is the 99th percentile latency of the requests served.
	P99 time.Duration
	// Shed were refused by limiterd (429 or 503); Errors failed at the
	// backend (500) or ran out of time.
	Shed, Errors int
}

// Report is every run's rows.
type Report struct {
	Opts Options
	Rows []Row
	// LoadBefore and LoadAfter are /proc/loadavg before the first run and
	// after the last (empty where there is none).
	LoadBefore, LoadAfter string
}

func main() {
	o := DefaultOptions()
	out := flag.String("out", "bin/overload", "directory of the report (overload.md) and the chart (overload.svg)")
	flag.DurationVar(&o.Duration, "duration", o.Duration, "measured time of each run")
	flag.DurationVar(&o.Warmup, "warmup", o.Warmup, "time before each run is measured")
	flag.Float64Var(&o.Rate, "rate", o.Rate, "the 1x arrival rate, requests/s")
	configs := flag.String("configs", "", "the configurations to run, comma-separated (default all: "+strings.Join(Configs, ",")+")")
	flag.Parse()
	var err error
	if o.Configs, err = parseConfigs(*configs); err != nil {
		fmt.Fprintln(os.Stderr, "overload:", err)
		os.Exit(2)
	}
	rep, err := Run(context.Background(), o)
	if err == nil {
		err = rep.Write(*out)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "overload:", err)
		os.Exit(1)
	}
	_ = rep.WriteMarkdown(os.Stdout)
}

// Run builds limiterd, then runs every configuration at every load.
func Run(ctx context.Context, o Options) (*Report, error) {
	dir, err := os.MkdirTemp("", "overload")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	bin, err := build(ctx, dir)
	if err != nil {
		return nil, err
	}
	rep := &Report{Opts: o, LoadBefore: loadavg()}
	for _, cfg := range o.Configs {
		for _, load := range o.Loads {
			rows, err := runOne(ctx, o, bin, dir, cfg, load)
			if err != nil {
				return nil, fmt.Errorf("%s at %vx: %w", cfg, load, err)
			}
			rep.Rows = append(rep.Rows, rows...)
		}
	}
	rep.LoadAfter = loadavg()
	return rep, nil
}

// build builds ./cmd/limiterd into dir with $GO (default go), from the
// working directory's module, and returns the binary.
func build(ctx context.Context, dir string) (string, error) {
	goBin := os.Getenv("GO")
	if goBin == "" {
		goBin = "go"
	}
	bin := filepath.Join(dir, "limiterd")
	if out, err := exec.CommandContext(ctx, goBin, "build", "-o", bin, "github.com/limiterd/limiterd/cmd/limiterd").CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/limiterd: %w\n%s", err, out)
	}
	return bin, nil
}

// startLimiterd starts bin on its embedded store with the rules of cfg,
// and waits until it is ready; stop kills it, by its pid.
func startLimiterd(ctx context.Context, bin, dir, cfg string) (grpcAddr string, stop func(), _ error) {
	file := filepath.Join(dir, cfg+".yml")
	if err := os.WriteFile(file, []byte(rulesOf(cfg)), 0o600); err != nil {
		return "", nil, err
	}
	grpcAddr, err := freeAddr()
	if err != nil {
		return "", nil, err
	}
	httpAddr, err := freeAddr()
	if err != nil {
		return "", nil, err
	}
	log := filepath.Join(dir, cfg+".log")
	p, err := testenv.StartProcess(dir, log, bin, "--rules.file", file,
		"--grpc.listen-address", grpcAddr, "--http.listen-address", httpAddr, "--log.level", "warn")
	if err != nil {
		return "", nil, err
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+httpAddr+"/readyz", nil)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return grpcAddr, p.Kill, nil
			}
		}
		select {
		case <-p.Done():
			return "", nil, fmt.Errorf("limiterd exited: %w\n%s", p.Err(), testenv.TailFiles(log))
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.Kill()
			return "", nil, fmt.Errorf("limiterd not ready in 20 s\n%s", testenv.TailFiles(log))
		}
	}
}

// loadavg is the machine's load averages over 1, 5 and 15 minutes, "" on
// a system without /proc/loadavg.
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}

// rules are the rules of each configuration: none spends a bucket that
// never refuses; reserve sheds at 160/s (above the 1x rate, within what
// the backend serves in under 40 ms) keeping 20% for critical and 5% more
// for default; adaptive holds the requests in flight to what keeps them
// under 40 ms; adaptive+reserve does, keeping 20% of that limit for
// critical and 5% more for default.
func rulesOf(cfg string) string {
	const adaptive = "rules:\n  - id: inflight\n    algorithm: concurrency\n    limit: 20\n    lease_ttl: 10s\n    key_by: global\n    adaptive: {min: 2, max: 200, target_latency: 40ms}\n    match: {path: /work}\n"
	switch cfg {
	case "reserve":
		return "rules:\n  - id: shed\n    capacity: 32\n    refill_per_second: 160\n    key_by: global\n    reserve: {critical: 0.2, default: 0.05}\n    match: {path: /work}\n"
	case "adaptive":
		return adaptive
	case "adaptive+reserve":
		return adaptive + "    reserve: {critical: 0.2, default: 0.05}\n"
	}
	return "rules:\n  - id: open\n    capacity: 1000000\n    refill_per_second: 1000000\n    key_by: global\n    match: {path: /work}\n"
}

// backend is the model: latency grows with the requests in flight, and
// past the ceiling it fails at once.
type backend struct {
	o        Options
	inflight atomic.Int64
}

func (b *backend) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := b.inflight.Add(1)
	defer b.inflight.Add(-1)
	if n > int64(b.o.Ceiling) {
		http.Error(w, "overloaded", http.StatusInternalServerError)
		return
	}
	d := time.Duration(float64(b.o.Base) * math.Pow(1+float64(n)/float64(b.o.Capacity), b.o.Exponent))
	select {
	case <-time.After(d):
	case <-r.Context().Done():
		return
	}
	w.WriteHeader(http.StatusOK)
}

// freeAddr is a loopback address on a port free now.
func freeAddr() (string, error) {
	p, err := testenv.ReservePort()
	if err != nil {
		return "", err
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(p)), nil
}

// result is one request's outcome.
type result struct {
	class   int
	at      time.Duration
	latency time.Duration
	status  int // 0: no answer in time
}

func runOne(ctx context.Context, o Options, bin, dir, cfg string, load float64) ([]Row, error) {
	grpcAddr, stop, err := startLimiterd(ctx, bin, dir, cfg)
	if err != nil {
		return nil, err
	}
	defer stop()
	c, err := client.New(grpcAddr)
	if err != nil {
		return nil, err
	}
	defer c.Close()

	hopts := httplimit.Options{
		Identity: func(*http.Request) httplimit.Identity { return httplimit.Identity{User: "all"} },
		Priority: func(r *http.Request) string { return r.Header.Get("X-Priority") },
		Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	limit := httplimit.Middleware(c, hopts)
	if leased(cfg) {
		limit = httplimit.Concurrency(c, hopts)
	}
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: limit(&backend{o: o}), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(lis) }()
	defer srv.Close()

	hc := &http.Client{Timeout: o.Timeout, Transport: &http.Transport{MaxIdleConnsPerHost: 2000, MaxIdleConns: 2000}}
	defer hc.CloseIdleConnections()
	url := "http://" + addr + "/work"
	rate := o.Rate * load
	rng := rand.New(rand.NewPCG(o.Seed, uint64(load*1000)))
	var mu sync.Mutex
	var results []result
	var wg sync.WaitGroup
	start := time.Now()
	total := o.Warmup + o.Duration
	// Open loop: Poisson arrivals at rate, whatever the answers.
	for next := time.Duration(0); next < total; next += time.Duration(rng.ExpFloat64() / rate * float64(time.Second)) {
		time.Sleep(time.Until(start.Add(next)))
		class := pick(rng.Float64())
		at := time.Since(start)
		wg.Go(func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
			req.Header.Set("X-Priority", Classes[class])
			t0 := time.Now()
			resp, err := hc.Do(req)
			r := result{class: class, at: at, latency: time.Since(t0)}
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				r.status = resp.StatusCode
			}
			mu.Lock()
			results = append(results, r)
			mu.Unlock()
		})
	}
	wg.Wait()
	return summarize(o, cfg, load, results), nil
}

// pick is the class of a uniform draw u, by the shares.
func pick(u float64) int {
	for i, s := range shares {
		if u < s {
			return i
		}
		u -= s
	}
	return len(shares) - 1
}

func summarize(o Options, cfg string, load float64, results []result) []Row {
	rows := make([]Row, len(Classes))
	lat := make([][]time.Duration, len(Classes))
	for i, c := range Classes {
		rows[i] = Row{Config: cfg, Load: load, Class: c}
	}
	secs := o.Duration.Seconds()
	for _, r := range results {
		if r.at < o.Warmup {
			continue
		}
		row := &rows[r.class]
		row.Offered++
		switch r.status {
		case http.StatusOK:
			row.Goodput++
			lat[r.class] = append(lat[r.class], r.latency)
		case http.StatusTooManyRequests, http.StatusServiceUnavailable:
			row.Shed++
		default:
			row.Errors++
		}
	}
	for i := range rows {
		rows[i].Offered /= secs
		rows[i].Goodput /= secs
		rows[i].P99 = percentile(lat[i], 0.99)
	}
	return rows
}

func percentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	return ds[min(len(ds)-1, int(math.Ceil(q*float64(len(ds))))-1)]
}

// Find is the row of cfg, load and class.
func (rep *Report) Find(cfg string, load float64, class string) (Row, error) {
	for _, r := range rep.Rows {
		if r.Config == cfg && r.Load == load && r.Class == class {
			return r, nil
		}
	}
	return Row{}, errors.New("no row " + cfg + " " + class)
}
