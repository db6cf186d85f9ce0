// Package wanproxy forwards TCP connections as a wide-area link between
// regions would carry them: late by a one-way delay per direction, with
// jitter, stalls, resets and one-way cuts, changeable while the
// connections run. It stands in for the kernel's netem where there is none
// (tests, the local stack): a Proxy listens on a loopback port and forwards
// to a target; a Link shapes connections a caller accepted itself.
//
// Delay is applied to bytes, not to round trips: each chunk read is
// stamped with its arrival and written at arrival + delay, so a link
// carries as much in flight as its window allows (MaxInFlight per
// direction of a connection), as a long fat pipe does.
//
// TCP loses no bytes, so neither does the proxy: a lost packet shows to a
// TCP connection as a stall while it is sent again, which is what Loss
// models (Shape), or as a connection reset when the path stays broken
// (Shape.Reset, Link.Reset).
package wanproxy

import (
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"time"
)

const (
	// DefaultLossStall is the stall of a lost chunk when Shape.LossStall
	// is zero: Linux's minimum retransmission timeout.
	DefaultLossStall = 200 * time.Millisecond
	// MaxInFlight bounds the bytes one direction of a connection holds
	// (read, not yet written): its window. Past it the proxy stops
	// reading, and the sender's own TCP window fills.
	MaxInFlight = 4 << 20

	readSize = 32 << 10
)

// Direction is one way, or both ways, of a forwarded connection.
type Direction uint8

const (
	// ClientToTarget carries what the dialing side sends.
	ClientToTarget Direction = 1 << iota
	// TargetToClient carries the target's answers.
	TargetToClient
	// Both is both ways.
	Both = ClientToTarget | TargetToClient
)

// Shape is what a link does to the bytes going one way. The zero Shape
// forwards them at once.
type Shape struct {
	// Delay is the one-way delay: a chunk read at t is written at
	// t + Delay (or later, behind the chunk before it).
	Delay time.Duration
	// Jitter adds a uniformly random [0, Jitter) to each chunk's delay.
	// Chunks stay in order, as on a TCP connection: one is never written
	// before the chunk read before it.
	Jitter time.Duration
	// Loss is the probability that a chunk is held as if one of its
	// packets were lost and sent again: LossStall longer, and every chunk
	// behind it waits (head-of-line blocking). No byte is lost.
	Loss float64
	// LossStall is the stall of a lost chunk; zero is DefaultLossStall.
	LossStall time.Duration
	// Reset is the probability, per chunk, that the connection is reset
	// instead of carrying it: both ends see the connection broken, as
	// when a path stays down past TCP's retries.
	Reset float64
}

// Link shapes the connections forwarded over it, each direction by its
// own Shape; a change applies at once to the chunks read after it, on
// every connection. The zero Link is not usable: make one with NewLink.
// A Link is safe for concurrent use.
type Link struct {
	mu      sync.Mutex
	shapes  [2]Shape
	cut     Direction
	changed chan struct{} // closed and replaced on every change of cut
	down    bool
	conns   map[*conn]struct{}
}

// NewLink returns a link whose ClientToTarget direction is shaped by
// toTarget and TargetToClient by toClient.
func NewLink(toTarget, toClient Shape) *Link {
	return &Link{shapes: [2]Shape{toTarget, toClient}, changed: make(chan struct{}), conns: map[*conn]struct{}{}}
}

func index(d Direction) int {
	if d == TargetToClient {
		return 1
	}
	return 0
}

func (d Direction) each(f func(i int)) {
	if d&ClientToTarget != 0 {
		f(0)
	}
	if d&TargetToClient != 0 {
		f(1)
	}
}

// Shape returns the shape of one direction (ClientToTarget or
// TargetToClient).
func (l *Link) Shape(d Direction) Shape {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.shapes[index(d)]
}

// SetShape sets the shape of the directions d.
func (l *Link) SetShape(d Direction, s Shape) {
	l.mu.Lock()
	defer l.mu.Unlock()
	d.each(func(i int) { l.shapes[i] = s })
}

// SetDelay sets the one-way delay of the directions d, keeping the rest
// of their shapes: a latency spike, and its end. A shorter delay does not
// let a chunk pass one read before it.
func (l *Link) SetDelay(d Direction, delay time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	d.each(func(i int) { l.shapes[i].Delay = delay })
}

// Cut stops forwarding in the directions d: what is read is held (up to
// MaxInFlight, then the sender's TCP window fills) and nothing is
// written, as over a path that drops every packet one way while TCP keeps
// sending them again. The connections stay open; Heal lets the bytes
// through, in order. Cutting one direction alone is a one-way cut.
func (l *Link) Cut(d Direction) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cut |= d
	close(l.changed)
	l.changed = make(chan struct{})
}

// Heal forwards the directions d again after Cut.
func (l *Link) Heal(d Direction) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cut &^= d
	close(l.changed)
	l.changed = make(chan struct{})
}

// Reset breaks every connection the link carries now: both ends see a
// connection reset. New connections are forwarded as before.
func (l *Link) Reset() {
	l.mu.Lock()
	conns := make([]*conn, 0, len(l.conns))
	for c := range l.conns {
		conns = append(conns, c)
	}
	l.mu.Unlock()
	for _, c := range conns {
		c.reset()
	}
}

// SetDown takes the link down (true) or up again (false). While down,
// every connection it carried has been reset and each new one is reset as
// Forward gets it: a path that is gone, not slow. Unlike Cut, no byte is
// held for later.
func (l *Link) SetDown(down bool) {
	l.mu.Lock()
	l.down = down
	l.mu.Unlock()
	if down {
		l.Reset()
	}
}

// Conns returns how many connections the link carries now.
func (l *Link) Conns() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.conns)
}

// state is what a writer of direction i waits on: whether it is cut, and
// a channel closed when that may change.
func (l *Link) state(i int) (cut bool, changed <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cut&(Direction(1)<<i) != 0, l.changed
}

// Forward carries client's bytes to target and target's to client,
// shaped by the link (reset at once while it is down), until both directions have ended (each side closed
// its writing half, and what it sent was delivered) or either connection
// fails; then it closes both. It returns once every goroutine it started
// has ended.
func (l *Link) Forward(client, target net.Conn) {
	c := &conn{client: client, target: target, done: make(chan struct{})}
	l.mu.Lock()
	if l.down {
		l.mu.Unlock()
		c.reset()
		return
	}
	l.conns[c] = struct{}{}
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		delete(l.conns, c)
		l.mu.Unlock()
	}()
	var wg sync.WaitGroup
	var writers sync.WaitGroup
	for _, p := range []*pipe{
		{link: l, i: 0, c: c, src: client, dst: target},
		{link: l, i: 1, c: c, src: target, dst: client},
	} {
		p.more, p.room = make(chan struct{}, 1), make(chan struct{}, 1)
		wg.Go(p.read)
		writers.Go(p.write)
	}
	writers.Wait()
	c.close()
	wg.Wait()
}

// conn is one forwarded connection: its two sides.
type conn struct {
	client, target net.Conn
	once           sync.Once
	done           chan struct{} // closed when the connection is closed
}

func (c *conn) close() {
	c.once.Do(func() {
		close(c.done)
		c.client.Close()
		c.target.Close()
	})
}

// reset closes both sides so that their peers see a reset (RST), not an
// orderly end.
func (c *conn) reset() {
	for _, nc := range []net.Conn{c.client, c.target} {
		if tc, ok := nc.(interface{ SetLinger(int) error }); ok {
			_ = tc.SetLinger(0)
		}
	}
	c.close()
}

type chunk struct {
	b   []byte
	due time.Time
}

// pipe is one direction of a connection: a reader that stamps each chunk
// with when it is due, and a writer that writes it then.
type pipe struct {
	link     *Link
	i        int // index of the direction: 0 client to target
	c        *conn
	src, dst net.Conn

	mu    sync.Mutex
	q     []chunk
	bytes int
	eof   bool
	more  chan struct{} // a chunk or the end was queued
	room  chan struct{} // bytes left the queue
}

func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

func (p *pipe) read() {
	buf := make([]byte, readSize)
	var last time.Time
	for {
		n, err := p.src.Read(buf)
		if n > 0 {
			now := time.Now()
			p.link.mu.Lock()
			s := p.link.shapes[p.i]
			p.link.mu.Unlock()
			if s.Reset > 0 && rand.Float64() < s.Reset {
				p.c.reset()
				return
			}
			d := s.Delay
			if s.Jitter > 0 {
				d += rand.N(s.Jitter)
			}
			if s.Loss > 0 && rand.Float64() < s.Loss {
				stall := s.LossStall
				if stall == 0 {
					stall = DefaultLossStall
				}
				d += stall
			}
			due := now.Add(d)
			if due.Before(last) {
				due = last
			}
			last = due
			if !p.push(chunk{b: append([]byte(nil), buf[:n]...), due: due}) {
				return
			}
		}
		if err != nil {
			p.mu.Lock()
			p.eof = true
			p.mu.Unlock()
			signal(p.more)
			return
		}
	}
}

// push queues ch once there is room for it; false when the connection
// closed first.
func (p *pipe) push(ch chunk) bool {
	for {
		p.mu.Lock()
		if p.bytes == 0 || p.bytes+len(ch.b) <= MaxInFlight {
			p.q = append(p.q, ch)
			p.bytes += len(ch.b)
			p.mu.Unlock()
			signal(p.more)
			return true
		}
		p.mu.Unlock()
		select {
		case <-p.room:
		case <-p.c.done:
			return false
		}
	}
}

func (p *pipe) write() {
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		p.mu.Lock()
		if len(p.q) == 0 {
			eof := p.eof
			p.mu.Unlock()
			if eof {
				p.closeWrite()
				return
			}
			select {
			case <-p.more:
				continue
			case <-p.c.done:
				return
			}
		}
		ch := p.q[0]
		p.mu.Unlock()
		for {
			cut, changed := p.link.state(p.i)
			wait := time.Until(ch.due)
			if !cut && wait <= 0 {
				break
			}
			var fire <-chan time.Time
			if !cut {
				timer.Reset(wait)
				fire = timer.C
			}
			select {
			case <-fire:
			case <-changed:
				if !timer.Stop() {
					select {
					case <-timer.C:
					default:
					}
				}
			case <-p.c.done:
				return
			}
		}
		if _, err := p.dst.Write(ch.b); err != nil {
			p.c.close()
			return
		}
		p.mu.Lock()
		p.q[0] = chunk{}
		p.q = p.q[1:]
		p.bytes -= len(ch.b)
		p.mu.Unlock()
		signal(p.room)
	}
}

// closeWrite passes the end of src on to dst: its writing half closed, so
// the other direction goes on; a connection that cannot half-close ends.
func (p *pipe) closeWrite() {
	if cw, ok := p.dst.(interface{ CloseWrite() error }); ok && cw.CloseWrite() == nil {
		return
	}
	p.c.close()
}

// Proxy listens on a TCP address and forwards each connection it accepts
// to a target over a Link, which it embeds: SetDelay, Cut, Heal and Reset
// act on every connection of the proxy. Its methods are safe for
// concurrent use.
type Proxy struct {
	*Link
	target string
	lis    net.Listener
	wg     sync.WaitGroup

	mu     sync.Mutex
	closed bool
	open   map[net.Conn]struct{} // both sides of every connection, until forwarded
}

// Listen starts a proxy on addr ("127.0.0.1:0" for a free loopback port)
// forwarding to target (host:port) over link (NewLink(Shape{}, Shape{})
// when nil).
func Listen(addr, target string, link *Link) (*Proxy, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	if link == nil {
		link = NewLink(Shape{}, Shape{})
	}
	p := &Proxy{Link: link, target: target, lis: lis, open: map[net.Conn]struct{}{}}
	p.wg.Go(p.serve)
	return p, nil
}

// Addr returns the address the proxy listens on.
func (p *Proxy) Addr() string { return p.lis.Addr().String() }

// Target returns the address the proxy forwards to.
func (p *Proxy) Target() string { return p.target }

// dialTimeout bounds the dial of the target for each accepted connection.
const dialTimeout = 5 * time.Second

func (p *Proxy) serve() {
	for {
		client, err := p.lis.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			client.Close()
			return
		}
		p.open[client] = struct{}{}
		p.mu.Unlock()
		p.wg.Go(func() {
			target, err := net.DialTimeout("tcp", p.target, dialTimeout)
			p.mu.Lock()
			closed := p.closed
			if err == nil && !closed {
				p.open[target] = struct{}{}
			}
			p.mu.Unlock()
			if err == nil && !closed {
				p.Forward(client, target)
			}
			client.Close()
			if target != nil {
				target.Close()
			}
			p.mu.Lock()
			delete(p.open, client)
			delete(p.open, target)
			p.mu.Unlock()
		})
	}
}

// Close stops listening, ends every connection of the proxy and returns
// once all its goroutines have ended.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	for c := range p.open {
		c.Close()
	}
	p.mu.Unlock()
	err := p.lis.Close()
	p.wg.Wait()
	return err
}

// WithReader returns c reading from r instead: for a caller that read the
// start of a connection itself (a bufio.Reader over c, a line put back in
// front of it) before handing it to Link.Forward. Writes, CloseWrite and
// SetLinger go to c.
func WithReader(c net.Conn, r io.Reader) net.Conn { return &readerConn{Conn: c, r: r} }

type readerConn struct {
	net.Conn
	r io.Reader
}

func (c *readerConn) Read(b []byte) (int, error) { return c.r.Read(b) }

func (c *readerConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return errors.ErrUnsupported
}

func (c *readerConn) SetLinger(sec int) error {
	if l, ok := c.Conn.(interface{ SetLinger(int) error }); ok {
		return l.SetLinger(sec)
	}
	return errors.ErrUnsupported
}
