package limiterd

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/testenv/natstest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// BenchmarkAdminPut768 puts 768 rules one by one through the admin API of
// one limiterd, a second limiterd of the region watching, and reports the
// time until the last one is in force on the second one:
//
//	go test -run '^$' -bench AdminPut768 -benchtime 1x ./internal/limiterd
func BenchmarkAdminPut768(b *testing.B) {
	const n = 768
	ns := natstest.NewServer(b)
	tokenFile := filepath.Join(b.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(adminToken), 0o600); err != nil {
		b.Fatal(err)
	}
	withAdmin := func(o *Options) {
		o.NATS.URL, o.Admin.TokenFile = ns.URL(), tokenFile
	}
	a := startDaemon(b, nil, withAdmin)
	w := startDaemon(b, nil, withAdmin)
	adminA := limiterv1.NewAdminClient(dial(b, a.GRPCAddr()))
	clientW := limiterv1.NewLimiterClient(dial(b, w.GRPCAddr()))
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+adminToken)
	b.ResetTimer()
	for iter := range b.N {
		start := time.Now()
		for i := range n {
			rule := fmt.Sprintf("id: r%d-%d\ncapacity: 10\nrefill_per_second: 1\n", iter, i)
			if _, err := adminA.PutRule(ctx, &limiterv1.PutRuleRequest{Rule: rule}); err != nil {
				b.Fatalf("put %d: %v", i, err)
			}
		}
		putsDone := time.Since(start)
		last := fmt.Sprintf("r%d-%d", iter, n-1)
		for {
			_, err := clientW.Check(context.Background(), &limiterv1.CheckRequest{RuleId: last, Key: "probe"})
			if status.Code(err) != codes.NotFound {
				break
			}
			if time.Since(start) > 5*time.Minute {
				b.Fatalf("rule %s not in force after 5m", last)
			}
			time.Sleep(5 * time.Millisecond)
		}
		took := time.Since(start)
		b.ReportMetric(took.Seconds(), "s/768puts")
		b.Logf("%d rules put one by one in %v, the last in force on the other limiterd after %v", n, putsDone, took)
		// Delete them again so that every iteration starts from the file's rules.
		b.StopTimer()
		for i := range n {
			if _, err := adminA.DeleteRule(ctx, &limiterv1.DeleteRuleRequest{Id: fmt.Sprintf("r%d-%d", iter, i)}); err != nil {
				b.Fatalf("delete %d: %v", i, err)
			}
		}
		b.StartTimer()
	}
}
