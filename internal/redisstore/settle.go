package redisstore

import (
	"context"
	"fmt"
	"strconv"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// SettleKey is the Redis key of the record of settlement id of the bucket
// of key: rl:{key}:~settle:id, in the bucket's slot.
func SettleKey(key, id string) string { return Key("~settle:"+id, key) }

// Settle settles a spend made as an estimate with its actual cost, once
// (bucket.Settler), with the settle script: the difference and the
// settlement's record are written in one call on the client's node. Its
// errors are the store's (a Settle again is safe: the record makes a
// second call that did apply answer as a replay).
func (s *Store) Settle(ctx context.Context, st bucket.Settlement) (bucket.Settled, error) {
	if err := bucket.ValidateSettlement(&st); err != nil {
		return bucket.Settled{}, err
	}
	if scriptIndex(st.Limit.Algorithm) < 0 {
		return bucket.Settled{}, fmt.Errorf("%w: no script for algorithm %q", bucket.ErrInvalidLimit, st.Limit.Algorithm)
	}
	key := Key(st.Rule, st.Key)
	a := scriptArgs(st.Limit, st.Cost)
	ttl := max(st.TTL.Milliseconds(), 1)
	res, err := s.eval(ctx, opSettle, key, pipeline.Call{Script: settleScript, Keys: []string{key, SettleKey(st.Key, st.ID)},
		Args: []any{string(st.Limit.Algorithm), a[0], a[1], a[2], strconv.FormatFloat(st.Actual, 'g', -1, 64),
			strconv.FormatInt(st.At, 10), strconv.FormatInt(ttl, 10), st.ID}}, s.m.settleDur)
	if err != nil {
		return bucket.Settled{}, fmt.Errorf("eval settle: %w", err)
	}
	return parseSettled(res)
}

// parseSettled reads the settle script's reply: {applied (0 or 1), actual}.
func parseSettled(res []any) (bucket.Settled, error) {
	if len(res) == 2 {
		n, ok1 := res[0].(int64)
		v, ok2 := res[1].(string)
		actual, err := strconv.ParseFloat(v, 64)
		if ok1 && ok2 && err == nil {
			return bucket.Settled{Actual: actual, Replay: n == 0}, nil
		}
	}
	return bucket.Settled{}, fmt.Errorf("eval settle: unexpected reply %v", res)
}
