package testenv

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

const (
	// natsReadyTimeout bounds the wait for a nats-server to accept clients.
	natsReadyTimeout = 10 * time.Second
	// natsRestartTimeout bounds Restart's retries to bind the old port.
	natsRestartTimeout = 10 * time.Second

	natsMaxMemory = 256 << 20 // JetStream memory storage limit
	natsMaxStore  = 1 << 30   // JetStream file storage limit
)

// NATSServer is an in-process nats-server with JetStream, started by NATS.
// Its port and JetStream store directory stay the same across Shutdown and
// Restart, so streams, their messages and durable consumers survive an
// outage.
//
// URL and Shutdown are safe for concurrent use; Restart fails the test it is
// given, so call it from that test's goroutine. A NATSServer is only made by
// this package.
type NATSServer struct {
	dir string

	mu   sync.Mutex
	port int
	srv  *server.Server // nil while shut down
}

// NATS starts a nats-server in the test process on a random loopback port,
// with JetStream storing in a fresh t.TempDir() (limits: 256 MiB of memory,
// 1 GiB of files), and shuts it down when the test ends.
func NATS(t testing.TB) *NATSServer {
	t.Helper()
	s := &NATSServer{dir: t.TempDir()}
	srv, err := s.run(-1)
	if err != nil {
		t.Fatalf("testenv: start nats-server: %v", err)
	}
	addr, ok := srv.Addr().(*net.TCPAddr)
	if !ok {
		srv.Shutdown()
		t.Fatalf("testenv: nats-server listens on unexpected address %v", srv.Addr())
	}
	s.srv, s.port = srv, addr.Port
	t.Cleanup(s.Shutdown)
	return s
}

// URL returns the client URL, "nats://127.0.0.1:port". It does not change
// across Shutdown and Restart.
func (s *NATSServer) URL() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return "nats://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// Shutdown stops the server and waits until it has stopped; clients see the
// connection drop. Shutting down a stopped server does nothing.
func (s *NATSServer) Shutdown() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv == nil {
		return
	}
	s.srv.Shutdown()
	s.srv.WaitForShutdown()
	s.srv = nil
}

// Restart shuts the server down if it is running and starts a new one on
// the same port with the same JetStream store directory, retrying for a
// while if the port is still busy. Clients that reconnect find their
// streams, messages and durable consumers again.
func (s *NATSServer) Restart(t testing.TB) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv != nil {
		s.srv.Shutdown()
		s.srv.WaitForShutdown()
		s.srv = nil
	}
	deadline := time.Now().Add(natsRestartTimeout)
	for {
		// A server that cannot bind waits out its whole ready timeout, so
		// check the port first.
		err := fmt.Errorf("port %d is busy", s.port)
		if canListen(s.port) {
			var srv *server.Server
			if srv, err = s.run(s.port); err == nil {
				s.srv = srv
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("testenv: restart nats-server on port %d: %v", s.port, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// run starts a server listening on port (-1 for a random one).
func (s *NATSServer) run(port int) (*server.Server, error) {
	srv, err := server.NewServer(&server.Options{
		ServerName:         "testenv",
		Host:               "127.0.0.1",
		Port:               port,
		NoLog:              true,
		NoSigs:             true,
		JetStream:          true,
		JetStreamMaxMemory: natsMaxMemory,
		JetStreamMaxStore:  natsMaxStore,
		StoreDir:           s.dir,
	})
	if err != nil {
		return nil, err
	}
	go srv.Start()
	if !srv.ReadyForConnections(natsReadyTimeout) {
		srv.Shutdown()
		srv.WaitForShutdown()
		return nil, fmt.Errorf("not ready for connections after %v", natsReadyTimeout)
	}
	if !srv.JetStreamEnabled() {
		srv.Shutdown()
		srv.WaitForShutdown()
		return nil, errors.New("jetstream is not enabled")
	}
	return srv, nil
}
