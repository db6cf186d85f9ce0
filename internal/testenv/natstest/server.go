// Package natstest runs nats-server processes with JetStream for
// integration tests: NewServer one server, NewSupercluster a NATS
// supercluster of them (a cluster per region, gateways between the regions,
// each gateway link cut and healed at will), all on free loopback ports.
// Everything it starts is stopped with t.Cleanup. When no nats-server can
// be had it skips the test, except when the environment variable CI is
// true: there it fails the test, so that a green CI run means the
// integration tests ran.
package natstest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/testenv"
)

const (
	// natsReadyTimeout bounds the wait for a nats-server to be healthy.
	natsReadyTimeout = 15 * time.Second
	// natsRestartTimeout bounds Restart's retries to bind the old port.
	natsRestartTimeout = 10 * time.Second
	// natsStopTimeout bounds a graceful stop before the server is killed.
	natsStopTimeout = 10 * time.Second

	natsMaxMemory = 256 << 20 // JetStream memory storage limit
	natsMaxStore  = 1 << 30   // JetStream file storage limit

	// ServerEnv names the environment variable that may hold the path of
	// a nats-server binary; without it NewServer builds one from the
	// nats-server/v2 module this module requires (`go tool -n nats-server`).
	ServerEnv = "LIMITER_NATS_SERVER"
)

// errPortInUse says a nats-server could not bind one of its ports because
// another process took it first.
var errPortInUse = errors.New("port already in use")

// Server is one nats-server process with JetStream, started by NewServer
// or NewSupercluster. Its ports and JetStream store directory stay the same
// across Shutdown, Kill and Restart, so streams, their messages and durable
// consumers survive an outage.
//
// The server runs as a separate process, as in production: a test can stop
// or kill it like a real one, and the race detector of the test binary
// watches this project's code, not the server's.
//
// URL, Pid, Shutdown and Kill are safe for concurrent use; Restart fails the
// test it is given, so call it from that test's goroutine. A Server is
// only made by this package.
type Server struct {
	bin   string
	dir   string
	name  string
	extra string // configuration appended to the generated one
	// member, when set, writes the cluster and gateway blocks of a server
	// of a supercluster (NewSupercluster).
	member func(*strings.Builder)
	// healthPath is the monitoring path polled until the server is up:
	// "/healthz" alone, or with ?js-enabled-only=true for a supercluster
	// member, which is not healthy before its peers run.
	healthPath string

	mu      sync.Mutex
	port    int
	monitor int
	proc    *testenv.Process // nil while stopped
}

// Option changes the configuration of a server NewServer or
// NewSupercluster starts.
type Option func(*Server)

// Config appends conf, nats-server configuration text, to the server's
// own (ports, log, JetStream): an authorization block, an operator and its
// resolver, a tls block, or an include of a file.
func Config(conf string) Option {
	return func(s *Server) { s.extra += conf + "\n" }
}

// NewServer starts a nats-server process on free loopback ports, with
// JetStream storing in a fresh t.TempDir() (limits: 256 MiB of memory,
// 1 GiB of files), and stops it when the test ends. The binary is the one
// named by $LIMITER_NATS_SERVER, or else built (once, then cached by the go
// command) from the nats-server/v2 module pinned in go.mod. Options add to
// the configuration; it is the same after Restart.
func NewServer(t testing.TB, opts ...Option) *Server {
	t.Helper()
	s := &Server{bin: natsBinary(t), dir: t.TempDir(), name: "testenv"}
	for _, o := range opts {
		o(s)
	}
	var err error
	for range 5 {
		if s.port, err = testenv.ReservePort(); err != nil {
			break
		}
		if s.monitor, err = testenv.ReservePort(); err != nil {
			break
		}
		var p *testenv.Process
		if p, err = s.spawn(); err == nil {
			s.proc = p
			t.Cleanup(s.Shutdown)
			return s
		}
		if !errors.Is(err, errPortInUse) {
			break
		}
	}
	t.Fatalf("natstest: start nats-server: %v", err)
	return nil
}

var natsBin struct {
	once sync.Once
	path string
	err  error
}

// natsBinary returns the nats-server executable, building it on first use.
func natsBinary(t testing.TB) string {
	t.Helper()
	natsBin.once.Do(func() {
		if p := os.Getenv(ServerEnv); p != "" {
			natsBin.path = p
			if _, err := os.Stat(p); err != nil {
				natsBin.err = fmt.Errorf("$%s: %w", ServerEnv, err)
			}
			return
		}
		gobin, err := exec.LookPath("go")
		if err != nil {
			natsBin.err = fmt.Errorf("the go command is not on PATH to build nats-server; set $%s to a nats-server binary", ServerEnv)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		// -n prints where the go command cached the tool's binary after
		// building it, without running it.
		out, err := exec.CommandContext(ctx, gobin, "tool", "-n", "nats-server").Output()
		if err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				err = fmt.Errorf("%w: %s", err, ee.Stderr)
			}
			natsBin.err = fmt.Errorf("go tool -n nats-server: %w", err)
			return
		}
		natsBin.path = strings.TrimSpace(string(out))
	})
	if natsBin.err != nil {
		if testenv.InCI() {
			t.Fatalf("natstest: no nats-server and CI=true, so this is a failure, not a skip: %v", natsBin.err)
		}
		t.Skipf("natstest: no nats-server: %v", natsBin.err)
	}
	return natsBin.path
}

// URL returns the client URL, "nats://127.0.0.1:port". It does not change
// across Shutdown and Restart.
func (s *Server) URL() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return "nats://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// Name is the server's name (server_name): "testenv" for NewServer, and
// <region>-<n> in a supercluster, as JetStream names a stream's leader and
// replicas.
func (s *Server) Name() string { return s.name }

// Pid returns the process id of the running server, or 0 while stopped.
func (s *Server) Pid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return 0
	}
	return s.proc.Pid()
}

// Shutdown stops the server gracefully (SIGTERM, then SIGKILL if it has not
// exited within 10 s) and waits until it has exited; clients see the
// connection drop. Shutting down a stopped server does nothing.
func (s *Server) Shutdown() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return
	}
	_ = s.proc.Signal(syscall.SIGTERM)
	select {
	case <-s.proc.Done():
	case <-time.After(natsStopTimeout):
		s.proc.Kill()
	}
	s.proc = nil
}

// Kill ends the server with SIGKILL, as in a crash, and waits for it to
// exit. Killing a stopped server does nothing.
func (s *Server) Kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return
	}
	s.proc.Kill()
	s.proc = nil
}

// Restart stops the server if it is running and starts it again on the same
// ports with the same JetStream store directory, retrying for a while if a
// port is still busy. Clients that reconnect find their streams, messages
// and durable consumers again.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.Shutdown()
	s.mu.Lock()
	defer s.mu.Unlock()
	deadline := time.Now().Add(natsRestartTimeout)
	for {
		err := fmt.Errorf("port %d or %d is busy", s.port, s.monitor)
		if testenv.CanListen(s.port) && testenv.CanListen(s.monitor) {
			var p *testenv.Process
			if p, err = s.spawn(); err == nil {
				s.proc = p
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("natstest: restart nats-server on port %d: %v", s.port, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (s *Server) confPath() string { return filepath.Join(s.dir, "nats.conf") }

// MonitorAddr is the server's monitoring listener, host:port.
func (s *Server) MonitorAddr() string { return fmt.Sprintf("127.0.0.1:%d", s.monitor) }

// Dir is the server's own directory (configuration, logs, JetStream store).
func (s *Server) Dir() string { return s.dir }

// LogTail returns the last lines of the server's log, for a test that
// looks for what the server refused.
func (s *Server) LogTail() string { return s.logTail() }
func (s *Server) logPath() string { return filepath.Join(s.dir, "nats.log") }

// writeConfig writes the server's configuration file for its current ports.
func (s *Server) writeConfig() error {
	var b strings.Builder
	fmt.Fprintf(&b, "server_name: %q\n", s.name)
	fmt.Fprintf(&b, "listen: \"127.0.0.1:%d\"\n", s.port)
	fmt.Fprintf(&b, "http: \"127.0.0.1:%d\"\n", s.monitor)
	fmt.Fprintf(&b, "log_file: %q\n", s.logPath())
	fmt.Fprintf(&b, "jetstream {\n  store_dir: %q\n  max_memory_store: %d\n  max_file_store: %d\n}\n",
		filepath.Join(s.dir, "jetstream"), natsMaxMemory, natsMaxStore)
	if s.member != nil {
		s.member(&b)
	}
	b.WriteString(s.extra)
	return os.WriteFile(s.confPath(), []byte(b.String()), 0o644)
}

// spawn starts the server and waits until it reports healthy with
// JetStream on; errPortInUse says another process holds one of its ports.
func (s *Server) spawn() (*testenv.Process, error) {
	if err := s.writeConfig(); err != nil {
		return nil, err
	}
	p, err := testenv.StartProcess(s.dir, filepath.Join(s.dir, "output.log"), s.bin, "-c", s.confPath())
	if err != nil {
		return nil, err
	}
	path := s.healthPath
	if path == "" {
		path = "/healthz"
	}
	health := fmt.Sprintf("http://127.0.0.1:%d%s", s.monitor, path)
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(natsReadyTimeout)
	for {
		select {
		case <-p.Done():
			tail := s.logTail()
			if strings.Contains(tail, "address already in use") {
				return nil, fmt.Errorf("127.0.0.1:%d: %w\n%s", s.port, errPortInUse, tail)
			}
			return nil, fmt.Errorf("nats-server exited before it was healthy (%w)\n%s", p.Err(), tail)
		default:
		}
		resp, err := client.Get(health)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p, nil
			}
			err = fmt.Errorf("healthz: %s", resp.Status)
		}
		if time.Now().After(deadline) {
			p.Kill()
			return nil, fmt.Errorf("nats-server not healthy after %v (last: %w)\n%s", natsReadyTimeout, err, s.logTail())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// logTail returns the last lines of the server's log and output files.
func (s *Server) logTail() string {
	return testenv.TailFiles(s.logPath(), filepath.Join(s.dir, "output.log"))
}
