package limiterd

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// TestLeaseBounds: two instances leasing batches of 5 from a 20-token
// bucket admit exactly 20 of 100 concurrent checks (every leased token is
// spent from the shared bucket first), with a fraction of the store calls.
func TestLeaseBounds(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	clients := []limiterv1.LimiterClient{
		limiterv1.NewLimiterClient(dial(t, startDaemon(t, c.Addrs()).GRPCAddr())),
		limiterv1.NewLimiterClient(dial(t, startDaemon(t, c.Addrs()).GRPCAddr())),
	}
	before := evalshaCalls(t, c.Addrs())
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for i := range 100 {
		wg.Go(func() {
			resp, err := clients[i%2].Check(context.Background(), &limiterv1.CheckRequest{RuleId: "leased", Key: "trusted"})
			if err != nil {
				t.Error(err)
				return
			}
			if resp.Allowed {
				admitted.Add(1)
			}
		})
	}
	wg.Wait()
	calls := evalshaCalls(t, c.Addrs()) - before
	t.Logf("100 checks: %d admitted, %d store calls", admitted.Load(), calls)
	if admitted.Load() != 20 {
		t.Fatalf("admitted %d, want exactly the capacity 20", admitted.Load())
	}
	if calls >= 60 {
		t.Fatalf("%d store calls for 100 checks: leasing saved little", calls)
	}
}

// TestLeaseRefund: tokens leased and not handed out go back to the shared
// bucket when the instance stops.
func TestLeaseRefund(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ctx := context.Background()
	first := startDaemon(t, c.Addrs())
	resp, err := limiterv1.NewLimiterClient(dial(t, first.GRPCAddr())).Check(ctx, &limiterv1.CheckRequest{RuleId: "leased", Key: "k"})
	if err != nil || !resp.Allowed || resp.Remaining != 19 {
		t.Fatalf("first check: %v, %v; want allowed with 19 left (15 shared + 4 leased)", resp, err)
	}
	if err := first.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	second := limiterv1.NewLimiterClient(dial(t, startDaemon(t, c.Addrs()).GRPCAddr()))
	resp, err = second.Check(ctx, &limiterv1.CheckRequest{RuleId: "leased", Key: "k", Cost: 19})
	if err != nil || !resp.Allowed {
		t.Fatalf("cost 19 after the refund: %v, %v; want allowed (the 4 leased tokens came back)", resp, err)
	}
	resp, err = second.Check(ctx, &limiterv1.CheckRequest{RuleId: "leased", Key: "k"})
	if err != nil || resp.Allowed {
		t.Fatalf("a 21st token: %v, %v; want refused", resp, err)
	}
}
