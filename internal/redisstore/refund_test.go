package redisstore

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// TestRefundAfterLoweredCapacity: a lease refunded after the rule's capacity
// was lowered gives its tokens back to the bucket as checks read it (at most
// capacity + rate*DebtHorizon of debt), not to the part of the old state no
// check sees.
func TestRefundAfterLoweredCapacity(t *testing.T) {
	client := nodeClient(t)
	ctx := context.Background()
	refund := redis.NewScript(lua.Refund(lua.FixedClock))
	const sec = int64(time.Second / time.Microsecond)
	for _, alg := range []bucket.Algorithm{bucket.TokenBucket, bucket.GCRA} {
		t.Run(string(alg), func(t *testing.T) {
			src, err := lua.Single(string(alg), lua.FixedClock)
			if err != nil {
				t.Fatal(err)
			}
			take := redis.NewScript(src)
			old := bucket.Limit{Algorithm: alg, Capacity: 1000, RefillPerSecond: 1}
			lowered := bucket.Limit{Algorithm: alg, Capacity: 10, RefillPerSecond: 1}
			key := Key("refund-"+string(alg), "client")
			now := time.Now().UnixMicro()
			run := func(lim bucket.Limit, cost float64, at int64) bucket.Decision {
				t.Helper()
				a := scriptArgs(lim, cost)
				res, err := take.Run(ctx, client, []string{key}, a[0], a[1], a[2], strconv.FormatInt(at, 10)).Slice()
				if err != nil {
					t.Fatal(err)
				}
				d, err := parseDecision(res, lim)
				if err != nil {
					t.Fatal(err)
				}
				return d
			}
			if d := run(old, 1000, now); !d.Allowed {
				t.Fatalf("drain: %+v", d)
			}
			// A lease of 5 goes back 1 s after the change: 10 + 1*10 tokens
			// of debt become 15.
			argv := append(refundArgs(lowered, 5), strconv.FormatInt(now+sec, 10))
			if err := refund.Run(ctx, client, []string{key}, argv...).Err(); err != nil {
				t.Fatal(err)
			}
			if d := run(lowered, 1, now+sec); d.Allowed || d.RetryAfter != 16*time.Second {
				t.Fatalf("after the refund: %+v, want refused for 16 s (15 tokens of debt)", d)
			}
		})
	}
}
