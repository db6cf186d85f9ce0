package client_test

import (
	"context"
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
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/client"
)

// tokenRules limits each tenant to 10,000 LLM tokens a minute.
const tokenRules = `rules:
  - id: llm-tokens
    algorithm: token_bucket
    capacity: 10000
    refill_per_second: 166.67
    settle_within: 5m
`

// complete stands for a call to a language model: the tokens a response
// uses are known only once it is done.
func complete(prompt string) (answer string, tokens float64) {
	return "...", float64(len(prompt)) + 250
}

// ExampleClient_Settle limits an LLM gateway's tenants in tokens per
// minute: each request spends an estimate before the model is called, and
// settles it with the tokens the response used.
func ExampleClient_Settle() {
	addr, stop, err := embedded(tokenRules)
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
	ctx := context.Background()

	prompt := "Summarise the attached contract in three bullet points."
	// Before the call: the prompt's tokens and the most the answer may use.
	resp, err := c.CheckEstimate(ctx, "llm-tokens", "tenant:acme", float64(len(prompt))+1000)
	if err != nil || !resp.GetAllowed() {
		fmt.Println("refused:", resp.GetRetryAfterMs(), err)
		return
	}
	fmt.Println("left after the estimate:", resp.GetRemaining() < 9000)

	_, used := complete(prompt)
	// After it: what it used. The unused part of the estimate comes back.
	s, err := c.Settle(ctx, resp.GetSettlement(), used)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("settled:", s.GetSettled(), "estimate", s.GetEstimate(), "actual", s.GetActualCost())
	u, err := c.Usage(ctx, "llm-tokens", "tenant:acme", 1)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("left after the settle:", u.GetRemaining() > 9600)
	// Output:
	// left after the estimate: true
	// settled: true estimate 1055 actual 305
	// left after the settle: true
}

// TestSettleAgainstLimiterd: through a real limiterd on a Redis Cluster, a
// settle gives back, a replay changes nothing, and a tampered settlement,
// a bad actual cost and a check by attributes are INVALID_ARGUMENT naming
// the field.
func TestSettleAgainstLimiterd(t *testing.T) {
	cluster := redistest.NewCluster(t, 3, 0)
	rules := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(rules, []byte(tokenRules), 0o600); err != nil {
		t.Fatal(err)
	}
	o := limiterd.DefaultOptions()
	o.Server.GRPCAddress, o.Server.HTTPAddress, o.Rules.File = "127.0.0.1:0", "127.0.0.1:0", rules
	o.Redis.Addrs, o.RedisTuning.Timeout = cluster.Addrs(), time.Second
	o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	d, err := limiterd.New(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop(context.Background()) })
	c := newClient(t, d.GRPCAddr(), client.WithTimeout(5*time.Second))
	ctx := context.Background()

	resp, err := c.CheckEstimate(ctx, "llm-tokens", "t", 8000)
	if err != nil || !resp.GetAllowed() || resp.GetSettlement() == "" {
		t.Fatalf("CheckEstimate = %v, %v", resp, err)
	}
	if r, err := c.Check(ctx, "llm-tokens", "t", 5000); err != nil || r.GetAllowed() {
		t.Fatalf("5000 more before the settle: %v, %v; want refused", r, err)
	}
	tampered := strings.Replace(resp.GetSettlement(), ".8000.", ".80000.", 1)
	for _, tc := range []struct {
		name, settlement, field string
		actual                  float64
	}{
		{"tampered", tampered, "settlement", 1000},
		{"negative", resp.GetSettlement(), "actual_cost", -1},
	} {
		_, err := c.Settle(ctx, tc.settlement, tc.actual)
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s: %v; want INVALID_ARGUMENT naming %s", tc.name, err, tc.field)
		}
	}
	s, err := c.Settle(ctx, resp.GetSettlement(), 1000)
	if err != nil || !s.GetSettled() || s.GetReplay() || s.GetEstimate() != 8000 || s.GetActualCost() != 1000 {
		t.Fatalf("Settle = %v, %v", s, err)
	}
	s, err = c.Settle(ctx, resp.GetSettlement(), 9000)
	if err != nil || !s.GetReplay() || s.GetActualCost() != 1000 {
		t.Fatalf("replay = %v, %v; want a replay of 1000", s, err)
	}
	if r, err := c.Check(ctx, "llm-tokens", "t", 5000); err != nil || !r.GetAllowed() {
		t.Fatalf("5000 more after the settle: %v, %v; want allowed (7000 given back)", r, err)
	}
}
