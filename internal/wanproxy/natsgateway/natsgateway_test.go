package natsgateway

import (
	"bufio"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/limiterd/limiterd/internal/wanproxy"
)

func TestCluster(t *testing.T) {
	for _, tt := range []struct {
		name, line, want string
	}{
		{"gateway", `CONNECT {"echo":false,"verbose":false,"pedantic":false,"tls_required":false,"name":"X","gateway":"eu-west"}` + "\r\n", "eu-west"},
		{"client", `CONNECT {"verbose":false,"name":"app"}` + "\r\n", ""},
		{"not json", "CONNECT {\r\n", ""},
		{"not connect", "PING\r\n", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := Cluster(tt.line); got != tt.want {
				t.Errorf("Cluster(%q) = %q, want %q", tt.line, got, tt.want)
			}
		})
	}
}

// fakeGateway speaks first, as a NATS server's gateway port does (an INFO
// line), then echoes what it reads.
func fakeGateway(t *testing.T) string {
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
				if _, err := io.WriteString(c, "INFO {\"gateway\":\"us-east\"}\r\n"); err != nil {
					return
				}
				_, _ = io.Copy(c, c)
			})
		}
	})
	return lis.Addr().String()
}

// dialAs connects through the proxy as a server of cluster from: INFO
// read, CONNECT sent.
func dialAs(t *testing.T, addr, from string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "INFO ") {
		t.Fatalf("first line %q, %v; want the server's INFO", line, err)
	}
	if _, err := io.WriteString(c, `CONNECT {"gateway":"`+from+`"}`+"\r\n"); err != nil {
		t.Fatal(err)
	}
	// The echo of CONNECT: it reached the server, over the link.
	if line, err := br.ReadString('\n'); err != nil || Cluster(line) != from {
		t.Fatalf("echo %q, %v; want the CONNECT back", line, err)
	}
	return c, br
}

// TestPerCluster: each dialing cluster's connection takes its own link's
// delay; an unknown cluster's is refused.
func TestPerCluster(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	const margin = 150 * time.Millisecond
	delays := map[string]time.Duration{"eu-west": 40 * time.Millisecond, "ap-south": 110 * time.Millisecond}
	links := map[string]*wanproxy.Link{}
	for from, d := range delays {
		links[from] = wanproxy.NewLink(wanproxy.Shape{Delay: d}, wanproxy.Shape{Delay: d})
	}
	target := fakeGateway(t)
	p, err := Listen("127.0.0.1:0", target, func(from string) *wanproxy.Link { return links[from] })
	if err != nil {
		t.Fatal(err)
	}
	for from, d := range delays {
		c, br := dialAs(t, p.Addr(), from)
		start := time.Now()
		if _, err := io.WriteString(c, "PING\r\n"); err != nil {
			t.Fatal(err)
		}
		if line, err := br.ReadString('\n'); err != nil || line != "PING\r\n" {
			t.Fatalf("%s: echo %q, %v", from, line, err)
		}
		if rtt := time.Since(start); rtt < 2*d || rtt > 2*d+margin {
			t.Errorf("%s: round trip %v, want [%v, %v]", from, rtt, 2*d, 2*d+margin)
		}
		if links[from].Conns() != 1 {
			t.Errorf("%s: its link carries %d connections, want 1", from, links[from].Conns())
		}
	}
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(c, `CONNECT {"gateway":"nowhere"}`+"\r\n"); err != nil {
		t.Fatal(err)
	}
	if line, err := br.ReadString('\n'); err == nil {
		t.Errorf("a cluster without a link got %q, want the connection closed", line)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	for from, l := range links {
		if n := l.Conns(); n != 0 {
			t.Errorf("%s: %d connections still carried after Close", from, n)
		}
	}
	// The fake server's goroutines end with the test's cleanup; the
	// proxy's must be gone now.
	if err := goleak.Find(ignore, goleak.IgnoreAnyFunction("github.com/limiterd/limiterd/internal/wanproxy/natsgateway.fakeGateway.func2"),
		goleak.IgnoreAnyFunction("github.com/limiterd/limiterd/internal/wanproxy/natsgateway.fakeGateway.func2.1")); err != nil {
		t.Error(err)
	}
}
