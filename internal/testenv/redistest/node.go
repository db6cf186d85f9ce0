package redistest

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/testenv"
)

// startTimeout bounds the wait for a new redis-server to accept connections.
const startTimeout = 10 * time.Second

// errPortInUse says a redis-server could not bind its port (or bus port)
// because another process took it first.
var errPortInUse = errors.New("port already in use")

// Node is one redis-server process started by NewNode, NewTLSNode or
// NewCluster.
// It keeps its port, directory and configuration file across Stop and Start.
//
// Addr, Pid and Stop are safe for concurrent use. Start reports a failure
// with Fatalf on the test that created the node, so call it from that test's
// goroutine. A Node is only made by this package.
type Node struct {
	t      testing.TB
	server string // path of redis-server
	dir    string
	port   int
	// tlsFiles, when set, make the node serve TLS only on port, and
	// tlsClient is how the helpers reach it then.
	tlsFiles  *TLSFiles
	tlsClient *tls.Config

	mu   sync.Mutex
	proc *testenv.Process // nil while stopped
}

// NewNode starts one standalone (non-cluster) redis-server on a free
// loopback port and stops it when the test ends. It skips the test when
// redis-server is missing, or fails it if CI is true.
func NewNode(t testing.TB) *Node {
	t.Helper()
	server := lookBinary(t, "redis-server")
	n, err := newNode(t, server, t.TempDir(), false)
	if err != nil {
		t.Fatalf("redistest: start redis-server: %v", err)
	}
	t.Cleanup(n.Stop)
	return n
}

// TLSFiles are the PEM files of a TLS redis-server: its certificate and
// key, and the CA its clients' certificates must chain to.
type TLSFiles struct{ Cert, Key, CA string }

// NewTLSNode starts one standalone redis-server that serves only TLS on
// a free loopback port (tls-port, port 0), requiring client certificates
// of f.CA (tls-auth-clients yes); client is how NewTLSNode itself
// connects to see it ready. Skips or fails as NewNode does.
func NewTLSNode(t testing.TB, f TLSFiles, client *tls.Config) *Node {
	t.Helper()
	server := lookBinary(t, "redis-server")
	n, err := newNodeWith(t, server, t.TempDir(), false, &f, client)
	if err != nil {
		t.Fatalf("redistest: start redis-server with TLS: %v", err)
	}
	t.Cleanup(n.Stop)
	return n
}

// newNode starts a redis-server whose files live in dir, picking another
// port when the first one was taken. It does not register any cleanup.
func newNode(t testing.TB, server, dir string, cluster bool) (*Node, error) {
	return newNodeWith(t, server, dir, cluster, nil, nil)
}

func newNodeWith(t testing.TB, server, dir string, cluster bool, tf *TLSFiles, tc *tls.Config) (*Node, error) {
	n, err := startNode(t.Context(), server, dir, cluster, tf, tc)
	if n != nil {
		n.t = t
	}
	return n, err
}

// startNode starts a redis-server in dir on a free port, with ctx bounding
// the wait for it to answer; the node has no test until it is given one.
func startNode(ctx context.Context, server, dir string, cluster bool, tf *TLSFiles, tc *tls.Config) (*Node, error) {
	var lastErr error
	for range 5 {
		port, err := reservePort(cluster)
		if err != nil {
			return nil, err
		}
		// A failed attempt may have left a nodes.conf naming the old port.
		if err := os.RemoveAll(dir); err != nil {
			return nil, err
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
		n := &Node{server: server, dir: dir, port: port, tlsFiles: tf, tlsClient: tc}
		if err := n.writeConfig(cluster); err != nil {
			return nil, err
		}
		p, err := n.spawn(ctx)
		if err == nil {
			n.proc = p
			return n, nil
		}
		if !errors.Is(err, errPortInUse) {
			return nil, err
		}
		lastErr = err
	}
	return nil, lastErr
}

// writeConfig writes the node's redis.conf. Persistence is off: a restarted
// node comes back empty (a cluster node keeps its identity in nodes.conf).
func (n *Node) writeConfig(cluster bool) error {
	var b strings.Builder
	if f := n.tlsFiles; f != nil {
		b.WriteString("port 0\n")
		fmt.Fprintf(&b, "tls-port %d\n", n.port)
		fmt.Fprintf(&b, "tls-cert-file %q\ntls-key-file %q\ntls-ca-cert-file %q\n", f.Cert, f.Key, f.CA)
		b.WriteString("tls-auth-clients yes\n")
	} else {
		fmt.Fprintf(&b, "port %d\n", n.port)
	}
	b.WriteString("bind 127.0.0.1\n")
	b.WriteString("daemonize no\n")
	fmt.Fprintf(&b, "dir %q\n", n.dir)
	fmt.Fprintf(&b, "logfile %q\n", n.logPath())
	b.WriteString("save \"\"\n")
	b.WriteString("appendonly no\n")
	b.WriteString("repl-diskless-sync-delay 0\n")
	if cluster {
		b.WriteString("cluster-enabled yes\n")
		b.WriteString("cluster-config-file nodes.conf\n")
		b.WriteString("cluster-node-timeout 2000\n")
		// A node learns its own address from the nodes it meets: a
		// cluster of one would know itself at ":port".
		b.WriteString("cluster-announce-ip 127.0.0.1\n")
	}
	return os.WriteFile(n.confPath(), []byte(b.String()), 0o644)
}

func (n *Node) confPath() string   { return filepath.Join(n.dir, "redis.conf") }
func (n *Node) logPath() string    { return filepath.Join(n.dir, "redis.log") }
func (n *Node) outputPath() string { return filepath.Join(n.dir, "output.log") }

// Addr returns the node's address, "127.0.0.1:port". It does not change
// across Stop and Start.
func (n *Node) Addr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(n.port))
}

// Pid returns the process id of the running redis-server, or 0 while the
// node is stopped.
func (n *Node) Pid() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.proc == nil {
		return 0
	}
	return n.proc.Pid()
}

// Stop kills the node's redis-server (SIGKILL, as in a crash) and waits for
// it to exit. Stopping a stopped node does nothing.
func (n *Node) Stop() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.proc == nil {
		return
	}
	n.proc.Kill()
	n.proc = nil
}

// Start restarts a stopped node on the same port with the same directory
// and configuration file, so a cluster node rejoins its cluster with its old
// identity, though without data. It returns once the server accepts
// connections; use Cluster.WaitHealthy to wait for the cluster. Starting a
// running node does nothing.
func (n *Node) Start() {
	n.t.Helper()
	if err := n.start(); err != nil {
		n.t.Fatalf("redistest: restart redis-server %s: %v", n.Addr(), err)
	}
}

func (n *Node) start() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.proc != nil {
		return nil
	}
	p, err := n.spawn(n.t.Context())
	if err != nil {
		return err
	}
	n.proc = p
	return nil
}

// running reports whether the node was started and not stopped since.
func (n *Node) running() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.proc != nil
}

// spawn starts redis-server and waits until the process it started (not some
// other server on the same port) answers.
func (n *Node) spawn(ctx context.Context) (*testenv.Process, error) {
	p, err := testenv.StartProcess(n.dir, n.outputPath(), n.server, n.confPath())
	if err != nil {
		return nil, err
	}
	pid := strconv.Itoa(p.Pid())
	deadline := time.Now().Add(startTimeout)
	for {
		select {
		case <-p.Done():
			tail := n.logTail()
			if strings.Contains(tail, "already in use") {
				return nil, fmt.Errorf("%s: %w\n%s", n.Addr(), errPortInUse, tail)
			}
			return nil, fmt.Errorf("%s: redis-server exited before accepting connections (%w)\n%s", n.Addr(), p.Err(), tail)
		default:
		}
		info, err := commandVia(ctx, n.Addr(), n.tlsClient, "INFO", "server")
		if err == nil && infoField(info, "process_id") == pid {
			return p, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			p.Kill()
			return nil, fmt.Errorf("%s: redis-server not answering after %v (last: %w)\n%s", n.Addr(), startTimeout, err, n.logTail())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// logTail returns the last lines of the node's log and output files.
func (n *Node) logTail() string { return testenv.TailFiles(n.logPath(), n.outputPath()) }
