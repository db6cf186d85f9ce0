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
// system has the same limit per key (config/), far above what a key is
// sent, and a run counts only when every answer was OK and came from the
// store: ghz's status codes all OK, limiterd's decisions all allowed by
// the store (its /metrics), a few answers read with a Go client after
// each run.
//
// ghz, envoy ratelimit and Gubernator are installed at pinned versions
// into bin/ (tools.go) when missing; redis-server and redis-cli come from
// the machine, and Gubernator's .proto is compiled in process. Each system starts fresh, on free loopback ports,
// for each row of each round, and rounds interleave the rows; the report
// is the medians over rounds. Everything started is stopped by pid when
// the tool ends, on error or Ctrl-C too.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
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

// env is what the runs share.
type env struct {
	root   string // the module root
	config string // the config files, written from configFS
	// The binaries.
	limiterd, ghzBin, envoyRatelimit, gubernator string
	protoset                                     string
	// gub holds the descriptors of gubernator's API, for the checks of
	// its answers; nil without row 7.
	gub   *protoregistry.Files
	ports ports
	// pin: see options.pin; servers is the CPU list of the servers.
	pin     bool
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
	e := &env{pin: o.pin}
	if e.root, err = moduleRoot(wd); err != nil {
		return err
	}
	if e.pin {
		n := runtime.NumCPU()
		if n < 2 {
			return fmt.Errorf("--pin: %d CPU; it needs 2 or more", n)
		}
		if err := need("taskset"); err != nil {
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
	withRedis := has(func(r row) bool { return r.store != storeNone })
	withGub := has(func(r row) bool { return r.server == serverGubernator })
	var progs []string
	if withRedis {
		progs = append(progs, "redis-server", "redis-cli")
	}
	if err := need(progs...); err != nil {
		return err
	}
	goBin := cmp.Or(os.Getenv("GO"), "go")
	bin := o.bin
	if !filepath.IsAbs(bin) {
		bin = filepath.Join(e.root, bin)
	}
	if e.ghzBin, err = ghzTool.install(ctx, goBin, bin); err != nil {
		return err
	}
	if has(func(r row) bool { return r.server == serverEnvoyRatelimit }) {
		if e.envoyRatelimit, err = envoyRatelimit.install(ctx, goBin, bin); err != nil {
			return err
		}
	}
	if withGub {
		if e.gubernator, err = gubernator.install(ctx, goBin, bin); err != nil {
			return err
		}
	}
	limiterdDesc := o.limiterd
	if has(func(r row) bool { return r.server == serverLimiterd }) {
		if o.limiterd == "" {
			if e.limiterd, err = buildLimiterd(ctx, goBin, e.root, bin); err != nil {
				return err
			}
			limiterdDesc = "./cmd/limiterd at " + cmp.Or(treeRevision(ctx, e.root), "this tree")
		} else {
			if e.limiterd, err = filepath.Abs(o.limiterd); err != nil {
				return err
			}
			if _, err := os.Stat(e.limiterd); err != nil {
				return fmt.Errorf("--limiterd: %w", err)
			}
		}
	}

	work, err := os.MkdirTemp("", "limiterd-compare-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	e.config = filepath.Join(work, "config")
	if err := os.Mkdir(e.config, 0o755); err != nil {
		return err
	}
	if err := writeConfig(e.config); err != nil {
		return err
	}
	var gubSet *descriptorpb.FileDescriptorSet
	if withGub {
		if gubSet, e.gub, err = compileGubernator(ctx, e.config); err != nil {
			return err
		}
	}
	set, err := protoset(gubSet)
	if err != nil {
		return err
	}
	b, err := proto.Marshal(set)
	if err != nil {
		return err
	}
	e.protoset = filepath.Join(work, "compare.protoset")
	if err := os.WriteFile(e.protoset, b, 0o644); err != nil {
		return err
	}

	runs := len(selected) * o.rounds
	progress("%d rows × %d rounds, %s per run at c=%v, limiterd %s", len(selected), o.rounds, o.duration, o.concurrency, cmp.Or(limiterdDesc, "(not run)"))
	res := make(results)
	start := time.Now()
	for round := range o.rounds {
		for i, r := range selected {
			progress("round %d/%d, row %d (%s, %s) [%d/%d]", round+1, o.rounds, r.n, r.system, r.api.name, round*len(selected)+i+1, runs)
			dir := filepath.Join(work, fmt.Sprintf("r%d-row%d", round+1, r.n))
			samples, err := e.runRow(ctx, r, dir, o)
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if err != nil {
				progress("row %d: %v", r.n, err)
				samples = make(map[int]sample)
				for _, c := range o.concurrency {
					samples[c] = sample{failed: err.Error()}
				}
			}
			res.add(r.n, round, samples)
			os.RemoveAll(dir)
		}
	}
	h := header{
		limiterd: cmp.Or(limiterdDesc, "not run"), rounds: o.rounds, duration: o.duration, concurrency: o.concurrency,
		took: time.Since(start).Round(time.Second), cores: runtime.NumCPU(), pinned: e.servers,
	}
	report(os.Stdout, h, selected, res)
	return nil
}

// runRow starts r's systems fresh in dir, runs ghz once at each
// concurrency, and stops them.
func (e *env) runRow(ctx context.Context, r row, dir string, o options) (map[int]sample, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	sys, err := e.start(ctx, r, dir)
	if err != nil {
		return nil, err
	}
	defer sys.stop()
	if e.pin {
		if err := e.pinServers(ctx, sys); err != nil {
			return nil, err
		}
	}
	hi := o.concurrency[len(o.concurrency)-1]
	if o.warmup > 0 {
		rep, err := e.ghz(ctx, r, sys, dir, "warmup", hi, o.warmup)
		if err != nil {
			return nil, err
		}
		if msg := rep.notOK(); msg != "" {
			return nil, fmt.Errorf("warm-up: %s", msg)
		}
	}
	out := make(map[int]sample)
	for _, c := range o.concurrency {
		s, err := e.measure(ctx, r, sys, dir, c, o.duration)
		if err != nil {
			return nil, fmt.Errorf("c=%d: %w", c, err)
		}
		out[c] = s
		if s.failed != "" {
			progress("  c=%-3d FAILED: %s", c, s.failed)
			continue
		}
		redis := ""
		if !math.IsNaN(s.redisUs) {
			redis = fmt.Sprintf("  Redis %6.1f µs/call", s.redisUs)
		}
		progress("  c=%-3d %8.0f req/s  p99 %6.2f ms  server %6.1f µs/call%s  ghz %6.1f µs/call", c, s.rps, float64(s.p99)/1e6, s.serverUs, redis, s.clientUs)
	}
	return out, nil
}

// pinServers moves every thread of sys's server and Redis processes onto
// e.servers (taskset -a -p): the load tool keeps CPU 0 to itself.
func (e *env) pinServers(ctx context.Context, sys *system) error {
	pids := []int{sys.server}
	for _, n := range sys.redis {
		pids = append(pids, n.pid)
	}
	for _, pid := range pids {
		if out, err := exec.CommandContext(ctx, "taskset", "-a", "-p", "-c", e.servers, strconv.Itoa(pid)).CombinedOutput(); err != nil {
			return fmt.Errorf("taskset %d: %w\n%s", pid, err, out)
		}
	}
	return nil
}
