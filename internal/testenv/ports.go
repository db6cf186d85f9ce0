package testenv

import (
	"errors"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

// clusterBusOffset is the distance Redis puts between a node's port and its
// cluster bus port.
const clusterBusOffset = 10000

// lowestPort is the lowest port handed out, above the well-known ones.
const lowestPort = 10000

// reserved holds every port handed out in this process, so that two helpers
// running in parallel never pick the same one. Ports are never returned:
// a stopped node keeps its port for a restart.
var reserved struct {
	sync.Mutex
	ports map[int]bool
}

// reservePort returns a loopback port that is free now and was not handed
// out before in this process. With bus set, port+clusterBusOffset is free too.
//
// Another process may still take the port before the server binds it; the
// callers detect that and ask again.
func reservePort(bus bool) (int, error) {
	lo, hi := portRange(bus)
	reserved.Lock()
	defer reserved.Unlock()
	if reserved.ports == nil {
		reserved.ports = make(map[int]bool)
	}
	for range 1000 {
		p := lo + rand.IntN(hi-lo+1)
		if reserved.ports[p] || !canListen(p) {
			continue
		}
		if bus && (reserved.ports[p+clusterBusOffset] || !canListen(p+clusterBusOffset)) {
			continue
		}
		reserved.ports[p] = true
		if bus {
			reserved.ports[p+clusterBusOffset] = true
		}
		return p, nil
	}
	return 0, errors.New("no free loopback port found after 1000 tries")
}

// portRange returns the inclusive range to pick ports from. It stays below
// the kernel's ephemeral range (bus ports included) when that leaves room,
// so that outgoing connections never hold a port a server is about to bind.
func portRange(bus bool) (lo, hi int) {
	ephemeral := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil {
				ephemeral = n
			}
		}
	}
	hi = ephemeral - 1
	if bus {
		hi -= clusterBusOffset
	}
	if hi-lowestPort < 1000 {
		// The ephemeral range starts too low: use the whole range and rely
		// on the retries.
		hi = 65535
		if bus {
			hi -= clusterBusOffset
		}
	}
	return lowestPort, hi
}

// canListen reports whether 127.0.0.1:port can be listened on right now.
func canListen(port int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	l.Close()
	return true
}
