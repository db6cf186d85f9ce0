package bucket

import (
	"context"
	"math"
	"time"
)

// Undoer is a Store that can give back what it admitted, when the check the
// spend was part of was refused by a rule decided elsewhere (another
// region, another store). Undo gives back each request's Cost, spent at
// the instant at; it never gives back more than was spent, and gives back
// nothing of what has expired since.
type Undoer interface {
	Undo(ctx context.Context, reqs []Request, at time.Time) error
}

// Undo gives back amount, spent at the instant at (µs since the Unix
// epoch), to st at now:
//   - TokenBucket, GCRA: the state, read as a check reads it (clampDebt),
//     moves back by the spend of amount (the same whole ns a Take of
//     amount moved it); back to now or before, it is full (no state);
//   - SlidingWindow, FixedWindow: the count of the window at fell in goes
//     down by amount, never below 0, while that window still counts;
//   - SlidingLog: up to amount of the entries logged at exactly at go,
//     while at is still in the window (as undo.lua does).
func (l *Limit) Undo(st *State, now, at int64, amount float64) {
	switch l.Algorithm {
	case TokenBucket, GCRA:
		d := l.debt(st, now, spendNs(l.Capacity, l.RefillPerSecond))
		if d <= 0 {
			return
		}
		if d -= spendNs(amount, l.RefillPerSecond); d <= 0 {
			// Full: no state, as undo.lua deletes the key. Full "at now"
			// would read as a debt at a clock stepped back after it.
			st.a = 0
			return
		}
		st.a = instantAt(now, d)
	case SlidingWindow:
		switch at / l.windowMicros() {
		case st.a:
			st.b = math.Max(micro(micro(st.b)-amount), 0)
		case st.a - 1:
			st.c = math.Max(micro(micro(st.c)-amount), 0)
		}
	case FixedWindow:
		if at/l.windowMicros() == st.a {
			st.b = math.Max(micro(micro(st.b)-amount), 0)
		}
	case SlidingLog:
		if at <= now-l.windowMicros() {
			return
		}
		n := int(math.Floor(amount + 0.5))
		out := st.log[:0]
		for _, t := range st.log {
			if t == at && n > 0 {
				n--
				continue
			}
			out = append(out, t)
		}
		st.log = out
	}
}

// Undo gives back reqs spent at at; it never returns an error.
func (m *Memory) Undo(_ context.Context, reqs []Request, at time.Time) error {
	now, atUs := m.nowMicros(), at.UnixMicro()
	for _, r := range reqs {
		sh := m.shard(r.Key)
		sh.mu.Lock()
		id := bucketID{r.Rule, r.Key}
		if e := sh.buckets[id]; e != nil && e.expires > now {
			r.Limit.Undo(&e.st, now, atUs, r.Cost)
			e.expires = r.Limit.ExpiresAt(&e.st)
			m.put(sh, id, e, now)
		}
		sh.mu.Unlock()
	}
	return nil
}
