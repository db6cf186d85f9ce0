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
