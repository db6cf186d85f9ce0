package bucket

import (
	"context"
	"fmt"
	"math"
	"time"
)

// Settler is a Store that settles a spend made as an estimate with the cost
// it turned out to have, once: the first Settle of an ID applies the
// difference and records the actual cost for TTL; every later Settle of
// that ID, while the record lasts, changes nothing and answers with the
// recorded cost.
type Settler interface {
	Settle(ctx context.Context, s Settlement) (Settled, error)
}

// Settlement is a spend to settle: Request names the bucket, its Limit and
// the estimate spent (Cost), spent at the store's instant At (µs since the
// Unix epoch, the Decision's At). Actual is what it cost (finite, >= 0).
// ID names the settlement (at most MaxSettlementID bytes); its record is
// kept for TTL.
type Settlement struct {
	Request
	At     int64
	Actual float64
	ID     string
	TTL    time.Duration
}

// Settled is what a Settle did: Actual is the cost settled, the first
// Settle's for a Replay.
type Settled struct {
	Actual float64
	Replay bool
}

// MaxSettlementID bounds Settlement.ID.
const MaxSettlementID = 64

// MaxSettlementRecords bounds the settlements a Memory remembers: while
// that many are within their TTL, a Settle of a new one fails with
// ErrOverloaded (nothing changes; it may be sent again).
const MaxSettlementRecords = 1 << 20

// ValidateSettlement reports, wrapping ErrInvalidCost, an Actual that is
// negative, NaN or infinite, and an ID that is empty or too long.
func ValidateSettlement(s *Settlement) error {
	if !(s.Actual >= 0) || math.IsInf(s.Actual, 0) {
		return fmt.Errorf("%w: actual cost must be finite and >= 0, got %v", ErrInvalidCost, s.Actual)
	}
	if s.ID == "" || len(s.ID) > MaxSettlementID {
		return fmt.Errorf("settlement id must be 1 to %d bytes, got %d", MaxSettlementID, len(s.ID))
	}
	return nil
}

// Settle applies the difference between actual and estimate, spent at at
// (µs), to st at now: an actual below the estimate gives back the
// difference as Undo does (never more than was spent, nothing of a window
// gone since), one above it spends the extra as Debit does (into debt, up
// to the same bound). It mirrors settle.lua.
func (l *Limit) Settle(st *State, now, at int64, estimate, actual float64) {
	switch d := actual - estimate; {
	case d < 0:
		l.Undo(st, now, at, -d)
	case d > 0:
		l.Debit(st, now, d)
	}
}

// Credit gives back amount at now that another region reported as given
// back by a settlement (a negative spend): what Undo of a spend at now
// does, and for a SlidingLog up to amount of the latest entries go. It
// never gives back below a full bucket or an empty window. It mirrors the
// credit of debit_client.lua.
func (l *Limit) Credit(st *State, now int64, amount float64) {
	if !(amount > 0) {
		return
	}
	if l.Algorithm != SlidingLog {
		l.Undo(st, now, now, amount)
		return
	}
	st.trimLog(now - l.windowMicros())
	n := min(int(math.Floor(amount+0.5)), len(st.log))
	st.log = st.log[:len(st.log)-n]
}

// settleID names a settlement's record: an id names one within its key,
// as the Redis store keeps it in the key's slot.
type settleID struct{ key, id string }

type settleRecord struct {
	actual  float64
	expires int64 // µs
}

// Settle settles s once (see Settler). It fails only with ErrOverloaded,
// when MaxSettlementRecords are remembered, or for an invalid s.
func (m *Memory) Settle(_ context.Context, s Settlement) (Settled, error) {
	if err := ValidateSettlement(&s); err != nil {
		return Settled{}, err
	}
	now := m.nowMicros()
	sh := m.shard(s.Key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	sid := settleID{s.Key, s.ID}
	if r, ok := sh.settled[sid]; ok && r.expires > now {
		return Settled{Actual: r.actual, Replay: true}, nil
	}
	if len(sh.settled) >= MaxSettlementRecords/memoryShards {
		sh.sweepSettled(now)
		if len(sh.settled) >= MaxSettlementRecords/memoryShards {
			return Settled{}, fmt.Errorf("settle: %d settlements remembered: %w", MaxSettlementRecords, ErrOverloaded)
		}
	}
	id := bucketID{s.Rule, s.Key}
	e := sh.buckets[id]
	if e != nil && e.expires <= now {
		e.st = State{log: e.st.log[:0]}
	}
	if e == nil {
		e = &memoryEntry{}
	}
	if s.Actual != s.Cost {
		s.Limit.Settle(&e.st, now, s.At, s.Cost, s.Actual)
		e.expires = s.Limit.ExpiresAt(&e.st)
		if e.expires > now {
			m.put(sh, id, e, now)
		} else if sh.buckets[id] == e {
			sh.drop(id, e)
		}
	}
	if sh.settled == nil {
		sh.settled = make(map[settleID]settleRecord)
	}
	sh.settled[sid] = settleRecord{actual: s.Actual, expires: now + s.TTL.Microseconds()}
	return Settled{Actual: s.Actual}, nil
}

// sweepSettled forgets the settlements past their TTL.
func (sh *memoryShard) sweepSettled(now int64) {
	for id, r := range sh.settled {
		if r.expires <= now {
			delete(sh.settled, id)
		}
	}
}
