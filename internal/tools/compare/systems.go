package main

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

// redisNode is one Redis server of a system, measured by its pid and its
// INFO commandstats.
type redisNode struct {
	addr string
	pid  int
	c    *redis.Client
}

// system is the servers of one row, started fresh for each round.
type system struct {
	// grpc is the address ghz calls; conn a Go client's connection to it,
	// for the checks of the answers.
	grpc string
	conn *grpc.ClientConn
	// server is the pid of the server measured.
	server int
	// metrics is limiterd's /metrics URL; "" for the peers.
	metrics string
	redis   []*redisNode
	// stops undo the starts, run last first.
	stops []func()
}

func (s *system) onStop(f func()) { s.stops = append(s.stops, f) }

// stop stops every process of the system by pid, the server before its
// Redis servers.
func (s *system) stop() {
	for i := len(s.stops) - 1; i >= 0; i-- {
		s.stops[i]()
	}
	s.stops = nil
}

// startTimeout bounds the start of one server, Redis Cluster included.
const startTimeout = 30 * time.Second

// start starts the servers of r in dir (a fresh folder) and waits until
// they answer a check correctly. On error, what was started is stopped.
func (e *env) start(ctx context.Context, r row, dir string) (sys *system, err error) {
	sys = &system{}
	defer func() {
		if err != nil {
			sys.stop()
			sys = nil
		}
	}()
	var redisAddrs []string
	switch r.store {
	case storeCluster3:
		if err := e.startCluster3(ctx, sys, filepath.Join(dir, "redis")); err != nil {
			return nil, err
		}
	case storeCluster1, storeStandalone:
		if err := e.startRedis(ctx, sys, filepath.Join(dir, "redis"), r.store == storeCluster1); err != nil {
			return nil, err
		}
	}
	for _, n := range sys.redis {
		redisAddrs = append(redisAddrs, n.addr)
	}
	var p *proc
	switch r.server {
	case serverLimiterd:
		p, err = e.startLimiterd(ctx, sys, dir, redisAddrs)
	case serverEnvoyRatelimit:
		p, err = e.startEnvoyRatelimit(sys, dir, redisAddrs[0])
	case serverGubernator:
		p, err = e.startGubernator(sys, dir)
	}
	if err != nil {
		return nil, err
	}
	sys.server = p.pid()
	conn, err := grpc.NewClient(sys.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	sys.onStop(func() { conn.Close() })
	sys.conn = conn
	// Ready when a check of the row's API is answered as it must be.
	err = waitReady(ctx, startTimeout, func(ctx context.Context) error {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		return e.verify(cctx, r.api, conn, 1)
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
func (e *env) startCluster3(ctx context.Context, sys *system, dir string) error {
	script := filepath.Join(e.root, "scripts", "redis-cluster.sh")
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
			progress("redis-cluster.sh stop %s: %v\n%s", dir, err, out)
		}
	})
	cctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	cmd := exec.CommandContext(cctx, script, args...)
	cmd.Dir = e.root
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
func (e *env) startRedis(ctx context.Context, sys *system, dir string, cluster bool) error {
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

func (e *env) addRedis(sys *system, a string, pid int) *redisNode {
	n := &redisNode{addr: a, pid: pid, c: redis.NewClient(&redis.Options{Addr: a, PoolSize: 1, MaxRetries: -1})}
	sys.onStop(func() { n.c.Close() })
	sys.redis = append(sys.redis, n)
	return n
}

// startLimiterd starts limiterd on the Redis servers at redisAddrs, or on
// its embedded in-memory store when there are none. --redis.timeout 100ms:
// no answer comes from the fallback on a busy machine.
func (e *env) startLimiterd(ctx context.Context, sys *system, dir string, redisAddrs []string) (*proc, error) {
	grpcPort, err := e.ports.get(false, false)
	if err != nil {
		return nil, err
	}
	httpPort, err := e.ports.get(false, false)
	if err != nil {
		return nil, err
	}
	args := []string{"--rules.file", filepath.Join(e.config, "limiterd-rules.yml"),
		"--grpc.listen-address", addr(grpcPort), "--http.listen-address", addr(httpPort),
		"--redis.timeout", "100ms", "--log.level", "warn"}
	if len(redisAddrs) > 0 {
		args = append(args, "--redis.addrs", strings.Join(redisAddrs, ","))
	}
	p, err := startProc("limiterd", filepath.Join(dir, "limiterd.log"), nil, e.limiterd, args...)
	if err != nil {
		return nil, err
	}
	sys.onStop(p.stop)
	sys.grpc = addr(grpcPort)
	sys.metrics = "http://" + addr(httpPort) + "/metrics"
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
func (e *env) startEnvoyRatelimit(sys *system, dir, redisAddr string) (*proc, error) {
	root := filepath.Join(dir, "runtime")
	conf := filepath.Join(root, "ratelimit", "config")
	if err := os.MkdirAll(conf, 0o755); err != nil {
		return nil, err
	}
	b, err := os.ReadFile(filepath.Join(e.config, "envoy-ratelimit.yaml"))
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
	proc, err := startProc("envoy ratelimit", filepath.Join(dir, "ratelimit.log"), envs, e.envoyRatelimit)
	if err != nil {
		return nil, err
	}
	sys.onStop(proc.stop)
	sys.grpc = addr(p[1])
	return proc, nil
}

// startGubernator starts one Gubernator, its member list of itself alone
// (so that it owns every key), no tracing.
func (e *env) startGubernator(sys *system, dir string) (*proc, error) {
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
	p, err := startProc("gubernator", filepath.Join(dir, "gubernator.log"), envs, e.gubernator)
	if err != nil {
		return nil, err
	}
	sys.onStop(p.stop)
	sys.grpc = addr(grpcPort)
	return p, nil
}
