package limiterd

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"google.golang.org/grpc/metadata"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// TestGRPCStreamLimit: the gRPC listener tells every client the most
// streams it may open on one connection (one connection opening 100k
// streams once made 100k goroutines).
func TestGRPCStreamLimit(t *testing.T) {
	d := startDaemon(t, nil, func(o *Options) { o.Server.GRPCMaxStreams = 7 })
	c, err := net.DialTimeout("tcp", d.GRPCAddr(), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(c, c)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("no SETTINGS from the server: %v", err)
		}
		sf, ok := f.(*http2.SettingsFrame)
		if !ok || sf.IsAck() {
			continue
		}
		v, ok := sf.Value(http2.SettingMaxConcurrentStreams)
		if !ok || v != 7 {
			t.Fatalf("SETTINGS_MAX_CONCURRENT_STREAMS = %d (%v), want 7", v, ok)
		}
		return
	}
}

// TestHTTPConnectionsBounded: a request body trickled byte by byte is cut
// off at the read timeout, and past --server.max-connections a new
// connection waits until one closes, instead of taking a descriptor.
func TestHTTPConnectionsBounded(t *testing.T) {
	saved := httpTimeouts
	httpTimeouts.read, httpTimeouts.idle = 500*time.Millisecond, 500*time.Millisecond
	t.Cleanup(func() { httpTimeouts = saved })
	d := startDaemon(t, nil, func(o *Options) { o.Server.MaxConnections = 2 })

	slow, err := net.Dial("tcp", d.HTTPAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	fmt.Fprintf(slow, "PUT /admin/rules/x HTTP/1.1\r\nHost: l\r\nContent-Length: 1000\r\n\r\n")
	start := time.Now()
	closed := make(chan time.Duration, 1)
	go func() {
		buf := make([]byte, 1)
		for {
			if _, err := slow.Write([]byte("a")); err != nil {
				closed <- time.Since(start)
				return
			}
			time.Sleep(50 * time.Millisecond)
			slow.SetReadDeadline(time.Now().Add(time.Millisecond))
			if _, err := slow.Read(buf); err != nil && !isTimeout(err) {
				closed <- time.Since(start)
				return
			}
			if time.Since(start) > 10*time.Second {
				closed <- time.Since(start)
				return
			}
		}
	}()
	if took := <-closed; took > 5*time.Second {
		t.Fatalf("a trickled body held its connection for %v, want it cut at the 500 ms read timeout", took)
	}

	// Two connections held open (each made a request and stays idle for
	// less than the idle timeout), then a third.
	httpTimeouts.idle = 10 * time.Second
	d2 := startDaemon(t, nil, func(o *Options) { o.Server.MaxConnections = 2 })
	get := func(c net.Conn) error {
		fmt.Fprintf(c, "GET /healthz HTTP/1.1\r\nHost: l\r\n\r\n")
		c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	var held []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", d2.HTTPAddr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := get(c); err != nil {
			t.Fatalf("request on a held connection: %v", err)
		}
		held = append(held, c)
	}
	third, err := net.Dial("tcp", d2.HTTPAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer third.Close()
	if err := get(third); err == nil {
		t.Fatal("a third connection was served past --server.max-connections=2")
	}
	held[0].Close()
	third.SetReadDeadline(time.Now().Add(2 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(third), nil)
	if err != nil {
		t.Fatalf("the third connection, once one closed: %v", err)
	}
	resp.Body.Close()
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// TestGRPCHeaderBound: a call whose metadata is over 64 KiB is refused
// (grpc-go's own default is 16 MiB per stream), and the connection still
// serves the next call.
func TestGRPCHeaderBound(t *testing.T) {
	d := startDaemon(t, nil)
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	big := metadata.AppendToOutgoingContext(context.Background(), "x-padding", strings.Repeat("p", 100<<10))
	if _, err := client.Check(big, &limiterv1.CheckRequest{RuleId: "tb", Key: "k"}); err == nil {
		t.Fatal("a call with 100 KiB of metadata was served")
	} else {
		t.Logf("100 KiB of metadata: %v", err)
	}
	small := metadata.AppendToOutgoingContext(context.Background(), "x-padding", strings.Repeat("p", 30<<10))
	if _, err := client.Check(small, &limiterv1.CheckRequest{RuleId: "tb", Key: "k"}); err != nil {
		t.Fatalf("a call with 30 KiB of metadata: %v", err)
	}
}
