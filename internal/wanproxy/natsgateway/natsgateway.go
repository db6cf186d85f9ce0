// Package natsgateway puts one NATS server's gateway port behind a proxy
// that shapes each connection by the cluster that dials it: one address
// to advertise to every other region (a server learns the others'
// gateway addresses from their INFO, so a proxy per pair of regions would
// be bypassed after a reconnect), a wanproxy.Link per dialing region.
package natsgateway

import (
	"bufio"
	"encoding/json"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/limiterd/limiterd/internal/wanproxy"
)

// handshakeTimeout bounds each side's first line: the server's INFO, the
// dialing server's CONNECT.
const handshakeTimeout = 10 * time.Second

// Proxy forwards connections to a NATS server's gateway port. The server
// speaks first (INFO), which the proxy passes on at once; the dialing
// server answers with CONNECT, naming its cluster, and from there on the
// connection is carried over the link LinkFunc returns for that cluster
// (ClientToTarget: what the dialing cluster sends). Its methods are safe
// for concurrent use.
type Proxy struct {
	target string
	link   LinkFunc
	lis    net.Listener
	wg     sync.WaitGroup

	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]struct{}
}

// LinkFunc returns the link that carries the connections of the cluster
// from, or nil to refuse them (an unknown cluster, a cut).
type LinkFunc func(from string) *wanproxy.Link

// Listen starts a proxy on addr forwarding to target, a NATS server's
// gateway listen address.
func Listen(addr, target string, link LinkFunc) (*Proxy, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	p := &Proxy{target: target, link: link, lis: lis, conns: map[net.Conn]struct{}{}}
	p.wg.Go(p.serve)
	return p, nil
}

// Addr returns the address the proxy listens on: the one to advertise.
func (p *Proxy) Addr() string { return p.lis.Addr().String() }

// Port returns the port the proxy listens on.
func (p *Proxy) Port() int { return p.lis.Addr().(*net.TCPAddr).Port }

func (p *Proxy) serve() {
	for {
		c, err := p.lis.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if !p.track(c) {
			return
		}
		p.wg.Go(func() { p.handle(c) })
	}
}

// track remembers c until untrack, so that Close ends it; false (and c
// closed) once the proxy is closed.
func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	c.Close()
}

func (p *Proxy) handle(client net.Conn) {
	defer p.untrack(client)
	up, err := net.DialTimeout("tcp", p.target, handshakeTimeout)
	if err != nil || !p.track(up) {
		return
	}
	defer p.untrack(up)
	ub := bufio.NewReader(up)
	_ = up.SetReadDeadline(time.Now().Add(handshakeTimeout))
	info, err := ub.ReadString('\n')
	_ = up.SetReadDeadline(time.Time{})
	if err != nil {
		return
	}
	if _, err := io.WriteString(client, info); err != nil {
		return
	}
	br := bufio.NewReader(client)
	_ = client.SetReadDeadline(time.Now().Add(handshakeTimeout))
	line, err := br.ReadString('\n')
	_ = client.SetReadDeadline(time.Time{})
	if err != nil {
		return
	}
	from := Cluster(line)
	if from == "" {
		return
	}
	l := p.link(from)
	if l == nil {
		return
	}
	l.Forward(wanproxy.WithReader(client, io.MultiReader(strings.NewReader(line), br)), wanproxy.WithReader(up, ub))
}

// Close stops listening, ends every connection of the proxy and returns
// once all its goroutines have ended.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	err := p.lis.Close()
	p.wg.Wait()
	return err
}

// Cluster returns the gateway (cluster) name a CONNECT line of the NATS
// gateway protocol names, or "" if the line is not one.
func Cluster(line string) string {
	rest, ok := strings.CutPrefix(strings.TrimSpace(line), "CONNECT ")
	if !ok {
		return ""
	}
	var c struct {
		Gateway string `json:"gateway"`
	}
	if json.Unmarshal([]byte(rest), &c) != nil {
		return ""
	}
	return c.Gateway
}
