package redistest

import (
	"context"
	"sync"
	"testing"
)

// Pause stops the Redis server at addr from running writes and scripts
// (CLIENT PAUSE WRITE: PING, the handshake and CLIENT UNPAUSE still pass,
// which PAUSE ALL would hold too) until the returned function is called,
// 10 s at most; the test's end calls it too. The function may be called
// from another goroutine: a call while one is under way waits for it, so
// the test's end does not stop the server before an unpause sent from
// elsewhere has its reply.
func Pause(t testing.TB, addr string) (unpause func()) {
	t.Helper()
	ctx := context.Background()
	if _, err := command(ctx, addr, "client", "pause", "10000", "write"); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	unpause = func() {
		once.Do(func() {
			if _, err := command(ctx, addr, "client", "unpause"); err != nil {
				t.Error(err)
			}
		})
	}
	t.Cleanup(unpause)
	return unpause
}
