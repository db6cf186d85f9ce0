// Package systems starts the systems the comparison measures (limiterd,
// envoy ratelimit, Gubernator) and their Redis servers fresh on free
// loopback ports, pins them to CPUs with taskset, reads their CPU time
// from /proc and Redis's INFO commandstats, and stops them by pid.
package systems

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// Server is the server a system runs.
type Server int

// The servers.
const (
	Limiterd Server = iota
	EnvoyRatelimit
	Gubernator
)

// Store is where a system keeps its counters.
type Store int

const (
	// InMemory is the server's own memory: no Redis.
	InMemory Store = iota
	// Cluster3 is a 3-primary Redis Cluster.
	Cluster3
	// Cluster1 is a Redis Cluster of one primary holding every slot.
	Cluster1
	// Standalone is one Redis server, not a cluster.
	Standalone
)

// Env is what the starts of every system share.
type Env struct {
	// Root is the module root, of scripts/redis-cluster.sh.
	Root string
	// Config is the folder of limiterd-rules.yml and envoy-ratelimit.yaml.
	Config string
	// The binaries of the servers.
	Limiterd, EnvoyRatelimit, Gubernator string
	// Logf reports what goes wrong in a stop; nil: standard error.
	Logf  func(format string, args ...any)
	ports ports
}

// redisNode is one Redis server of a system, measured by its pid and its
// INFO commandstats.
type redisNode struct {
	addr string
	pid  int
	c    *redis.Client
}

// System is the servers of one row, started fresh for each round.
type System struct {
	// GRPC is the address ghz calls; Conn a Go client's connection to it,
	// for the checks of the answers.
	GRPC string
	Conn *grpc.ClientConn
	// Metrics is limiterd's /metrics URL; "" for the peers.
	Metrics string
	// server is the pid of the server measured.
	server int
	redis  []*redisNode
	// stops undo the starts, run last first.
	stops []func()
}

func (s *System) onStop(f func()) { s.stops = append(s.stops, f) }

// Stop stops every process of the system by pid, the server before its
// Redis servers.
func (s *System) Stop() {
	for i := len(s.stops) - 1; i >= 0; i-- {
		s.stops[i]()
	}
	s.stops = nil
}

// HasRedis reports whether the system has Redis servers.
func (s *System) HasRedis() bool { return len(s.redis) > 0 }

// CPUTicks is the user + system CPU time of the server and, summed, of its
// Redis servers, in clock ticks (TicksPerSecond).
func (s *System) CPUTicks() (server, redis uint64, err error) {
	if server, err = cpuTicks(s.server); err != nil {
		return 0, 0, err
	}
	for _, n := range s.redis {
		t, err := cpuTicks(n.pid)
		if err != nil {
			return 0, 0, fmt.Errorf("redis %s: %w", n.addr, err)
		}
		redis += t
	}
	return server, redis, nil
}

// ResetStats resets the statistics of every Redis server (CONFIG
// RESETSTAT).
func (s *System) ResetStats(ctx context.Context) error {
	for _, n := range s.redis {
		if err := n.c.ConfigResetStat(ctx).Err(); err != nil {
			return fmt.Errorf("redis %s config resetstat: %w", n.addr, err)
		}
	}
	return nil
}

// CommandStats is the INFO commandstats of each Redis server.
func (s *System) CommandStats(ctx context.Context) ([]string, error) {
	var out []string
	for _, n := range s.redis {
		info, err := n.c.Info(ctx, "commandstats").Result()
		if err != nil {
			return nil, fmt.Errorf("redis %s info commandstats: %w", n.addr, err)
		}
		out = append(out, info)
	}
	return out, nil
}

// Pin moves every thread of the server and Redis processes onto the CPU
// list cpus (taskset -a -p).
func (s *System) Pin(ctx context.Context, cpus string) error {
	pids := []int{s.server}
	for _, n := range s.redis {
		pids = append(pids, n.pid)
	}
	for _, pid := range pids {
		if out, err := exec.CommandContext(ctx, "taskset", "-a", "-p", "-c", cpus, strconv.Itoa(pid)).CombinedOutput(); err != nil {
			return fmt.Errorf("taskset %d: %w\n%s", pid, err, out)
		}
	}
	return nil
}

// startTimeout bounds the start of one server, Redis Cluster included.
const startTimeout = 30 * time.Second

// logf is Logf, or standard error without it.
func (e *Env) logf(format string, args ...any) {
	if e.Logf == nil {
		fmt.Fprintf(os.Stderr, format+"\n", args...)
		return
	}
	e.Logf(format, args...)
}

// Start starts server on store in dir (a fresh folder) and waits until
// ready, a check of the server's answers on a connection to it, passes.
// On error, what was started is stopped.
func (e *Env) Start(ctx context.Context, server Server, store Store, dir string, ready func(context.Context, *grpc.ClientConn) error) (sys *System, err error) {
	sys = &System{}
	defer func() {
		if err != nil {
			sys.Stop()
			sys = nil
		}
	}()
	var redisAddrs []string
	switch store {
	case Cluster3:
		if err := e.startCluster3(ctx, sys, filepath.Join(dir, "redis")); err != nil {
			return nil, err
		}
	case Cluster1, Standalone:
		if err := e.startRedis(ctx, sys, filepath.Join(dir, "redis"), store == Cluster1); err != nil {
			return nil, err
		}
	}
	for _, n := range sys.redis {
		redisAddrs = append(redisAddrs, n.addr)
	}
	var p *proc
	switch server {
	case Limiterd:
		p, err = e.startLimiterd(ctx, sys, dir, redisAddrs)
	case EnvoyRatelimit:
		p, err = e.startEnvoyRatelimit(sys, dir, redisAddrs[0])
	case Gubernator:
		p, err = e.startGubernator(sys, dir)
	}
	if err != nil {
		return nil, err
	}
	sys.server = p.pid()
	conn, err := grpc.NewClient(sys.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	sys.onStop(func() { conn.Close() })
	sys.Conn = conn
	// Ready when a check of the server's answers passes.
	err = waitReady(ctx, startTimeout, func(ctx context.Context) error {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		return ready(cctx, conn)
	}, p)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", p.name, err)
	}
	return sys, nil
}

// redisArgs are the settings of every Redis server, those of
// scripts/redis-cluster.sh.
func redisArgs(dir string, port int) []string {
	return []string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--daemonize", "no", "--maxmemory", "512mb", "--maxmemory-policy", "noeviction"}
}

// startCluster3 starts a 3-primary Redis Cluster with
// scripts/redis-cluster.sh, which records the nodes' pids in dir.
func (e *Env) startCluster3(ctx context.Context, sys *System, dir string) error {
	script := filepath.Join(e.Root, "scripts", "redis-cluster.sh")
	args := []string{"start", dir}
	for range 3 {
		port, err := e.ports.get(true, false)
		if err != nil {
			return err
		}
		args = append(args, strconv.Itoa(port))
	}
	// Registered first: a start that fails halfway leaves nodes whose
	// pids the stop finds in dir.
	sys.onStop(func() {
		if out, err := exec.Command(script, "stop", dir).CombinedOutput(); err != nil {
			e.logf("redis-cluster.sh stop %s: %v\n%s", dir, err, out)
		}
	})
	cctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	cmd := exec.CommandContext(cctx, script, args...)
	cmd.Dir = e.Root
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("redis-cluster.sh start: %w\n%s", err, out)
	}
	for _, port := range args[2:] {
		b, err := os.ReadFile(filepath.Join(dir, port, "redis.pid"))
		if err != nil {
			return fmt.Errorf("redis node %s: %w", port, err)
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil {
			return fmt.Errorf("redis node %s pid: %w", port, err)
		}
		n, _ := strconv.Atoi(port)
		e.addRedis(sys, addr(n), pid)
	}
	return nil
}

// startRedis starts one Redis server: with cluster, a Redis Cluster of one
// primary holding every slot (redis-cli --cluster create wants three).
func (e *Env) startRedis(ctx context.Context, sys *System, dir string, cluster bool) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	port, err := e.ports.get(cluster, false)
	if err != nil {
		return err
	}
	args := redisArgs(dir, port)
	if cluster {
		args = append(args, "--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(dir, "nodes.conf"), "--cluster-node-timeout", "2000")
	}
	p, err := startProc("redis-server", filepath.Join(dir, "redis.log"), nil, "redis-server", args...)
	if err != nil {
		return err
	}
	sys.onStop(p.stop)
	n := e.addRedis(sys, addr(port), p.pid())
	if err := waitReady(ctx, startTimeout, func(ctx context.Context) error { return n.c.Ping(ctx).Err() }, p); err != nil {
		return fmt.Errorf("redis-server: %w", err)
	}
	if !cluster {
		return nil
	}
	if err := n.c.Do(ctx, "cluster", "addslotsrange", 0, 16383).Err(); err != nil {
		return fmt.Errorf("cluster addslotsrange: %w", err)
	}
	return waitReady(ctx, startTimeout, func(ctx context.Context) error {
		info, err := n.c.ClusterInfo(ctx).Result()
		if err != nil {
			return err
		}
		if !strings.Contains(info, "cluster_state:ok") {
			return errors.New("cluster_state not ok")
		}
		return nil
	}, p)
}

func (e *Env) addRedis(sys *System, a string, pid int) *redisNode {
	n := &redisNode{addr: a, pid: pid, c: redis.NewClient(&redis.Options{Addr: a, PoolSize: 1, MaxRetries: -1})}
	sys.onStop(func() { n.c.Close() })
	sys.redis = append(sys.redis, n)
	return n
}

// startLimiterd starts limiterd on the Redis servers at redisAddrs, or on
// its embedded in-memory store when there are none. --redis.timeout 100ms:
// no answer comes from the fallback on a busy machine.
func (e *Env) startLimiterd(ctx context.Context, sys *System, dir string, redisAddrs []string) (*proc, error) {
	grpcPort, err := e.ports.get(false, false)
	if err != nil {
		return nil, err
	}
	httpPort, err := e.ports.get(false, false)
	if err != nil {
		return nil, err
	}
	args := []string{"--rules.file", filepath.Join(e.Config, "limiterd-rules.yml"),
		"--grpc.listen-address", addr(grpcPort), "--http.listen-address", addr(httpPort),
		"--redis.timeout", "100ms", "--log.level", "warn"}
	if len(redisAddrs) > 0 {
		args = append(args, "--redis.addrs", strings.Join(redisAddrs, ","))
	}
	p, err := startProc("limiterd", filepath.Join(dir, "limiterd.log"), nil, e.Limiterd, args...)
	if err != nil {
		return nil, err
	}
	sys.onStop(p.stop)
	sys.GRPC = addr(grpcPort)
	sys.Metrics = "http://" + addr(httpPort) + "/metrics"
	ready := "http://" + addr(httpPort) + "/readyz"
	err = waitReady(ctx, startTimeout, func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, ready, nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("/readyz: %s", resp.Status)
		}
		return nil
	}, p)
	if err != nil {
		return nil, fmt.Errorf("limiterd: %w", err)
	}
	return p, nil
}

// startEnvoyRatelimit starts envoy ratelimit on the standalone Redis at
// redisAddr, its config envoy-ratelimit.yaml under its runtime root.
func (e *Env) startEnvoyRatelimit(sys *System, dir, redisAddr string) (*proc, error) {
	root := filepath.Join(dir, "runtime")
	conf := filepath.Join(root, "ratelimit", "config")
	if err := os.MkdirAll(conf, 0o755); err != nil {
		return nil, err
	}
	b, err := os.ReadFile(filepath.Join(e.Config, "envoy-ratelimit.yaml"))
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(conf, "compare.yaml"), b, 0o644); err != nil {
		return nil, err
	}
	var p [3]int
	for i := range p {
		if p[i], err = e.ports.get(false, false); err != nil {
			return nil, err
		}
	}
	envs := []string{
		// Without them it sends statsd and writes a JSON line per request.
		"USE_STATSD=false", "DISABLE_STATS=true", "LOG_LEVEL=warn",
		"REDIS_SOCKET_TYPE=tcp", "REDIS_TYPE=single", "REDIS_URL=" + redisAddr,
		"RUNTIME_ROOT=" + root, "RUNTIME_SUBDIRECTORY=ratelimit", "RUNTIME_APPDIRECTORY=config", "RUNTIME_WATCH_ROOT=false",
		"HOST=127.0.0.1", "PORT=" + strconv.Itoa(p[0]),
		"GRPC_HOST=127.0.0.1", "GRPC_PORT=" + strconv.Itoa(p[1]),
		"DEBUG_HOST=127.0.0.1", "DEBUG_PORT=" + strconv.Itoa(p[2]),
	}
	proc, err := startProc("envoy ratelimit", filepath.Join(dir, "ratelimit.log"), envs, e.EnvoyRatelimit)
	if err != nil {
		return nil, err
	}
	sys.onStop(proc.stop)
	sys.GRPC = addr(p[1])
	return proc, nil
}

// startGubernator starts one Gubernator, its member list of itself alone
// (so that it owns every key), no tracing.
func (e *Env) startGubernator(sys *System, dir string) (*proc, error) {
	grpcPort, err := e.ports.get(false, false)
	if err != nil {
		return nil, err
	}
	httpPort, err := e.ports.get(false, false)
	if err != nil {
		return nil, err
	}
	mlPort, err := e.ports.get(false, true)
	if err != nil {
		return nil, err
	}
	envs := []string{
		"GUBER_GRPC_ADDRESS=" + addr(grpcPort), "GUBER_HTTP_ADDRESS=" + addr(httpPort),
		"GUBER_ADVERTISE_ADDRESS=" + addr(grpcPort),
		"GUBER_PEER_DISCOVERY_TYPE=member-list",
		"GUBER_MEMBERLIST_ADDRESS=" + addr(mlPort), "GUBER_MEMBERLIST_BIND_ADDRESS=" + addr(mlPort),
		"GUBER_MEMBERLIST_KNOWN_NODES=" + addr(mlPort),
		"GUBER_LOG_LEVEL=warn", "OTEL_TRACES_EXPORTER=none",
	}
	p, err := startProc("gubernator", filepath.Join(dir, "gubernator.log"), envs, e.Gubernator)
	if err != nil {
		return nil, err
	}
	sys.onStop(p.stop)
	sys.GRPC = addr(grpcPort)
	return p, nil
}
