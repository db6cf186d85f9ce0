// Package topkeys keeps, per rule, the keys refused most often: a
// space-saving summary of a bounded number of counters per rule, over a
// sliding pair of windows.
//
// A space-saving summary of k counters over a stream of n refusals keeps
// every key refused more than n/k times, and for each key it reports a
// count c and an error e with c-e <= refusals <= c. When the summary is
// full, a new key takes the counter of the least counted one and inherits
// its count as error. Keys hash to one of Shards summaries, each with its
// own lock and k/Shards counters: no key is in two, so the union of their
// tops is exact, and the error of each stays n_shard/(k/Shards), about n/k.
//
// Counts cover the current window and the one before it (Window each):
// what a key was refused in the last one to two minutes.
package topkeys

import (
	"cmp"
	"hash/maphash"
	"slices"
	"sync"
	"time"
)

// Window is how long a window counts for; a summary covers the current
// one and the one before.
const Window = time.Minute

// Shards is the number of summaries per rule.
const Shards = 4

// DefaultSize is the counters per rule unless New says otherwise;
// MaxSize is the most New accepts.
const (
	DefaultSize = 64
	MaxSize     = 4096
)

// EntryBytes bounds the memory of one counter besides its key: the
// counter, its map entry and its heap slot.
const EntryBytes = 112

// Entry is a key's count: it was refused between Count-Error and Count
// times over the windows.
type Entry struct {
	Key          string
	Count, Error uint64
}

// Tracker keeps the summaries of every rule. The zero value is not
// usable; make one with New. A Tracker is safe for concurrent use; a nil
// Tracker records nothing and reports nothing.
type Tracker struct {
	size int // counters per rule
	seed maphash.Seed

	// rules holds a *rule per rule id: read on every refusal, written
	// once per rule.
	rules sync.Map
}

type rule struct{ shards [Shards]shard }

// shard is one summary of a rule, over two windows.
type shard struct {
	mu sync.Mutex
	// start is the start of the current window (Unix ns); cur counts it,
	// prev the window before it.
	start     int64
	cur, prev summary
}

// New makes a tracker of size counters per rule (0: DefaultSize; < 0:
// nil, off). Memory per rule that refused anything is at most size ×
// (EntryBytes + the key's bytes) × 2 windows.
func New(size int) *Tracker {
	switch {
	case size < 0:
		return nil
	case size == 0:
		size = DefaultSize
	}
	size = min(max(size, Shards), MaxSize)
	return &Tracker{size: size, seed: maphash.MakeSeed()}
}

// Size is the counters per rule.
func (t *Tracker) Size() int {
	if t == nil {
		return 0
	}
	return t.size
}

// Add counts n refusals of key under ruleID at now (Unix ns).
func (t *Tracker) Add(ruleID, key string, n uint64, now int64) {
	if t == nil {
		return
	}
	v, ok := t.rules.Load(ruleID)
	if !ok {
		v, _ = t.rules.LoadOrStore(ruleID, &rule{})
	}
	sh := &v.(*rule).shards[maphash.String(t.seed, key)%Shards]
	sh.mu.Lock()
	sh.roll(now)
	sh.cur.add(key, n, t.size/Shards)
	sh.mu.Unlock()
}

// Top returns the k keys of ruleID refused most over the windows before
// now, most first (ties by key); nil when it refused none.
func (t *Tracker) Top(ruleID string, k int, now int64) []Entry {
	if t == nil {
		return nil
	}
	v, ok := t.rules.Load(ruleID)
	if !ok {
		return nil
	}
	r := v.(*rule)
	var all []Entry
	for i := range r.shards {
		sh := &r.shards[i]
		sh.mu.Lock()
		sh.roll(now)
		all = append(all, Merge(t.size/Shards, sh.cur.entries(), sh.prev.entries())...)
		sh.mu.Unlock()
	}
	return trim(all, k)
}

// Rules returns the rules that refused a key in the windows before now.
func (t *Tracker) Rules(now int64) []string {
	if t == nil {
		return nil
	}
	var ids []string
	for id, v := range t.rules.Range {
		r := v.(*rule)
		for i := range r.shards {
			sh := &r.shards[i]
			sh.mu.Lock()
			sh.roll(now)
			live := len(sh.cur.heap)+len(sh.prev.heap) > 0
			sh.mu.Unlock()
			if live {
				ids = append(ids, id.(string))
				break
			}
		}
	}
	slices.Sort(ids)
	return ids
}

// Forget drops the summaries of the rules not in keep (rules removed).
func (t *Tracker) Forget(keep func(ruleID string) bool) {
	if t == nil {
		return
	}
	for id := range t.rules.Range {
		if !keep(id.(string)) {
			t.rules.Delete(id)
		}
	}
}

// roll moves the shard's windows on to the one now falls in.
func (sh *shard) roll(now int64) {
	w := int64(Window)
	switch {
	case sh.start == 0:
		sh.start = now - now%w
	case now-sh.start >= 2*w:
		sh.cur.reset()
		sh.prev.reset()
		sh.start = now - now%w
	case now-sh.start >= w:
		sh.prev, sh.cur = sh.cur, sh.prev
		sh.cur.reset()
		sh.start += w
	}
}

// summary is one space-saving summary: counters in a min-heap by count,
// and each key's counter.
type summary struct {
	heap []*counter
	at   map[string]*counter
}

type counter struct {
	Entry
	i int // in heap
}

func (s *summary) reset() {
	s.heap = s.heap[:0]
	clear(s.at)
}

func (s *summary) add(key string, n uint64, size int) {
	if c, ok := s.at[key]; ok {
		c.Count += n
		s.down(c.i)
		return
	}
	if s.at == nil {
		s.at = make(map[string]*counter, size)
	}
	if len(s.heap) < size {
		c := &counter{Entry: Entry{Key: key, Count: n}, i: len(s.heap)}
		s.heap = append(s.heap, c)
		s.at[key] = c
		s.up(c.i)
		return
	}
	// Full: the least counted key gives its counter up; the new key
	// inherits its count, as its error.
	c := s.heap[0]
	delete(s.at, c.Key)
	c.Entry = Entry{Key: key, Count: c.Count + n, Error: c.Count}
	s.at[key] = c
	s.down(0)
}

func (s *summary) less(i, j int) bool { return s.heap[i].Count < s.heap[j].Count }

func (s *summary) swap(i, j int) {
	s.heap[i], s.heap[j] = s.heap[j], s.heap[i]
	s.heap[i].i, s.heap[j].i = i, j
}

func (s *summary) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if !s.less(i, p) {
			return
		}
		s.swap(i, p)
		i = p
	}
}

func (s *summary) down(i int) {
	for n := len(s.heap); ; {
		l, m := 2*i+1, i
		if l < n && s.less(l, m) {
			m = l
		}
		if r := l + 1; r < n && s.less(r, m) {
			m = r
		}
		if m == i {
			return
		}
		s.swap(i, m)
		i = m
	}
}

// entries is a copy of the summary's counters; a full summary's least
// count is then the error of every key it does not hold.
func (s *summary) entries() []Entry {
	out := make([]Entry, len(s.heap))
	for i, c := range s.heap {
		out[i] = c.Entry
	}
	return out
}

// Merge adds summaries of up to size counters each (one per window, or one
// per instance) into one of at most size: a key's counts and errors add
// up, and a summary that is full and does not hold a key may have counted
// it up to its least count, which is added to both. It returns the keys
// most counted first.
func Merge(size int, summaries ...[]Entry) []Entry {
	type acc struct{ count, err, floors uint64 }
	sum := map[string]*acc{}
	var floor uint64 // the least counts of the full summaries, added up
	for _, s := range summaries {
		var least uint64
		if len(s) >= size && len(s) > 0 {
			least = slices.MinFunc(s, func(a, b Entry) int { return cmp.Compare(a.Count, b.Count) }).Count
			floor += least
		}
		for _, e := range s {
			a := sum[e.Key]
			if a == nil {
				a = &acc{}
				sum[e.Key] = a
			}
			a.count += e.Count
			a.err += e.Error
			a.floors += least // this summary holds the key: its floor is not added
		}
	}
	out := make([]Entry, 0, len(sum))
	for key, a := range sum {
		// Each full summary that does not hold the key may have counted it
		// up to its least count.
		unseen := floor - a.floors
		out = append(out, Entry{Key: key, Count: a.count + unseen, Error: a.err + unseen})
	}
	return trim(out, size)
}

// trim sorts entries most counted first (ties by key) and keeps k.
func trim(entries []Entry, k int) []Entry {
	slices.SortFunc(entries, func(a, b Entry) int {
		if c := cmp.Compare(b.Count, a.Count); c != 0 {
			return c
		}
		return cmp.Compare(a.Key, b.Key)
	})
	if k >= 0 && len(entries) > k {
		entries = entries[:k]
	}
	if len(entries) == 0 {
		return nil
	}
	return entries
}
