package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// Errors of a call, besides bucket.ErrOverloaded and
// bucket.ErrOutcomeUnknown. Each means the request was not applied: nothing
// was sent, or Redis answered with an error. Callers test them with errors.Is.
var (
	// ErrBreakerOpen: the circuit breaker of the request's node is open
	// (the node was shown unhealthy), so nothing was sent.
	ErrBreakerOpen = errors.New("redis node circuit breaker open")
	// ErrNotConnected: the store has not reached Redis yet (no node
	// answered since New, so the slot map or the server's mode is unknown).
	// It keeps trying in the background; see Nodes.Health.
	ErrNotConnected = errors.New("redis store not connected")
	// ErrNodeStalled: the request waited in its node's queue past the cap
	// while every pipeline to that node was waiting for its replies and
	// none came (a paused or stuck node): the store failed, not limiterd,
	// and nothing was sent, so the caller's failure policy decides.
	ErrNodeStalled = errors.New("redis node stalled")
)

// failure says what a failed store call means for the request.
type failure int

const (
	// notApplied: nothing ran (never sent, or Redis answered an error).
	notApplied failure = iota
	// overloaded: never sent, because it waited in limiterd's own queue
	// (or for a connection of the pool) past its deadline or the cap.
	overloaded
	// unknown: written to Redis, and no reply came: it may have run.
	unknown
)

// wrap returns err wrapped so that errors.Is finds what f means.
func (f failure) wrap(addr string, err error) error {
	switch f {
	case overloaded:
		return fmt.Errorf("%w: redis %s: %w", bucket.ErrOverloaded, addr, err)
	case unknown:
		return fmt.Errorf("%w: redis %s: %w", bucket.ErrOutcomeUnknown, addr, err)
	}
	return fmt.Errorf("redis %s: %w", addr, err)
}

// isReply reports an error that is Redis's answer (NOSCRIPT, MOVED,
// CLUSTERDOWN, OOM, a script's error...): the command was read and refused,
// so it did not run, and the connection is fine.
func isReply(err error) bool {
	var rerr redis.Error
	return errors.As(err, &rerr)
}

// isDialError reports a failure to open a connection (refused, no route,
// the dial timeout): nothing was sent.
func isDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// isConnectionError reports an error that shows the node or the path to it
// is down, rather than slow: a dial that failed, or a connection the other
// end closed or reset. The breaker opens on a few of these in a row.
func isConnectionError(err error) bool {
	if isDialError(err) {
		return true
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE) {
		return true
	}
	var nerr net.Error
	return errors.As(err, &nerr) && !nerr.Timeout()
}

// classifyPooled says what err means for a command sent through a node's
// pooled client (Options.NoCoalesce, redirects). That client has no context
// deadline on its sockets: the context bounds only the wait for a
// connection of the pool and the dial, and the store timeout applies from
// the write. p tells whether this call opened a connection and whether its
// handshake completed.
func classifyPooled(err error, p *connPhase) failure {
	switch {
	case isReply(err):
		return notApplied
	case p.dialed.Load() && !p.connected.Load():
		// The connection this call opened failed before the command
		// could be written (in the dial or the handshake).
		return notApplied
	case isDialError(err), errors.Is(err, redis.ErrClosed):
		return notApplied
	case errors.Is(err, redis.ErrPoolTimeout), errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		// Waited for a connection of the pool: limiterd's own queue.
		return overloaded
	}
	return unknown
}
