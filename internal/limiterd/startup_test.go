package limiterd

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

func readyz(t *testing.T, d *Daemon) (int, string) {
	t.Helper()
	resp, err := http.Get("http://" + d.HTTPAddr() + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestStartsWithoutItsDependencies: with Redis and NATS down, limiterd
// starts, is ready, says in /readyz what is missing, decides each rule by
// its on_failure, and uses the store as soon as it is back, by itself.
func TestStartsWithoutItsDependencies(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	nats := natstest.NewServer(t)
	c.StopAll()
	nats.Shutdown()
	d := startDaemon(t, c.Addrs(), func(o *Options) { o.NATS.URL = nats.URL() })
	code, body := readyz(t, d)
	if code != http.StatusOK || !strings.Contains(body, "store: redis not healthy") || !strings.Contains(body, "nats: unreachable") {
		t.Fatalf("/readyz = %d %q; want 200 naming the missing store and NATS", code, body)
	}
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	ctx := context.Background()
	resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "open", Key: "k"})
	if err != nil || !resp.GetAllowed() {
		t.Fatalf("fail-open rule without a store = %v, %v; want allowed by the fallback", resp, err)
	}
	if _, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "closed", Key: "k"}); status.Code(err) != codes.Unavailable {
		t.Fatalf("fail-closed rule without a store: %v, want Unavailable", err)
	}
	c.StartAll()
	c.WaitHealthy(t)
	nats.Restart(t)
	for deadline := time.Now().Add(20 * time.Second); ; {
		resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "closed", Key: "k"})
		if err == nil && resp.GetAllowed() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("fail-closed rule 20 s after the store came back: %v, %v", resp, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		_, body := readyz(t, d)
		if strings.Contains(body, "store: redis ok") && strings.Contains(body, "nats: ok") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz 10 s after both came back: %q", body)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
