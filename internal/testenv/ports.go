package testenv

import (
	"errors"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// lowestPort is the lowest port handed out, above the well-known ones.
const lowestPort = 10000

// The band of fixed ports the local stack (scripts/stack.sh, and the stack
// tests that run it) binds above lowestPort: its Redis nodes' cluster bus
// ports (17000-17202) and its delaying links (17222-17224, 18000-18300).
// It is never handed out, so a test's server beside a stack never takes
// one of them.
const stackPortsLo, stackPortsHi = 17000, 18999

func inStackBand(p int) bool { return p >= stackPortsLo && p <= stackPortsHi }

// reserved holds every port handed out in this process, so that two servers
// started in parallel never pick the same one. Ports are never returned:
// a stopped server keeps its port for a restart. Across the machine's test
// processes, a lock on the port (claimPort) does the same.
var reserved struct {
	sync.Mutex
	ports map[int]bool
}

// ReservePort returns a loopback port that is free now and was not handed
// out before in this process, nor is held by another test process.
//
// A process that does not reserve its ports (a server asked for port 0)
// may still take the port before the server binds it; the callers detect
// that and ask again.
func ReservePort() (int, error) { return reservePort(0) }

// ReservePortPair is ReservePort for a server that also binds port+offset
// (as a Redis Cluster node binds its cluster bus port): that port is free
// now and reserved too.
func ReservePortPair(offset int) (int, error) { return reservePort(offset) }

// reservePort returns a free port p not handed out before; with offset
// above 0, p+offset is free too and is reserved with it.
func reservePort(offset int) (int, error) {
	lo, hi := portRange(offset)
	reserved.Lock()
	defer reserved.Unlock()
	if reserved.ports == nil {
		reserved.ports = make(map[int]bool)
	}
	for range 1000 {
		p := lo + rand.IntN(hi-lo+1)
		if reserved.ports[p] || inStackBand(p) || !CanListen(p) {
			continue
		}
		if offset > 0 && (reserved.ports[p+offset] || inStackBand(p+offset) || !CanListen(p+offset)) {
			continue
		}
		// Another test process may hold it, its server stopped for now.
		if !claimPort(p) {
			continue
		}
		if offset > 0 && !claimPort(p+offset) {
			unclaimPort(p)
			continue
		}
		reserved.ports[p] = true
		if offset > 0 {
			reserved.ports[p+offset] = true
		}
		return p, nil
	}
	return 0, errors.New("no free loopback port found after 1000 tries")
}

// portRange returns the inclusive range to pick ports from. It stays below
// the kernel's ephemeral range (port+offset included) when that leaves
// room, so that outgoing connections never hold a port a server is about
// to bind.
func portRange(offset int) (lo, hi int) {
	ephemeral := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil {
				ephemeral = n
			}
		}
	}
	hi = ephemeral - 1 - offset
	if hi-lowestPort < 1000 {
		// The ephemeral range starts too low: use the whole range and rely
		// on the retries.
		hi = 65535 - offset
	}
	return lowestPort, hi
}

// CanListen reports whether 127.0.0.1:port can be listened on right now.
func CanListen(port int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// FreeAddr is "127.0.0.1:port" for a port from ReservePort, for a server
// that another process binds: free now, below the ephemeral range (no
// outgoing connection holds it) and never handed out again in this
// process, as a port of a listener opened and closed at once could be.
func FreeAddr(t testing.TB) string {
	t.Helper()
	p, err := ReservePort()
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
}
