package wanproxy

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// margin is how much later than its delay a byte may arrive on a loaded
// machine (the race detector, two busy cores) and still count as on time.
// It is lenient, and still well under the delays tested: a proxy that
// applied the delay twice, or not at all, fails.
const margin = 150 * time.Millisecond

// echoServer accepts connections and writes back what it reads until the
// client closes its half; it stops with the test.
func echoServer(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { lis.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
				_ = c.(*net.TCPConn).CloseWrite()
			})
		}
	})
	return lis.Addr().String()
}

func listen(t *testing.T, target string, link *Link) *Proxy {
	t.Helper()
	p, err := Listen("127.0.0.1:0", target, link)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func dial(t *testing.T, addr string) *net.TCPConn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

// roundTrip writes one byte and returns how long its echo took.
func roundTrip(t *testing.T, c net.Conn) time.Duration {
	t.Helper()
	b := []byte{'x'}
	start := time.Now()
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, b); err != nil {
		t.Fatal(err)
	}
	return time.Since(start)
}

// TestRoundTrip: a byte's round trip through the proxy takes both
// directions' delays (never less), and not much more.
func TestRoundTrip(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		toTarget   Shape
		toClient   Shape
		least      time.Duration // every round trip takes at least this
		stallAfter bool          // the shapes change to a spike after the first rounds
	}{
		{name: "no delay", least: 0},
		{name: "symmetric 50ms", toTarget: Shape{Delay: 50 * time.Millisecond}, toClient: Shape{Delay: 50 * time.Millisecond}, least: 100 * time.Millisecond},
		{name: "one way 80ms", toTarget: Shape{Delay: 80 * time.Millisecond}, least: 80 * time.Millisecond},
		{name: "jitter", toTarget: Shape{Delay: 40 * time.Millisecond, Jitter: 30 * time.Millisecond}, toClient: Shape{Delay: 40 * time.Millisecond}, least: 80 * time.Millisecond},
		{name: "every chunk lost", toTarget: Shape{Delay: 20 * time.Millisecond, Loss: 1, LossStall: 100 * time.Millisecond}, toClient: Shape{Delay: 20 * time.Millisecond}, least: 140 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			p := listen(t, echoServer(t), NewLink(tt.toTarget, tt.toClient))
			c := dial(t, p.Addr())
			var rtts []time.Duration
			for range 5 {
				rtts = append(rtts, roundTrip(t, c))
			}
			most := tt.least + tt.toTarget.Jitter + tt.toClient.Jitter + margin
			if lo := slices.Min(rtts); lo < tt.least {
				t.Errorf("round trips %v: the shortest is under %v", rtts, tt.least)
			}
			// The shortest of five: one round slowed by a busy machine
			// does not fail the test, a proxy that adds delay does.
			if lo := slices.Min(rtts); lo > most {
				t.Errorf("round trips %v: even the shortest is over %v", rtts, most)
			}
		})
	}
}

// TestSetDelay: a latency spike set while the connection runs applies to
// the next bytes, and its end too.
func TestSetDelay(t *testing.T) {
	t.Parallel()
	const base, spike = 20 * time.Millisecond, 300 * time.Millisecond
	p := listen(t, echoServer(t), NewLink(Shape{Delay: base}, Shape{Delay: base}))
	c := dial(t, p.Addr())
	if rtt := roundTrip(t, c); rtt < 2*base || rtt > 2*base+margin {
		t.Errorf("before the spike: round trip %v, want [%v, %v]", rtt, 2*base, 2*base+margin)
	}
	p.SetDelay(ClientToTarget, spike)
	if got := p.Shape(ClientToTarget).Delay; got != spike {
		t.Fatalf("Shape(ClientToTarget).Delay = %v after SetDelay(%v)", got, spike)
	}
	if rtt := roundTrip(t, c); rtt < spike+base || rtt > spike+base+margin {
		t.Errorf("during the spike: round trip %v, want [%v, %v]", rtt, spike+base, spike+base+margin)
	}
	p.SetDelay(ClientToTarget, base)
	if rtt := roundTrip(t, c); rtt < 2*base || rtt > 2*base+margin {
		t.Errorf("after the spike: round trip %v, want [%v, %v]", rtt, 2*base, 2*base+margin)
	}
}

// TestOrder: with jitter and stalls, bytes written in many small writes
// come back complete and in order.
func TestOrder(t *testing.T) {
	t.Parallel()
	shape := Shape{Delay: 5 * time.Millisecond, Jitter: 20 * time.Millisecond, Loss: 0.05, LossStall: 10 * time.Millisecond}
	p := listen(t, echoServer(t), NewLink(shape, shape))
	c := dial(t, p.Addr())
	want := make([]byte, 1<<20)
	for i := range want {
		want[i] = byte(i * 7)
	}
	go func() {
		rest := want
		for len(rest) > 0 {
			n := min(len(rest), 1+rand.IntN(4096))
			if _, err := c.Write(rest[:n]); err != nil {
				return
			}
			rest = rest[n:]
		}
		_ = c.CloseWrite()
	}()
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		i := 0
		for i < min(len(got), len(want)) && got[i] == want[i] {
			i++
		}
		t.Fatalf("echo of %d bytes: got %d bytes, first difference at %d", len(want), len(got), i)
	}
}

// TestThroughput: a large transfer is not one chunk per delay: many
// chunks are in flight at once, as on a long fat pipe.
func TestThroughput(t *testing.T) {
	t.Parallel()
	const delay = 50 * time.Millisecond
	const size = 16 << 20
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	received := make(chan int64, 1)
	go func() {
		c, err := lis.Accept()
		if err != nil {
			received <- -1
			return
		}
		defer c.Close()
		n, _ := io.Copy(io.Discard, c)
		received <- n
	}()
	p := listen(t, lis.Addr().String(), NewLink(Shape{Delay: delay}, Shape{Delay: delay}))
	c := dial(t, p.Addr())
	start := time.Now()
	if _, err := c.Write(make([]byte, size)); err != nil {
		t.Fatal(err)
	}
	_ = c.CloseWrite()
	n := <-received
	elapsed := time.Since(start)
	if n != size {
		t.Fatalf("target received %d bytes, want %d", n, size)
	}
	// One 32 KiB chunk per delay would take 512 delays (25 s); the
	// window of MaxInFlight takes size/MaxInFlight delays, 4 here.
	if elapsed < delay || elapsed > 40*delay {
		t.Errorf("%d MiB over a %v link took %v, want [%v, %v]", size>>20, delay, elapsed, delay, 40*delay)
	}
	t.Logf("%d MiB over a %v link in %v (%.0f MiB/s)", size>>20, delay, elapsed.Round(time.Millisecond), float64(size>>20)/elapsed.Seconds())
}

// TestCut: a one-way cut holds every byte of its direction while the
// other direction still flows; after Heal the held bytes arrive, in order.
func TestCut(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := lis.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	const delay = 10 * time.Millisecond
	p := listen(t, lis.Addr().String(), NewLink(Shape{Delay: delay}, Shape{Delay: delay}))
	c := dial(t, p.Addr())
	var target net.Conn
	select {
	case target = <-accepted:
	case <-time.After(10 * time.Second):
		t.Fatal("the proxy did not dial the target")
	}
	defer target.Close()
	p.Cut(ClientToTarget)
	if _, err := c.Write([]byte("held")); err != nil {
		t.Fatal(err)
	}
	_ = target.SetReadDeadline(time.Now().Add(30*delay + margin))
	var b [16]byte
	if n, err := target.Read(b[:]); n > 0 || !errors.Is(err, deadlineErr(err)) {
		t.Fatalf("while cut the target read %q (%v)", b[:n], err)
	}
	// The other way is not cut.
	if _, err := target.Write([]byte("back")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, b[:4]); err != nil || string(b[:4]) != "back" {
		t.Fatalf("the uncut direction read %q, %v", b[:4], err)
	}
	if _, err := c.Write([]byte(" then")); err != nil {
		t.Fatal(err)
	}
	p.Heal(ClientToTarget)
	_ = target.SetReadDeadline(time.Now().Add(10 * time.Second))
	want := "held then"
	got := make([]byte, len(want))
	if _, err := io.ReadFull(target, got); err != nil || string(got) != want {
		t.Fatalf("after Heal the target read %q, %v; want %q", got, err, want)
	}
}

// deadlineErr returns err when it is a timeout (a read deadline passed),
// else a sentinel that errors.Is never matches.
func deadlineErr(err error) error {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return err
	}
	return errors.New("not a timeout")
}

// TestReset: a link that resets every chunk breaks the connection; so
// does Link.Reset, and the next connection is forwarded again.
func TestReset(t *testing.T) {
	t.Parallel()
	t.Run("shape", func(t *testing.T) {
		t.Parallel()
		p := listen(t, echoServer(t), NewLink(Shape{Reset: 1}, Shape{}))
		c := dial(t, p.Addr())
		if _, err := c.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		var b [1]byte
		if n, err := c.Read(b[:]); n != 0 || err == nil || errors.Is(deadlineErr(err), err) {
			t.Fatalf("read %d bytes, %v; want the connection broken", n, err)
		}
	})
	t.Run("Link.Reset", func(t *testing.T) {
		t.Parallel()
		p := listen(t, echoServer(t), nil)
		c := dial(t, p.Addr())
		roundTrip(t, c)
		p.Reset()
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		var b [1]byte
		if n, err := c.Read(b[:]); n != 0 || err == nil || errors.Is(deadlineErr(err), err) {
			t.Fatalf("read %d bytes, %v; want the connection broken", n, err)
		}
		roundTrip(t, dial(t, p.Addr()))
	})
	t.Run("SetDown", func(t *testing.T) {
		t.Parallel()
		p := listen(t, echoServer(t), nil)
		c := dial(t, p.Addr())
		roundTrip(t, c)
		p.SetDown(true)
		broken := func(c net.Conn) {
			t.Helper()
			_, _ = c.Write([]byte("x"))
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			var b [1]byte
			if n, err := c.Read(b[:]); n != 0 || err == nil || errors.Is(deadlineErr(err), err) {
				t.Fatalf("read %d bytes, %v; want the connection broken", n, err)
			}
		}
		broken(c)
		// A new connection is reset at once: as its connect, or as its
		// first read.
		if c2, err := net.Dial("tcp", p.Addr()); err == nil {
			t.Cleanup(func() { _ = c2.Close() })
			broken(c2)
		} else if !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("dial while down: %v, want the connection broken (reset)", err)
		}
		p.SetDown(false)
		roundTrip(t, dial(t, p.Addr()))
	})
}

// TestHalfClose: a client that closes its writing half still reads the
// target's answer, and the target sees the end of what it sent.
func TestHalfClose(t *testing.T) {
	t.Parallel()
	p := listen(t, echoServer(t), NewLink(Shape{Delay: 5 * time.Millisecond}, Shape{}))
	c := dial(t, p.Addr())
	if _, err := c.Write([]byte("bye")); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "bye" {
		t.Fatalf("read %q, %v; want %q then the end", got, err, "bye")
	}
	// Both directions ended: the proxy lets go of the connection.
	deadline := time.Now().Add(10 * time.Second)
	for p.Conns() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections still forwarded after both ends closed", p.Conns())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestCloseEndsGoroutines: Close ends every connection and goroutine of
// the proxy, bytes in flight, a cut direction and a stalled dial alike.
// Not parallel: it counts the process's goroutines.
func TestCloseEndsGoroutines(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	target := echoServer(t)
	p, err := Listen("127.0.0.1:0", target, NewLink(Shape{Delay: time.Second}, Shape{Delay: time.Second}))
	if err != nil {
		t.Fatal(err)
	}
	var conns []net.Conn
	for i := range 4 {
		c, err := net.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		if _, err := c.Write(make([]byte, 1<<16)); err != nil {
			t.Fatal(err)
		}
		if i == 2 {
			p.Cut(TargetToClient)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for p.Conns() != len(conns) {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections forwarded, want %d", p.Conns(), len(conns))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if n := p.Conns(); n != 0 {
		t.Errorf("%d connections still forwarded after Close", n)
	}
	for _, c := range conns {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadAll(c); err != nil && errors.Is(deadlineErr(err), err) {
			t.Errorf("a client's connection still open after Close: %v", err)
		}
		c.Close()
	}
	if _, err := net.DialTimeout("tcp", p.Addr(), time.Second); err == nil {
		t.Error("the proxy still accepts after Close")
	}
	// The echo server's goroutines end with the test's cleanup; the
	// proxy's must be gone now.
	if err := goleak.Find(ignore, goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreAnyFunction("github.com/limiterd/limiterd/internal/wanproxy.echoServer.func2"),
		goleak.IgnoreAnyFunction("github.com/limiterd/limiterd/internal/wanproxy.echoServer.func2.1")); err != nil {
		t.Error(err)
	}
}
