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

// TestUndoAcrossBoundary: an all-or-nothing check spends in one window, and
// its undo runs after a window boundary. The undo gives back to the window
// the spend counted in (reported by the multi script), and nothing when that
// window is gone; it never takes from the window of another request.
func TestUndoAcrossBoundary(t *testing.T) {
	client := nodeClient(t)
	ctx := context.Background()
	multi := redis.NewScript(lua.Multi(lua.FixedClock))
	undo := redis.NewScript(lua.Undo(lua.FixedClock))
	const ms = int64(time.Millisecond / time.Microsecond)
	const w = 1000 * ms
	// base is the start of a window of w, ahead of the real clock so real
	// expiry never removes what the fake one still needs.
	base := (time.Now().UnixMicro()/w + 1) * w

	type op struct {
		at   int64 // µs after base
		cost float64
		// spend: a check of its own (a multi script of one bucket);
		// undo: give back the spend of the check numbered undo-1.
		undo    int
		allowed bool
	}
	tests := []struct {
		name string
		lim  bucket.Limit
		ops  []op
	}{
		{
			name: "fixed window: the spent window is gone",
			lim:  bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 2, Window: time.Second},
			ops: []op{
				{at: w - 1, cost: 1, allowed: true},      // window 0
				{at: w + 1, cost: 2, allowed: true},      // window 1, full
				{at: w + 2, undo: 1},                     // window 0 is gone: nothing
				{at: w + 3, cost: 1, allowed: false},     // window 1 still full
				{at: 2*w - 1, cost: 0.5, allowed: false}, // and stays full
			},
		},
		{
			name: "fixed window: the spent window is current",
			lim:  bucket.Limit{Algorithm: bucket.FixedWindow, Capacity: 2, Window: time.Second},
			ops: []op{
				{at: 1, cost: 2, allowed: true},
				{at: 2, undo: 1},
				{at: 3, cost: 2, allowed: true},
			},
		},
		{
			name: "sliding window: the spent window became the previous one",
			lim:  bucket.Limit{Algorithm: bucket.SlidingWindow, Capacity: 4, Window: time.Second},
			ops: []op{
				{at: w - 1, cost: 1, allowed: true}, // window 0: cur 1
				{at: w + 1, cost: 3, allowed: true}, // window 1: cur 3, prev 1
				{at: w + 2, undo: 1},                // prev 1 -> 0, cur stays 3
				// Window 2, f ~ 0.01: the previous window (1) holds 3,
				// weighed 0.99: 2.97 + 1.5 > 4.
				{at: 2*w + 10*ms, cost: 1.5, allowed: false},
				{at: 2*w + 10*ms, cost: 1, allowed: true},
			},
		},
		{
			name: "sliding window: the spent window is gone",
			lim:  bucket.Limit{Algorithm: bucket.SlidingWindow, Capacity: 4, Window: time.Second},
			ops: []op{
				{at: 1, cost: 1, allowed: true},          // window 0
				{at: 2*w + 1, cost: 4, allowed: true},    // window 2
				{at: 2*w + 2, undo: 1},                   // window 0 is gone: nothing
				{at: 2*w + 3, cost: 0.5, allowed: false}, // window 2 still full
			},
		},
		{
			name: "sliding log: the spend's own entry goes, not the newest",
			lim:  bucket.Limit{Algorithm: bucket.SlidingLog, Capacity: 3, Window: time.Second},
			ops: []op{
				{at: 0, cost: 1, allowed: true},
				{at: 500 * ms, cost: 1, allowed: true},
				{at: 500*ms + 1, undo: 1},
				// The entry at 500 ms is still in the window: 1 + 3 > 3.
				{at: w + 1, cost: 3, allowed: false},
				{at: w + 1, cost: 2, allowed: true},
			},
		},
		{
			name: "sliding log: the spend left the window",
			lim:  bucket.Limit{Algorithm: bucket.SlidingLog, Capacity: 2, Window: time.Second},
			ops: []op{
				{at: 0, cost: 1, allowed: true},
				{at: w + 1, cost: 2, allowed: true},
				{at: w + 2, undo: 1}, // its entry was trimmed: nothing
				{at: w + 3, cost: 1, allowed: false},
			},
		},
		{
			name: "token bucket",
			lim:  bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 2, RefillPerSecond: 0.001},
			ops: []op{
				{at: 0, cost: 1, allowed: true},
				{at: 10 * w, cost: 1, allowed: true},
				{at: 10*w + 1, undo: 1},
				{at: 10*w + 2, cost: 1, allowed: true},
				{at: 10*w + 3, cost: 1, allowed: false},
			},
		},
	}
	for ti, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := bucket.Request{Rule: "undo" + strconv.Itoa(ti), Key: "client", Limit: tt.lim}
			var spends []int64
			for i, o := range tt.ops {
				now := strconv.FormatInt(base+o.at, 10)
				if o.undo > 0 {
					keys, args := groupArgs([]bucket.Request{{Rule: req.Rule, Key: req.Key, Limit: tt.lim, Cost: tt.ops[o.undo-1].cost}})
					argv := append(undoArgs(spends[o.undo-1], args), now)
					if err := undo.Run(ctx, client, keys, argv...).Err(); err != nil {
						t.Fatalf("op %d: undo: %v", i, err)
					}
					spends = append(spends, 0)
					continue
				}
				r := req
				r.Cost = o.cost
				keys, args := groupArgs([]bucket.Request{r})
				res, err := multi.Run(ctx, client, keys, append(multiArgs([]bucket.Request{r}, args), now)...).Slice()
				if err != nil {
					t.Fatalf("op %d: %v", i, err)
				}
				ds, at, err := parseMultiReply(res, []bucket.Request{r})
				if err != nil {
					t.Fatalf("op %d: %v", i, err)
				}
				if at != base+o.at {
					t.Fatalf("op %d: multi reports it spent at %d, want %d", i, at, base+o.at)
				}
				if ds[0].Allowed != o.allowed {
					t.Fatalf("op %d at +%dµs cost %v: %+v, want allowed=%v", i, o.at, o.cost, ds[0], o.allowed)
				}
				spends = append(spends, at)
			}
		})
	}
}
