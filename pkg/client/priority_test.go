package client_test

import (
	"context"
	"testing"

	"github.com/limiterd/limiterd/pkg/client"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// TestWithPriority: the class a context carries goes with every check
// made with it; none without.
func TestWithPriority(t *testing.T) {
	f := &fakeLimiter{}
	c := newClient(t, serveFake(t, f))
	ctx := client.WithPriority(context.Background(), "sheddable")
	if _, err := c.Check(ctx, "r", "k", 1); err != nil {
		t.Fatal(err)
	}
	if _, req := f.last(); req.GetPriority() != "sheddable" {
		t.Fatalf("Check sent priority %q, want sheddable", req.GetPriority())
	}
	if _, err := c.CheckAttributes(ctx, &limiterv1.Attributes{User: "u"}, 1); err != nil {
		t.Fatal(err)
	}
	if _, req := f.last(); req.GetPriority() != "sheddable" {
		t.Fatalf("CheckAttributes sent priority %q, want sheddable", req.GetPriority())
	}
	if _, err := c.Check(context.Background(), "r", "k", 1); err != nil {
		t.Fatal(err)
	}
	if _, req := f.last(); req.GetPriority() != "" {
		t.Fatalf("a check without a class sent %q", req.GetPriority())
	}
}

// acquireFake records the Acquires it answers.
type acquireFake struct {
	fakeLimiter
	acquires []*limiterv1.AcquireRequest
}

func (f *acquireFake) Acquire(_ context.Context, req *limiterv1.AcquireRequest) (*limiterv1.AcquireResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.acquires = append(f.acquires, req)
	return &limiterv1.AcquireResponse{Allowed: true, LeaseId: "id"}, nil
}

// TestWithPriorityAcquire: the class a context carries goes with its
// Acquires too, by rule and by attributes; none without.
func TestWithPriorityAcquire(t *testing.T) {
	f := &acquireFake{}
	c := newClient(t, serveFake(t, f))
	ctx := client.WithPriority(context.Background(), "critical")
	if _, err := c.Acquire(ctx, "r", "k"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.AcquireAttributes(ctx, &limiterv1.Attributes{Path: "/x"}, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Acquire(context.Background(), "r", "k"); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.acquires) != 3 {
		t.Fatalf("%d acquires", len(f.acquires))
	}
	for i, want := range []string{"critical", "critical", ""} {
		if got := f.acquires[i].GetPriority(); got != want {
			t.Errorf("Acquire %d sent priority %q, want %q", i, got, want)
		}
	}
}
