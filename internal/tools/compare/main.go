// Command compare measures limiterd next to envoy ratelimit and Gubernator
// on this machine, with one load tool for every system (ghz, never a
// system's own client): req/s and p99 at 1, 16 and 64 concurrent callers
// on one connection, a new key on every request, and what each call costs
// in CPU, of the server and of each Redis server it uses (utime + stime of
// /proc/PID/stat around each run), with Redis's own time per command (INFO
// commandstats). `make compare` runs it from the module root:
//
//	go run ./internal/tools/compare                      # 3 rounds of 5 s runs
//	go run ./internal/tools/compare --rounds 1 --duration 2s --rows 1,3
//	go run ./internal/tools/compare --limiterd /tmp/old/limiterd   # an older build, measured the same way
//
// The rows: limiterd on a 3-primary and a 1-primary Redis Cluster and
// envoy ratelimit on one Redis, through Envoy RLS v3; limiterd on each
// store and in memory through limiter.v1 Check; Gubernator v2 in memory;
// the gRPC health check of limiterd (the transport's ceiling). Every
// system has the same limit per key (load/config/), far above what a key is
// sent, and a run counts only when every answer was OK and came from the
// store: ghz's status codes all OK, limiterd's decisions all allowed by
// the store (its /metrics), a few answers read with a Go client after
// each run.
//
// ghz, envoy ratelimit and Gubernator are installed at pinned versions
// into bin/ (install/) when missing; redis-server and redis-cli come from
// the machine, and Gubernator's .proto is compiled in process. Each system
// starts fresh, on free loopback ports, for each row of each round, and
// rounds interleave the rows; the report is the medians over rounds. Everything started is stopped by pid when
// the tool ends, on error or Ctrl-C too.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"

	"github.com/limiterd/limiterd/internal/tools/compare/install"
	"github.com/limiterd/limiterd/internal/tools/compare/load"
	"github.com/limiterd/limiterd/internal/tools/compare/report"
	"github.com/limiterd/limiterd/internal/tools/compare/systems"
)

func main() { os.Exit(run(os.Args[1:])) }

// options are the flags.
type options struct {
	limiterd    string
	bin         string
	rounds      int
	duration    time.Duration
	warmup      time.Duration
	concurrency []int
	rows        []int
	// pin runs ghz on the first CPU and every server of a row on the
	// others (taskset), so that the load tool's CPU is not the servers'.
	pin bool
}

// Defaults of the flags.
const (
	DefaultRounds   = 3
	DefaultDuration = 5 * time.Second
	DefaultWarmup   = time.Second
)

var (
	DefaultConcurrency = []int{1, 16, 64}
	allRows            = []int{1, 2, 3, 4, 5, 6, 7, 8}
)

func run(args []string) int {
	fs := flag.NewFlagSet("compare", flag.ContinueOnError)
	o := options{concurrency: DefaultConcurrency, rows: allRows}
	fs.StringVar(&o.limiterd, "limiterd", "", "limiterd binary to measure (default: ./cmd/limiterd of this tree, built into --bin)")
	fs.StringVar(&o.bin, "bin", "bin", "folder of the pinned tools (installed there when missing) and of the limiterd built, relative to the module root")
	fs.BoolVar(&o.pin, "pin", false, "run ghz on CPU 0 and the servers of each row (and their Redis) on the other CPUs, with taskset, so the load tool does not take the servers' CPU")
	fs.IntVar(&o.rounds, "rounds", DefaultRounds, "rounds; each runs every row once, the table gives medians over rounds")
	fs.DurationVar(&o.duration, "duration", DefaultDuration, "length of each ghz run")
	fs.DurationVar(&o.warmup, "warmup", DefaultWarmup, "length of an unmeasured ghz run at the highest concurrency after each start (0: none)")
	fs.Func("concurrency", "comma-separated concurrent callers of the runs of each row, one connection (default 1,16,64)", func(s string) error {
		v, err := intList(s, 1, 10000)
		o.concurrency = v
		return err
	})
	fs.Func("rows", "comma-separated rows to run, 1-8 (default all)", func(s string) error {
		v, err := intList(s, 1, len(rows))
		o.rows = v
		return err
	})
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 || o.rounds < 1 || o.duration <= 0 || o.warmup < 0 {
		fmt.Fprintln(os.Stderr, "compare: want no arguments, --rounds >= 1, --duration > 0, --warmup >= 0")
		return 2
	}
	slices.Sort(o.concurrency)
	o.concurrency = slices.Compact(o.concurrency)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := compare(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "compare:", err)
		if ctx.Err() != nil {
			return 130
		}
		return 1
	}
	return 0
}

// intList parses "1,16,64", each in [lo, hi].
func intList(s string, lo, hi int) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			return nil, err
		}
		if n < lo || n > hi {
			return nil, fmt.Errorf("%d not in %d-%d", n, lo, hi)
		}
		out = append(out, n)
	}
	return out, nil
}

// row is one line of the table: a server on a store, driven through an API.
type row struct {
	n      int
	system string
	api    load.API
	server systems.Server
	store  systems.Store
}

// rows are the table's rows, numbered as docs/performance.md numbers them.
var rows = []row{
	{1, "limiterd, 3-primary Redis Cluster", load.RLS, systems.Limiterd, systems.Cluster3},
	{2, "limiterd, 1-primary Redis Cluster", load.RLS, systems.Limiterd, systems.Cluster1},
	{3, "envoy ratelimit, 1 standalone Redis", load.RLS, systems.EnvoyRatelimit, systems.Standalone},
	{4, "limiterd, 3-primary Redis Cluster", load.Check, systems.Limiterd, systems.Cluster3},
	{5, "limiterd, 1-primary Redis Cluster", load.Check, systems.Limiterd, systems.Cluster1},
	{6, "limiterd, in memory", load.Check, systems.Limiterd, systems.InMemory},
	{7, "Gubernator v2, in memory", load.Gubernator, systems.Gubernator, systems.InMemory},
	{8, "limiterd, 1-primary Redis Cluster", load.Health, systems.Limiterd, systems.Cluster1},
}

// env is what the runs share.
type env struct {
	// starts starts the systems; runs drives them with ghz.
	starts *systems.Env
	runs   *load.Runner
	// servers is the CPU list of the servers with --pin (see
	// options.pin); "" without.
	servers string
}

func progress(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "compare: "+format+"\n", args...)
}

func compare(ctx context.Context, o options) error {
	wd, err := os.Getwd()
	if err != nil {
		return err
	}
	e := &env{starts: &systems.Env{Logf: progress}}
	root, err := moduleRoot(wd)
	if err != nil {
		return err
	}
	e.starts.Root = root
	if o.pin {
		n := runtime.NumCPU()
		if n < 2 {
			return fmt.Errorf("--pin: %d CPU; it needs 2 or more", n)
		}
		if err := install.Need("taskset"); err != nil {
			return err
		}
		e.servers = "1"
		if n > 2 {
			e.servers = fmt.Sprintf("1-%d", n-1)
		}
	}
	var selected []row
	for _, r := range rows {
		if slices.Contains(o.rows, r.n) {
			selected = append(selected, r)
		}
	}
	has := func(f func(row) bool) bool { return slices.ContainsFunc(selected, f) }
	withRedis := has(func(r row) bool { return r.store != systems.InMemory })
	withGub := has(func(r row) bool { return r.server == systems.Gubernator })
	var progs []string
	if withRedis {
		progs = append(progs, "redis-server", "redis-cli")
	}
	if err := install.Need(progs...); err != nil {
		return err
	}
	goBin := cmp.Or(os.Getenv("GO"), "go")
	bin := o.bin
	if !filepath.IsAbs(bin) {
		bin = filepath.Join(root, bin)
	}
	ghzBin, err := install.Ghz.Install(ctx, goBin, bin, progress)
	if err != nil {
		return err
	}
	if has(func(r row) bool { return r.server == systems.EnvoyRatelimit }) {
		if e.starts.EnvoyRatelimit, err = install.EnvoyRatelimit.Install(ctx, goBin, bin, progress); err != nil {
			return err
		}
	}
	if withGub {
		if e.starts.Gubernator, err = install.Gubernator.Install(ctx, goBin, bin, progress); err != nil {
			return err
		}
	}
	limiterdDesc := o.limiterd
	if has(func(r row) bool { return r.server == systems.Limiterd }) {
		if o.limiterd == "" {
			if e.starts.Limiterd, err = install.BuildLimiterd(ctx, goBin, root, bin); err != nil {
				return err
			}
			limiterdDesc = "./cmd/limiterd at " + cmp.Or(install.Revision(ctx, root), "this tree")
		} else {
			if e.starts.Limiterd, err = filepath.Abs(o.limiterd); err != nil {
				return err
			}
			if _, err := os.Stat(e.starts.Limiterd); err != nil {
				return fmt.Errorf("--limiterd: %w", err)
			}
		}
	}

	work, err := os.MkdirTemp("", "limiterd-compare-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	e.starts.Config = filepath.Join(work, "config")
	if err := os.Mkdir(e.starts.Config, 0o755); err != nil {
		return err
	}
	if e.runs, err = load.New(ctx, ghzBin, e.starts.Config, filepath.Join(work, "compare.protoset"), withGub, o.pin); err != nil {
		return err
	}

	runs := len(selected) * o.rounds
	progress("%d rows × %d rounds, %s per run at c=%v, limiterd %s", len(selected), o.rounds, o.duration, o.concurrency, cmp.Or(limiterdDesc, "(not run)"))
	res := make(report.Results)
	start := time.Now()
	for round := range o.rounds {
		for i, r := range selected {
			progress("round %d/%d, row %d (%s, %s) [%d/%d]", round+1, o.rounds, r.n, r.system, r.api.Name(), round*len(selected)+i+1, runs)
			dir := filepath.Join(work, fmt.Sprintf("r%d-row%d", round+1, r.n))
			samples, err := e.runRow(ctx, r, dir, o)
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if err != nil {
				progress("row %d: %v", r.n, err)
				samples = make(map[int]load.Sample)
				for _, c := range o.concurrency {
					samples[c] = load.Sample{Failed: err.Error()}
				}
			}
			res.Add(r.n, round, samples)
			os.RemoveAll(dir)
		}
	}
	h := report.Header{
		Limiterd: cmp.Or(limiterdDesc, "not run"),
		Ghz:      install.Ghz.Version(), EnvoyRatelimit: install.EnvoyRatelimit.Version(), Gubernator: install.Gubernator.Version(),
		Rounds: o.rounds, Duration: o.duration, Concurrency: o.concurrency,
		Took: time.Since(start).Round(time.Second), Cores: runtime.NumCPU(), Pinned: e.servers,
	}
	report.Write(os.Stdout, h, reportRows(selected), res)
	return nil
}

// reportRows are the lines of rs in the report.
func reportRows(rs []row) []report.Row {
	var out []report.Row
	for _, r := range rs {
		out = append(out, report.Row{N: r.n, System: r.system, API: r.api.Name(), Redis: r.store != systems.InMemory})
	}
	return out
}

// runRow starts r's systems fresh in dir, runs ghz once at each
// concurrency, and stops them.
func (e *env) runRow(ctx context.Context, r row, dir string, o options) (map[int]load.Sample, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	// Ready when a check of the row's API is answered as it must be.
	ready := func(ctx context.Context, conn *grpc.ClientConn) error { return e.runs.Verify(ctx, r.api, conn, 1) }
	sys, err := e.starts.Start(ctx, r.server, r.store, dir, ready)
	if err != nil {
		return nil, err
	}
	defer sys.Stop()
	if e.servers != "" {
		// The load tool keeps CPU 0 to itself.
		if err := sys.Pin(ctx, e.servers); err != nil {
			return nil, err
		}
	}
	hi := o.concurrency[len(o.concurrency)-1]
	if o.warmup > 0 {
		if err := e.runs.Warmup(ctx, r.api, sys, dir, hi, o.warmup); err != nil {
			return nil, err
		}
	}
	out := make(map[int]load.Sample)
	for _, c := range o.concurrency {
		s, err := e.runs.Measure(ctx, r.api, sys, dir, c, o.duration)
		if err != nil {
			return nil, fmt.Errorf("c=%d: %w", c, err)
		}
		out[c] = s
		if s.Failed != "" {
			progress("  c=%-3d FAILED: %s", c, s.Failed)
			continue
		}
		redis := ""
		if !math.IsNaN(s.RedisUs) {
			redis = fmt.Sprintf("  Redis %6.1f µs/call", s.RedisUs)
		}
		progress("  c=%-3d %8.0f req/s  p99 %6.2f ms  server %6.1f µs/call%s  ghz %6.1f µs/call", c, s.RPS, float64(s.P99)/1e6, s.ServerUs, redis, s.ClientUs)
	}
	return out, nil
}

// moduleRoot is the folder above dir (or dir) holding this module's go.mod
// and scripts/redis-cluster.sh.
func moduleRoot(dir string) (string, error) {
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "scripts", "redis-cluster.sh")); err == nil {
			if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
				return d, nil
			}
		}
		if filepath.Dir(d) == d {
			return "", fmt.Errorf("no module root with scripts/redis-cluster.sh above %s: %w", dir, fs.ErrNotExist)
		}
	}
}
