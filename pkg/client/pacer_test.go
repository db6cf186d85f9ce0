package client_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/pkg/client"
)

const pacerRules = `rules:
  - id: sms
    algorithm: gcra
    capacity: 1
    refill_per_second: 50
  - id: slow
    algorithm: gcra
    capacity: 1
    refill_per_second: 1
  - id: daily
    algorithm: fixed_window
    limit: 1000
    window: 24h
`

// embedded starts an in-process limiterd on its embedded store and
// returns its gRPC address and a stop function.
func embedded(rules string) (string, func(), error) {
	dir, err := os.MkdirTemp("", "pacer")
	if err != nil {
		return "", nil, err
	}
	file := filepath.Join(dir, "rules.yml")
	if err := os.WriteFile(file, []byte(rules), 0o600); err != nil {
		return "", nil, err
	}
	o := limiterd.DefaultOptions()
	o.Server.GRPCAddress, o.Server.HTTPAddress, o.Rules.File = "127.0.0.1:0", "127.0.0.1:0", file
	o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	d, err := limiterd.New(o)
	if err != nil {
		return "", nil, err
	}
	if err := d.Start(context.Background()); err != nil {
		return "", nil, err
	}
	return d.GRPCAddr(), func() { d.Stop(context.Background()); os.RemoveAll(dir) }, nil
}

// ExamplePacer sends SMS at a provider's rate of 50 per second, for the
// whole fleet: every process that paces on the rule "sms" with the same key
// shares the rate.
func ExamplePacer() {
	addr, stop, err := embedded(pacerRules)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()
	c, err := client.New(addr, client.WithTimeout(time.Second))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer c.Close()

	p := client.NewPacer(c, "sms", "provider:acme", client.PacerOptions{MaxWait: 2 * time.Second})
	ctx := context.Background()
	start := time.Now()
	sent := 0
	for range 11 {
		if err := p.Wait(ctx); err != nil {
			fmt.Println(err)
			return
		}
		sent++ // send one SMS here
	}
	// 11 sends at 50/s: the first at once, then one every 20 ms.
	fmt.Println("sent", sent, "in at least 200ms:", time.Since(start) >= 200*time.Millisecond)
	// Output: sent 11 in at least 200ms: true
}

func startEmbedded(t *testing.T) *client.Client {
	t.Helper()
	addr, stop, err := embedded(pacerRules)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return newClient(t, addr, client.WithTimeout(5*time.Second))
}

// TestPacerCancelGivesBack: a Wait cancelled during its sleep gives its
// slot back when no reservation is stacked behind it (the next caller
// gets it sooner), and not when one is.
func TestPacerCancelGivesBack(t *testing.T) {
	c := startEmbedded(t)
	ctx := context.Background()
	p := client.NewPacer(c, "slow", "k", client.PacerOptions{MaxWait: 5 * time.Second})
	if err := p.Wait(ctx); err != nil { // the full bucket: at once
		t.Fatal(err)
	}
	// The next slot is 1 s out; cancelled after 100 ms, it comes back.
	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	if err := p.Wait(cctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("cancelled Wait: %v", err)
	}
	cancel()
	resp, err := c.CheckPaced(ctx, "slow", "k", 1, 5*time.Second)
	if err != nil || !resp.GetAllowed() || resp.GetWaitMs() > 1000 {
		t.Fatalf("after a cancelled Wait: %v %v, want the given-back slot (< 1s)", resp, err)
	}
	// That reservation (slot ~1 s) has one stacked behind it (~2 s):
	// cancelling the first gives nothing back.
	behind, err := c.CheckPaced(ctx, "slow", "k", 1, 5*time.Second)
	if err != nil || !behind.GetAllowed() {
		t.Fatal(behind, err)
	}
	if back, err := c.CancelReservation(ctx, resp.GetReservation()); err != nil || back {
		t.Fatalf("stacked: given back %v, %v", back, err)
	}
	next, err := c.CheckPaced(ctx, "slow", "k", 1, 5*time.Second)
	if err != nil || next.GetWaitMs() <= 2000 {
		t.Fatalf("after a stacked cancel: %v %v, want the slot after the stacked one (> 2s)", next, err)
	}
}

// TestPacerRetriesBeyondItsWait: a queue longer than one check's wait is
// waited out by checking again when the refusal says.
func TestPacerRetriesBeyondItsWait(t *testing.T) {
	c := startEmbedded(t)
	ctx := context.Background()
	for range 3 { // slots at 0, 1 s, 2 s
		if resp, err := c.CheckPaced(ctx, "slow", "q", 1, 5*time.Second); err != nil || !resp.GetAllowed() {
			t.Fatal(resp, err)
		}
	}
	p := client.NewPacer(c, "slow", "q", client.PacerOptions{MaxWait: 500 * time.Millisecond})
	start := time.Now()
	if err := p.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 2900*time.Millisecond {
		t.Fatalf("Wait returned after %v, before its slot (3 s)", d)
	}
}

// TestPaceErrorsNameTheField: a wait out of bounds or on a window rule is
// INVALID_ARGUMENT naming max_wait_ms.
func TestPaceErrorsNameTheField(t *testing.T) {
	c := startEmbedded(t)
	ctx := context.Background()
	for _, tc := range []struct {
		rule string
		wait time.Duration
	}{{"daily", time.Second}, {"slow", 11 * time.Second}} {
		_, err := c.CheckPaced(ctx, tc.rule, "k", 1, tc.wait)
		// The message names the field (the status carries no field of its own).
		if st, _ := status.FromError(err); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "max_wait_ms") {
			t.Fatalf("%s %v: %v, want INVALID_ARGUMENT naming max_wait_ms", tc.rule, tc.wait, err)
		}
	}
}
