package reconciler

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// settle checks cost of the quota for key in region as an estimate, and
// returns its settlement.
func (s *stack) settleCheck(region, key string, cost float64) string {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := s.regions[region].client.Check(ctx, &limiterv1.CheckRequest{RuleId: "quota", Key: key, Cost: cost, Settle: true})
	if err != nil || !resp.GetAllowed() || resp.GetSettlement() == "" {
		s.t.Fatalf("%s: %v, %v", region, resp, err)
	}
	return resp.GetSettlement()
}

// settle settles settlement in region with actual.
func (s *stack) settle(region, settlement string, actual float64) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := s.regions[region].client.Settle(ctx, &limiterv1.SettleRequest{Settlement: settlement, ActualCost: actual})
	if err != nil || !resp.GetSettled() || resp.GetReplay() {
		s.t.Fatalf("settle in %s: %v, %v", region, resp, err)
	}
}

// settleTo waits until every region counts want for key, then makes sure
// it stays there.
func (s *stack) settleTo(key string, want float64) {
	s.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var got []string
		ok := true
		for _, name := range s.names {
			n := s.count(name, key)
			ok = ok && n == want
			got = append(got, fmt.Sprintf("%s %v", name, n))
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("after 30s: %s; want %v", strings.Join(got, ", "), want)
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(3 * s.interval)
	for _, name := range s.names {
		if n := s.count(name, key); n != want {
			s.t.Fatalf("%s counts %v for %s after converging on %v", name, n, key, want)
		}
	}
}

// TestSettleAcrossRegions: a check's estimate settled in one region
// leaves every region counting the settled cost, not the estimate: a
// give-back after the estimate went out (a negative spend), an extra, and
// an estimate settled before it went out; a replayed Settle changes
// nothing anywhere.
func TestSettleAcrossRegions(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)

	back := s.settleCheck("us-east", "back", 100)
	s.settleTo("back", 100)
	s.settle("us-east", back, 30)
	s.settleTo("back", 30)

	extra := s.settleCheck("eu-west", "extra", 10)
	s.settleTo("extra", 10)
	s.settle("eu-west", extra, 45)
	s.settleTo("extra", 45)

	at := s.settleCheck("us-east", "at-once", 80)
	s.settle("us-east", at, 5)
	s.settleTo("at-once", 5)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := s.regions["us-east"].client.Settle(ctx, &limiterv1.SettleRequest{Settlement: back, ActualCost: 0})
	if err != nil || !resp.GetReplay() || resp.GetActualCost() != 30 {
		t.Fatalf("replay: %v, %v; want a replay of 30", resp, err)
	}
	s.settleTo("back", 30)
}
