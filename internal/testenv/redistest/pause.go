package redistest

import (
	"context"
	"testing"
)

// Pause stops the Redis server at addr from running writes and scripts
// (CLIENT PAUSE WRITE: PING, the handshake and CLIENT UNPAUSE still pass,
// which PAUSE ALL would hold too) until the returned function is called,
// 10 s at most; the test's end calls it too.
func Pause(t testing.TB, addr string) (unpause func()) {
	t.Helper()
	ctx := context.Background()
	if _, err := command(ctx, addr, "client", "pause", "10000", "write"); err != nil {
		t.Fatal(err)
	}
	done := false
	unpause = func() {
		if done {
			return
		}
		done = true
		if _, err := command(ctx, addr, "client", "unpause"); err != nil {
			t.Error(err)
		}
	}
	t.Cleanup(unpause)
	return unpause
}
