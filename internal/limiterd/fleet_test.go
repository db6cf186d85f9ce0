package limiterd

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

func fleetSize(t *testing.T, d *Daemon) float64 {
	t.Helper()
	for _, mf := range mustGather(t, d) {
		if mf.GetName() == "limiter_fleet_instances" {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("limiter_fleet_instances not exported")
	return 0
}

// TestFleetSharesTheFallback: with default flags, the instances of a region
// count each other through the store; when the store goes down, a
// fail-open rule's fallback gives each its share of the live count, so the
// region as a whole still admits about the limit, not one limit per
// instance. The count seen holds through the outage.
func TestFleetSharesTheFallback(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ds := []*Daemon{startDaemon(t, c.Addrs(), func(o *Options) { o.Region.Instance = "a" }),
		startDaemon(t, c.Addrs(), func(o *Options) { o.Region.Instance = "b" })}
	deadline := time.Now().Add(10 * time.Second)
	for fleetSize(t, ds[0]) != 2 || fleetSize(t, ds[1]) != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("fleet sizes %v and %v after 10 s, want 2 and 2", fleetSize(t, ds[0]), fleetSize(t, ds[1]))
		}
		time.Sleep(100 * time.Millisecond)
	}
	c.StopAll()
	ctx := context.Background()
	admitted := 0
	for _, d := range ds {
		client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
		for range 6 {
			resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "open", Key: "k"})
			if err != nil {
				t.Fatalf("fail-open rule: %v", err)
			}
			if resp.Allowed {
				admitted++
			}
		}
	}
	if admitted != 4 {
		t.Fatalf("two instances admitted %d of a fail-open limit of 4 with the store down, want 4 (2 each)", admitted)
	}
	if got := fleetSize(t, ds[0]); got != 2 {
		t.Errorf("fleet size %v during the outage, want the last count seen, 2", got)
	}
	if n, err := testutil.GatherAndCount(ds[0].Registry(), "limiter_fleet_heartbeat_errors_total"); err != nil || n != 1 {
		t.Errorf("limiter_fleet_heartbeat_errors_total: %d series, %v", n, err)
	}
}

// TestFleetCountsEachProcessStart: two instances under one name (two
// limiterd of one pod template given a fixed --instance, or of one process
// and host, whose default names are alike) are two members of the fleet,
// not one: counted as one, each would take the whole fail-open limit.
func TestFleetCountsEachProcessStart(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ds := []*Daemon{startDaemon(t, c.Addrs(), func(o *Options) { o.Region.Instance = "same" }),
		startDaemon(t, c.Addrs(), func(o *Options) { o.Region.Instance = "same" })}
	deadline := time.Now().Add(10 * time.Second)
	for fleetSize(t, ds[0]) != 2 || fleetSize(t, ds[1]) != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("fleet sizes %v and %v after 10 s of two instances named alike, want 2 and 2", fleetSize(t, ds[0]), fleetSize(t, ds[1]))
		}
		time.Sleep(100 * time.Millisecond)
	}
}
