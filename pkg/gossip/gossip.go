// Package gossip records the tokens a region admits and carries them to the
// other regions: the accumulator limiterd fills on every admitted check, the
// wire format (gossipv1.SpendBatch) with its size-bounded split and its
// validation, and the names of the JetStream streams and subjects.
package gossip

import (
	"errors"
	"fmt"
	"math"
	"regexp"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// Defaults shared by limiterd and the reconciler.
const (
	// DefaultInterval is how often spends are flushed and published.
	DefaultInterval = time.Second
	// MinInterval is the shortest interval allowed.
	MinInterval = 100 * time.Millisecond
	// DefaultMaxMessageBytes bounds one encoded SpendBatch.
	DefaultMaxMessageBytes = 256 << 10
	// MaxSpendsPerBatch bounds the entries of one SpendBatch.
	MaxSpendsPerBatch = 20_000
	// MaxKeyLen is the longest key a spend may carry, as in a check.
	MaxKeyLen = 512
	// MaxCost bounds one entry's cost, and a give-back's (a negative
	// cost): a larger one is a corrupt message.
	MaxCost = 1e15
)

// Stream and subject names. Each region's limiterd instances publish their
// flushes to its local stream; its reconcilers relay them, one to one, to the
// region's spends stream, in the region's own JetStream cluster; every other
// region sources that stream into its inbound stream, in its own cluster,
// and applies what arrives there.
const (
	// RegionStreamPrefix + REGION (upper case) is a region's spends stream.
	RegionStreamPrefix = "LIMITER_SPENDS_"
	// RelaySubjectPrefix + region + "." + partition is the subject of a
	// partition of a region's relayed spends, held by its spends stream
	// (PartitionSubject).
	RelaySubjectPrefix = "limiter.relay."
	// InStreamPrefix + REGION is the stream a region applies from: every
	// other region's spends stream, sourced.
	InStreamPrefix = "LIMITER_IN_"
	// RetryStreamPrefix + REGION holds the debits a region could not apply
	// yet (their Redis node down), to apply again.
	RetryStreamPrefix = "LIMITER_RETRY_"
	// RetrySubjectPrefix + region + "." + source + "." + bucket is the
	// subject of one of those debits.
	RetrySubjectPrefix = "limiter.retry."
	// LocalStreamPrefix + REGION (upper case) is a region's local stream.
	LocalStreamPrefix = "LIMITER_LOCAL_"
	// LocalSubjectPrefix + region is the subject limiterd publishes to.
	LocalSubjectPrefix = "limiter.local."
	// ApplyBucketPrefix + REGION is the key-value bucket of a region's
	// reconcilers: which one applies each partition of the other regions'
	// spends.
	ApplyBucketPrefix = "LIMITER_APPLY_"
)

// LocalSubject is the subject of region's limiterd flushes.
func LocalSubject(region string) string { return LocalSubjectPrefix + region }

// LocalStream is the name of region's local stream.
func LocalStream(region string) string { return LocalStreamPrefix + upper(region) }

// RegionStream is the name of region's spends stream.
func RegionStream(region string) string { return RegionStreamPrefix + upper(region) }

// InStream is the name of the stream region applies from.
func InStream(region string) string { return InStreamPrefix + upper(region) }

// RetryStream is the name of region's stream of debits to apply again.
func RetryStream(region string) string { return RetryStreamPrefix + upper(region) }

// ApplyBucket is the name of region's bucket of apply leases.
func ApplyBucket(region string) string { return ApplyBucketPrefix + upper(region) }

// RetrySubjects is the subject filter of self's debits from src to apply
// again.
func RetrySubjects(self, src string) string { return RetrySubjectPrefix + self + "." + src + ".>" }

// upper is region as a stream name part: upper case, '_' for '-'.
func upper(region string) string {
	b := []byte(region)
	for i, c := range b {
		switch {
		case c >= 'a' && c <= 'z':
			b[i] = c - 'a' + 'A'
		case c == '-':
			b[i] = '_'
		}
	}
	return string(b)
}

// ErrInvalidBatch wraps every reason a received batch is refused.
var ErrInvalidBatch = errors.New("invalid spend batch")

var (
	ruleIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$`)
	regionPattern = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,62}$`)
)

// Spend is the cost admitted under Rule for Key. Reset says the key was
// put back to full before that cost was admitted: the applying region puts
// its bucket back to full, then debits Cost (which may then be 0). A
// negative cost is what settlements gave back of the estimates admitted
// (see Accumulator.Add).
type Spend struct {
	Rule  string
	Key   string
	Cost  float64
	Reset bool
	// Last is the instant (µs since the epoch) of the last admission of
	// Cost (or of the reset): the applying region debits Cost as of then.
	// 0 is unknown, the flush's own instant.
	Last int64
}

// MaxAdmittedBeforeFlush is the longest a spend's last admission may lie
// before its flush (Spend.last_admitted_ms_before_flush): longer holds go
// out as this, later than they were, which only debits them more.
const MaxAdmittedBeforeFlush = time.Hour

// Accumulator sums the cost admitted per (rule, key) between two drains.
// A key whose sum reaches the budget given with its spends (its rule's
// max_overshoot × capacity) is hot: Hot signals it, and DrainHot takes the
// hot keys alone, for the publisher to send them before the interval.
// DrainDue leaves the keys still under their budget waiting, for a bounded
// number of drains, so that a quiet key costs one message in several
// intervals rather than one in each.
// It is safe for concurrent use; the zero value is ready and bounds no keys.
type Accumulator struct {
	// MaxKeys, when above 0, is the number of waiting keys at which the
	// accumulator is full: Full reports it and Hot signals it, for the
	// publisher to drain every key early. A key is never refused: Add
	// records it past the bound too. Set it before the first Add.
	MaxKeys int

	mu sync.Mutex
	// idx is each waiting key's entry in ents; an entry taken by DrainHot
	// stays in ents, emptied (cost 0), until the next drain.
	idx  map[spendID]int32
	ents []pending
	// hot are the entries, in ents, that reached their budget since they
	// were last taken.
	hot  []int32
	hotc chan struct{}
	full bool
}

type spendID struct{ rule, key string }

type pending struct {
	id     spendID
	cost   float64
	budget float64
	first  int64
	last   int64
	// held counts the drains (DrainDue) the entry was left waiting by.
	held int32
	hot  bool
	// reset: the key was reset before cost was admitted.
	reset bool
	// rate and full pace the entry (see AddPaced): full is the instant
	// (µs) a bucket of rate tokens a second, full before the entry's
	// first spend, is full again after its spends; unpaced says an add
	// had no rate, another rate or a cost not above 0.
	rate    float64
	full    float64
	unpaced bool
}

// taken reports whether e was taken by DrainHot (an emptied entry left in
// ents until the next drain).
func (e *pending) taken() bool { return e.cost == 0 && !e.reset }

func (e *pending) spend() Spend {
	return Spend{Rule: e.id.rule, Key: e.id.key, Cost: e.cost, Reset: e.reset, Last: e.paced()}
}

// paced is the instant the entry goes out as of: its last admission, or
// for a paced entry the instant as of which spending its whole cost at
// once leaves the bucket full again when its spends did, one by one, at
// their own instants: full - cost/rate, never after the last admission.
func (e *pending) paced() int64 {
	if e.unpaced || e.rate <= 0 || e.cost <= 0 {
		return e.last
	}
	return min(int64(math.Ceil(e.full-e.cost/e.rate*1e6)), e.last)
}

// Add records cost admitted under rule for key at now (µs since the epoch).
// A negative cost is a settlement's give-back: it lowers the sum, which
// goes out negative when the estimate went out before it.
// Once the key's sum since it was last taken reaches budget (> 0; 0 never
// does), the key is hot until it is taken.
func (a *Accumulator) Add(rule, key string, cost, budget float64, now int64) {
	a.AddPaced(rule, key, cost, budget, 0, now)
}

// AddPaced is Add for a rule whose bucket refills at rate tokens a second
// (a token bucket or GCRA; 0 for another algorithm, as Add). The entry
// then goes out as of an instant between its first and last admission
// (Spend.Last): spent at once as of then, its cost leaves a full bucket
// where the spends, each at its own instant, left it. A client that spends
// slowly leaves a debit that refills sooner where it is applied, often
// one that refilled before it arrived and writes nothing.
//
// It never debits less than the spends made: for a bucket in any state,
// spending the cost as of that instant ends at least as low as spending
// each part at its own instant (pkg/bucket's TestPacedDebitBounds). An
// entry whose adds are not all paced alike (rate 0 or another rate, or a
// cost not above 0) goes out as of its last admission.
func (a *Accumulator) AddPaced(rule, key string, cost, budget, rate float64, now int64) {
	id := spendID{rule, key}
	a.mu.Lock()
	i, ok := a.idx[id]
	if !ok {
		if a.idx == nil {
			a.idx = make(map[spendID]int32)
		}
		i = int32(len(a.ents))
		a.idx[id] = i
		a.ents = append(a.ents, pending{id: id, first: now})
		if a.MaxKeys > 0 && !a.full && len(a.idx) >= a.MaxKeys {
			a.full = true
			a.signal()
		}
	}
	e := &a.ents[i]
	if now < e.first {
		e.first = now
	}
	e.last = max(e.last, now)
	switch {
	case e.unpaced:
	case rate <= 0 || cost <= 0 || (e.rate != 0 && e.rate != rate):
		e.unpaced = true
	default:
		// The instants may come a little out of order from concurrent
		// checks: folded out of order, full only ends later.
		e.rate = rate
		e.full = max(e.full, float64(now)) + cost/rate*1e6
	}
	e.cost += cost
	e.budget = budget
	if !e.hot && budget > 0 && e.cost >= budget {
		e.hot = true
		a.hot = append(a.hot, i)
		if len(a.hot) == 1 {
			a.signal()
		}
	}
	a.mu.Unlock()
}

// Reset records that the key of rule was put back to full at now (µs
// since the epoch): the key's sum waiting is dropped (its cost was
// admitted before the reset, which forgives it), and the key's next entry
// carries the reset, then the cost admitted after it. The key is hot at
// once, so the reset goes out within the publisher's hot delay rather
// than at the next interval; it is never held.
func (a *Accumulator) Reset(rule, key string, now int64) {
	id := spendID{rule, key}
	a.mu.Lock()
	defer a.mu.Unlock()
	i, ok := a.idx[id]
	if !ok {
		if a.idx == nil {
			a.idx = make(map[spendID]int32)
		}
		i = int32(len(a.ents))
		a.idx[id] = i
		a.ents = append(a.ents, pending{id: id})
	}
	e := &a.ents[i]
	e.cost, e.reset, e.first, e.last = 0, true, now, now
	e.rate, e.full, e.unpaced = 0, 0, false
	if !e.hot {
		e.hot = true
		a.hot = append(a.hot, i)
		if len(a.hot) == 1 {
			a.signal()
		}
	}
}

// signal wakes the Hot channel's reader, if it is not awake already.
// a.mu is held.
func (a *Accumulator) signal() {
	if a.hotc == nil {
		return
	}
	select {
	case a.hotc <- struct{}{}:
	default:
	}
}

// Hot returns a channel that receives a value when a key becomes hot and
// no other was waiting to be taken by DrainHot, and when the accumulator
// becomes full.
func (a *Accumulator) Hot() <-chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.hotc == nil {
		a.hotc = make(chan struct{}, 1)
	}
	return a.hotc
}

// Full reports whether MaxKeys keys are waiting: the next drain should be
// Drain, of every key.
func (a *Accumulator) Full() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.full
}

// Drain returns the sums since the last drain and the earliest admission
// among them, and starts afresh.
func (a *Accumulator) Drain() (spends []Spend, first int64) {
	a.mu.Lock()
	ents := a.ents
	a.idx, a.ents, a.hot, a.full = nil, nil, a.hot[:0], false
	a.mu.Unlock()
	spends = make([]Spend, 0, len(ents))
	for _, e := range ents {
		if e.taken() {
			continue
		}
		spends = append(spends, e.spend())
		if first == 0 || e.first < first {
			first = e.first
		}
	}
	return spends, first
}

// DrainDue is Drain but for the keys still under their budget (> 0) that
// have waited fewer than drains-1 earlier DrainDue calls: those keep
// waiting, and more spends add to them. So a key waits at most drains
// calls, and a key with no budget or at it waits for none. A key left
// waiting counts as first admitted at now (µs), the time it was due: the
// message that finally takes it reports the lag from there, not the hold.
// drains ≤ 1 is Drain.
func (a *Accumulator) DrainDue(drains int, now int64) (spends []Spend, first int64) {
	if drains <= 1 {
		return a.Drain()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	spends = make([]Spend, 0, len(a.ents))
	kept := a.ents[:0]
	for _, e := range a.ents {
		switch {
		case e.taken():
			continue
		case !e.reset && e.budget > 0 && e.cost < e.budget && int(e.held)+1 < drains:
			e.held++
			e.first = now
			a.idx[e.id] = int32(len(kept))
			kept = append(kept, e)
			continue
		}
		delete(a.idx, e.id)
		spends = append(spends, e.spend())
		if first == 0 || e.first < first {
			first = e.first
		}
	}
	clear(a.ents[len(kept):]) // drop the taken keys' strings
	a.ents, a.hot = kept, a.hot[:0]
	a.full = a.MaxKeys > 0 && len(a.idx) >= a.MaxKeys
	return spends, first
}

// DrainHot takes the hot keys' sums alone, as Drain does, and leaves the
// others waiting.
func (a *Accumulator) DrainHot() (spends []Spend, first int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.hot) == 0 {
		return nil, 0
	}
	spends = make([]Spend, 0, len(a.hot))
	for _, i := range a.hot {
		e := &a.ents[i]
		spends = append(spends, e.spend())
		if first == 0 || e.first < first {
			first = e.first
		}
		delete(a.idx, e.id)
		*e = pending{}
	}
	a.hot = a.hot[:0]
	return spends, first
}

// Len is the number of (rule, key) pairs waiting.
func (a *Accumulator) Len() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.idx)
}

// Header is what every part of one flush shares.
type Header struct {
	Region, Instance string
	Sequence         uint64
	FirstAdmitted    int64
	Flushed          int64
}

// Split encodes spends as SpendBatch messages of at most maxBytes each
// (and MaxSpendsPerBatch entries), in order. An empty flush makes no message.
func Split(h Header, spends []Spend, maxBytes int) ([][]byte, error) {
	if len(spends) == 0 {
		return nil, nil
	}
	var parts []*gossipv1.SpendBatch
	cur := newBatch(h)
	// The header's size, with room for the part counters.
	size := proto.Size(cur) + 16
	for _, s := range spends {
		e := &gossipv1.Spend{RuleId: s.Rule, Key: s.Key, Cost: s.Cost, ResetBefore: s.Reset, LastAdmittedMsBeforeFlush: beforeFlush(s.Last, h.Flushed)}
		n := proto.Size(e) + 4 // field tag and length prefix
		if n+proto.Size(newBatch(h))+16 > maxBytes {
			return nil, fmt.Errorf("spend of rule %q, key of %d bytes, does not fit in %d bytes", s.Rule, len(s.Key), maxBytes)
		}
		if len(cur.Spends) > 0 && (size+n > maxBytes || len(cur.Spends) >= MaxSpendsPerBatch) {
			parts = append(parts, cur)
			cur = newBatch(h)
			size = proto.Size(cur) + 16
		}
		cur.Spends = append(cur.Spends, e)
		size += n
	}
	parts = append(parts, cur)
	out := make([][]byte, len(parts))
	for i, p := range parts {
		p.Part, p.Parts = uint32(i), uint32(len(parts))
		b, err := proto.Marshal(p)
		if err != nil {
			return nil, err
		}
		out[i] = b
	}
	return out, nil
}

// beforeFlush is how long before flushed (µs) the instant last is, in
// whole ms rounded down (so the applying region reads it no earlier than
// it was), at most MaxAdmittedBeforeFlush; 0 when last is unknown or not
// before the flush.
func beforeFlush(last, flushed int64) uint32 {
	if last <= 0 || last >= flushed {
		return 0
	}
	return uint32(min((flushed-last)/1000, MaxAdmittedBeforeFlush.Milliseconds()))
}

// LastAdmitted is the instant (µs since the epoch) of the last admission
// of entry s of a batch flushed at flushed (µs), as its publisher read its
// clock.
func LastAdmitted(s *gossipv1.Spend, flushed int64) int64 {
	return flushed - int64(s.GetLastAdmittedMsBeforeFlush())*1000
}

func newBatch(h Header) *gossipv1.SpendBatch {
	return &gossipv1.SpendBatch{
		Region: h.Region, Instance: h.Instance, Sequence: h.Sequence,
		FirstAdmittedUnixMicros: h.FirstAdmitted, FlushedUnixMicros: h.Flushed,
	}
}

// Decode parses and validates a received batch of at most maxBytes, every
// entry included: one invalid entry refuses the batch. Errors wrap
// ErrInvalidBatch and name the field at fault.
func Decode(data []byte, maxBytes int) (*gossipv1.SpendBatch, error) {
	b, bad, err := DecodeEntries(data, maxBytes)
	if err != nil {
		return nil, err
	}
	if len(bad) > 0 {
		return nil, bad[0]
	}
	return b, nil
}

// DecodeEntries parses a received batch of at most maxBytes and validates
// its header (an error refuses the whole batch) and each entry on its own:
// an invalid entry is taken out of the batch's spends and reported in bad,
// one error per entry naming its index and field, and the others stay. The
// wire format is Decode's. Errors wrap ErrInvalidBatch.
func DecodeEntries(data []byte, maxBytes int) (b *gossipv1.SpendBatch, bad []error, err error) {
	if b, err = decodeHeader(data, maxBytes); err != nil {
		return nil, nil, err
	}
	good := b.Spends[:0]
	// A batch holds few rules and many keys: the rule id of the entry
	// before, valid, is not matched again.
	rule := ""
	for i, s := range b.GetSpends() {
		if s.GetRuleId() == rule && rule != "" {
			if err := validateEntry(i, s); err != nil {
				bad = append(bad, err)
				continue
			}
		} else if err := ValidateSpend(i, s); err != nil {
			bad = append(bad, err)
			continue
		}
		rule = s.GetRuleId()
		good = append(good, s)
	}
	b.Spends = good
	return b, bad, nil
}

// Validate checks every field of a batch from another process.
func Validate(b *gossipv1.SpendBatch) error {
	if err := ValidateHeader(b); err != nil {
		return err
	}
	for i, s := range b.GetSpends() {
		if err := ValidateSpend(i, s); err != nil {
			return err
		}
	}
	return nil
}

// ValidateHeader checks the fields of a batch that its entries share, and
// its number of entries.
func ValidateHeader(b *gossipv1.SpendBatch) error {
	switch {
	case !regionPattern.MatchString(b.GetRegion()):
		return fmt.Errorf("%w: region: %q is not a region name", ErrInvalidBatch, b.GetRegion())
	case b.GetInstance() == "" || len(b.GetInstance()) > 128:
		return fmt.Errorf("%w: instance: must be 1 to 128 bytes", ErrInvalidBatch)
	case b.GetParts() == 0 || b.GetPart() >= b.GetParts():
		return fmt.Errorf("%w: part: %d of %d", ErrInvalidBatch, b.GetPart(), b.GetParts())
	case b.GetFirstAdmittedUnixMicros() <= 0 || b.GetFlushedUnixMicros() <= 0:
		return fmt.Errorf("%w: first_admitted_unix_micros, flushed_unix_micros: must be set", ErrInvalidBatch)
	case len(b.GetSpends()) == 0 || len(b.GetSpends()) > MaxSpendsPerBatch:
		return fmt.Errorf("%w: spends: %d entries, want 1 to %d", ErrInvalidBatch, len(b.GetSpends()), MaxSpendsPerBatch)
	}
	return nil
}

// ValidateSpend checks entry i of a batch.
func ValidateSpend(i int, s *gossipv1.Spend) error {
	if !ruleIDPattern.MatchString(s.GetRuleId()) {
		return fmt.Errorf("%w: spends[%d].rule_id: %q is not a rule id", ErrInvalidBatch, i, s.GetRuleId())
	}
	return validateEntry(i, s)
}

// validateEntry checks entry i's fields but its rule id.
func validateEntry(i int, s *gossipv1.Spend) error {
	switch {
	case s.GetKey() == "" || len(s.GetKey()) > MaxKeyLen:
		return fmt.Errorf("%w: spends[%d].key: must be 1 to %d bytes", ErrInvalidBatch, i, MaxKeyLen)
	case int64(s.GetLastAdmittedMsBeforeFlush()) > MaxAdmittedBeforeFlush.Milliseconds():
		return fmt.Errorf("%w: spends[%d].last_admitted_ms_before_flush: %d is above %d", ErrInvalidBatch, i, s.GetLastAdmittedMsBeforeFlush(), MaxAdmittedBeforeFlush.Milliseconds())
	case s.GetResetBefore() && s.GetCost() == 0:
		return nil // a reset with nothing admitted after it
	case s.GetCost() == 0 || !(math.Abs(s.GetCost()) <= MaxCost):
		return fmt.Errorf("%w: spends[%d].cost: %v is not in [-%g, 0) or (0, %g]", ErrInvalidBatch, i, s.GetCost(), MaxCost, MaxCost)
	}
	return nil
}

// DecodeHeader reads a batch of at most maxBytes and validates its header;
// its entries are not checked (each applying region checks them). Errors
// wrap ErrInvalidBatch.
func DecodeHeader(data []byte, maxBytes int) (*gossipv1.SpendBatch, error) {
	return decodeHeader(data, maxBytes)
}

// decodeHeader is DecodeHeader.
func decodeHeader(data []byte, maxBytes int) (*gossipv1.SpendBatch, error) {
	if len(data) > maxBytes {
		return nil, fmt.Errorf("%w: %d bytes, the maximum is %d", ErrInvalidBatch, len(data), maxBytes)
	}
	b := new(gossipv1.SpendBatch)
	if err := proto.Unmarshal(data, b); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidBatch, err)
	}
	if err := ValidateHeader(b); err != nil {
		return nil, err
	}
	return b, nil
}
