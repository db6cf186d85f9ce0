// Package lease spreads the partitions of the other regions' spends over a
// region's live reconcilers, each partition applied by one of them at a
// time under a lease, and keeps the position each partition is applied up
// to.
//
// The leases and the members are in a NATS key-value bucket of the region
// (gossip.ApplyBucket), the positions in the region's Redis. Why not the
// leases in Redis too: applying reads the inbound stream, so it needs NATS
// anyway, and a lease there adds no failure a partition's loop does not
// have already; a lease in Redis would live on one primary, whose failure
// would stop every partition leased there until a replica took over, where
// the debits hold back only the keys of that primary (the retry stream).
// The bucket is placed in the region's JetStream cluster, as its streams,
// so a claim or a renewal is one publish to its leader, with no meta
// leader (which may be in another region) in the way; it adds no
// dependency. A position sits in Redis beside the markers it goes with; a
// primary down leaves its positions unwritten, which only makes the next
// holder read a little again.
//
// The protocol:
//
//   - Members. Each reconciler writes, every Options.TTL/4, when its
//     heartbeat ends into the bucket's list of members; a member whose
//     heartbeat ended is dropped from it.
//   - Placement. Every member computes the same placement from the members
//     it reads: each partition goes to the member its rendezvous hash
//     ranks first among those below their share of its source's, so
//     members get as many of each source's, and of all, within one, and a
//     member joining or leaving moves few partitions.
//   - Leases. A lease is a key of the bucket holding its holder's token,
//     expired by the bucket's TTL unless rewritten. A member claims the
//     free leases of its partitions (a create), renews those it holds (an
//     update at the revision it last wrote), and releases those placed
//     elsewhere once its loop on them has stopped (a delete at that
//     revision). A lease seen free at two ticks in a row is claimed by
//     anyone: its member is gone or has not seen itself placed there.
//   - Validity. A holder counts its lease valid until the renewal's send
//     time plus the TTL less a fifth of it (Held.Until). The loop on a
//     partition starts a batch only with a tick's time left, and writes
//     with that instant as its deadline; so it has stopped before the
//     lease could have expired and another member taken it. A renewal
//     that finds the lease rewritten by another cancels the loop at once.
//   - Positions. A partition's loop stores the sequence it applied up to
//     after each batch, never lower than the one stored; the next holder
//     reads on from there.
package lease

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// DefaultTTL is how long a lease lives without a renewal: how long a
// partition of a reconciler that died waits for another.
const DefaultTTL = 5 * time.Second

// MinTTL and MaxTTL bound Options.TTL.
const (
	MinTTL = time.Second
	MaxTTL = time.Minute
)

// errNotConnected is an operation's error before the store, or the
// bucket, can be reached.
var errNotConnected = errors.New("not connected")

var positionScript = redis.NewScript(lua.PartitionPosition())

// Item is one partition of one source region's spends.
type Item struct {
	Source    string
	Partition int
}

func (it Item) String() string { return it.Source + "." + strconv.Itoa(it.Partition) }

// leaseKey is the item's key in the bucket.
func leaseKey(it Item) string { return "partition." + it.String() }

// membersKey is the bucket's key of the members.
const membersKey = "members"

// PositionKey is the key of the item's applied position in region's
// Redis, in the inbound stream made at epoch (µs). No rule id starts with
// '~', so no bucket or marker key ends as it does.
func PositionKey(region string, it Item, epoch int64) string {
	return "rl:{~apply/" + region + "/" + it.String() + "}:~pos:" + strconv.FormatInt(epoch, 10)
}

// BucketConfig is the configuration of region's bucket, made with a TTL
// of ttl, replicas replicas and placement (nil: none) when it is missing.
// A bucket that exists keeps its own TTL: the members read it.
func BucketConfig(region string, ttl time.Duration, replicas int, placement *jetstream.Placement) jetstream.KeyValueConfig {
	return jetstream.KeyValueConfig{Bucket: gossip.ApplyBucket(region), Description: "which reconciler of " + region + " applies each partition",
		TTL: ttl, History: 1, Storage: jetstream.FileStorage, Replicas: replicas, Placement: placement}
}

// Redis gives the client of the region's Redis: a *redisstore.Store. Its
// Client is nil until the store has connected.
type Redis interface {
	Client() redis.UniversalClient
}

// Bucket gives the region's bucket once it is made (nil before), and its
// TTL, read when it was looked up.
type Bucket interface {
	Bucket() (jetstream.KeyValue, time.Duration)
}

// Options configure a Manager.
type Options struct {
	// Region is the region applying.
	Region string
	// Token names this member; empty: a random one. Each process needs its
	// own.
	Token string
	// TTL is how often leases are renewed: every quarter of it. A lease's
	// life is the bucket's TTL (Options.TTL when it was made).
	TTL time.Duration
	// PositionTTL is how long a position lives after its last write: as
	// long as the stream keeps a message, so that a position gone means
	// its messages are gone too.
	PositionTTL time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Manager holds this member's leases. Make it with New; Run it once. Its
// methods are safe for concurrent use.
type Manager struct {
	opts   Options
	bucket Bucket
	redis  Redis
	log    *slog.Logger
	m      *Metrics

	// run's state, touched by its goroutine alone: the leases held, the
	// members last read, and per item the ticks it was seen free in a row
	// while placed elsewhere.
	held    map[Item]*Held
	members []string
	free    map[Item]int
	// mu guards dropping: the items whose loop is being stopped (and
	// lease released), not claimed again until that is over.
	mu       sync.Mutex
	dropping map[Item]bool
	drops    sync.WaitGroup
	// abandon: Run ends without releasing the leases or leaving.
	abandon atomic.Bool
}

// New returns a Manager of opts' leases in b, with positions in r,
// recording in m (nil: none).
func New(opts Options, b Bucket, r Redis, m *Metrics) *Manager {
	if opts.TTL == 0 {
		opts.TTL = DefaultTTL
	}
	if opts.Token == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		opts.Token = hex.EncodeToString(b[:])
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &Manager{opts: opts, bucket: b, redis: r, log: opts.Logger, m: m,
		held: map[Item]*Held{}, free: map[Item]int{}, dropping: map[Item]bool{}}
}

// Abandon makes Run end as a process killed would: its leases and its
// heartbeat are left to expire.
func (m *Manager) Abandon() { m.abandon.Store(true) }

// Token is this member's token.
func (m *Manager) Token() string { return m.opts.Token }

// Tick is how often leases are renewed and claimed: a quarter of the
// TTL, or of the bucket's when it is shorter.
func (m *Manager) Tick() time.Duration {
	ttl := m.opts.TTL
	if _, b := m.bucket.Bucket(); b > 0 {
		ttl = min(ttl, b)
	}
	return ttl / 4
}

// valid is how long after a write's send time the lease it wrote counts
// as valid: the bucket's TTL less a fifth of it.
func valid(ttl time.Duration) time.Duration { return ttl - ttl/5 }

// Held is a lease this member holds. Its methods are safe for concurrent
// use.
type Held struct {
	Item Item
	// until is when the lease stops being valid, on the monotonic clock
	// (a wall clock stepped meanwhile does not move it).
	until atomic.Pointer[time.Time]
	// rev is the lease's revision this member last wrote.
	rev uint64
	// cancel stops the loop; done is closed when it returned.
	cancel context.CancelFunc
	done   chan struct{}
}

// Until is the instant the lease stops being valid for its holder: the
// last renewal's send time plus the TTL less a fifth. Every write of the
// partition's loop must be over by then.
func (h *Held) Until() time.Time {
	if u := h.until.Load(); u != nil {
		return *u
	}
	return time.Time{}
}

// setUntil records a write of the lease sent at sent, to a bucket of ttl.
func (h *Held) setUntil(sent time.Time, ttl time.Duration) {
	u := sent.Add(valid(ttl))
	h.until.Store(&u)
}

// WaitValid waits until the lease is valid for at least need more, and
// returns until when, or ctx's error.
func (h *Held) WaitValid(ctx context.Context, need time.Duration) (time.Time, error) {
	for {
		u := h.Until()
		if time.Until(u) >= need {
			return u, nil
		}
		select {
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		case <-time.After(25 * time.Millisecond):
		}
	}
}

// Run keeps this member's leases until ctx ends: every tick it beats,
// places the items that items lists over the members, and claims, renews
// or releases leases. For each lease it holds it runs start in a goroutine
// of its own, with a context that ends when the lease is lost or released;
// a start that returns while the lease is held is run again at the next
// tick. When ctx ends, Run stops every start, waits for them, releases
// the leases and leaves the members.
func (m *Manager) Run(ctx context.Context, items func() []Item, start func(ctx context.Context, h *Held)) {
	for {
		began := time.Now()
		m.tick(ctx, items(), start)
		select {
		case <-ctx.Done():
			m.leave()
			return
		case <-time.After(m.Tick() - time.Since(began)):
		}
	}
}

// opTimeout bounds one lease or heartbeat call: a tick's time.
func (m *Manager) opTimeout() time.Duration { return m.Tick() }

// kv is the bucket and its TTL, or an error before it is made.
func (m *Manager) kv() (jetstream.KeyValue, time.Duration, error) {
	kv, ttl := m.bucket.Bucket()
	if kv == nil || ttl <= 0 {
		return nil, 0, fmt.Errorf("bucket %s: %w", gossip.ApplyBucket(m.opts.Region), errNotConnected)
	}
	return kv, ttl, nil
}

// claim takes the item's lease when it is free, or this member's already
// (its earlier claim's reply lost), and returns the revision written; or
// the holder when another holds it.
func (m *Manager) claim(ctx context.Context, it Item) (rev uint64, holder string, err error) {
	kv, _, err := m.kv()
	if err != nil {
		return 0, "", err
	}
	ctx, cancel := context.WithTimeout(ctx, m.opTimeout())
	defer cancel()
	token := []byte(m.opts.Token)
	rev, err = kv.Create(ctx, leaseKey(it), token)
	if !errors.Is(err, jetstream.ErrKeyExists) {
		return rev, m.opts.Token, err
	}
	e, err := kv.Get(ctx, leaseKey(it))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return 0, "", nil // expired meanwhile: the next tick claims it
	}
	if err != nil {
		return 0, "", err
	}
	if string(e.Value()) != m.opts.Token {
		return 0, string(e.Value()), nil
	}
	rev, err = kv.Update(ctx, leaseKey(it), token, e.Revision())
	if errors.Is(err, jetstream.ErrKeyExists) {
		return 0, "", nil
	}
	return rev, m.opts.Token, err
}

// errTaken is renew's error for a lease rewritten since this member's last
// write: it expired, and another member may hold it.
var errTaken = errors.New("lease rewritten by another")

// renew rewrites h's lease at the revision this member last wrote, and
// returns the new one.
func (m *Manager) renew(ctx context.Context, h *Held) (uint64, error) {
	kv, _, err := m.kv()
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, m.opTimeout())
	defer cancel()
	rev, err := kv.Update(ctx, leaseKey(h.Item), []byte(m.opts.Token), h.rev)
	if errors.Is(err, jetstream.ErrKeyExists) {
		return 0, errTaken
	}
	return rev, err
}

// release deletes h's lease if this member wrote it last.
func (m *Manager) release(ctx context.Context, h *Held) error {
	kv, _, err := m.kv()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, m.opTimeout())
	defer cancel()
	return kv.Delete(ctx, leaseKey(h.Item), jetstream.LastRevision(h.rev))
}

// holder reads who holds the item's lease: empty when it is free.
func (m *Manager) holder(ctx context.Context, it Item) (string, error) {
	kv, _, err := m.kv()
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, m.opTimeout())
	defer cancel()
	e, err := kv.Get(ctx, leaseKey(it))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	return string(e.Value()), nil
}

// beat writes when this member's heartbeat ends into the members (leave:
// removes it), drops those whose heartbeat ended, and returns the members
// left. The members are one key, a map from token to the end of its
// heartbeat (Unix ms on its writer's clock: placement tolerates the skew
// between the region's hosts), rewritten at its revision.
func (m *Manager) beat(ctx context.Context, leave bool) ([]string, error) {
	kv, ttl, err := m.kv()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, m.opTimeout())
	defer cancel()
	for {
		var rev uint64
		members := map[string]int64{}
		e, err := kv.Get(ctx, membersKey)
		switch {
		case errors.Is(err, jetstream.ErrKeyNotFound):
		case err != nil:
			return nil, err
		default:
			rev = e.Revision()
			if err := json.Unmarshal(e.Value(), &members); err != nil {
				m.log.Warn("apply members unreadable: written again", "err", err)
				members = map[string]int64{}
			}
		}
		now := time.Now().UnixMilli()
		maps.DeleteFunc(members, func(_ string, end int64) bool { return end <= now })
		if leave {
			delete(members, m.opts.Token)
		} else {
			members[m.opts.Token] = now + ttl.Milliseconds()
		}
		data, err := json.Marshal(members)
		if err != nil {
			return nil, err
		}
		if rev == 0 {
			_, err = kv.Create(ctx, membersKey, data)
		} else {
			_, err = kv.Update(ctx, membersKey, data, rev)
		}
		if errors.Is(err, jetstream.ErrKeyExists) {
			continue // another member wrote meanwhile
		}
		if err != nil {
			return nil, err
		}
		return slices.Sorted(maps.Keys(members)), nil
	}
}

// tick is one round of Run.
func (m *Manager) tick(ctx context.Context, want []Item, start func(context.Context, *Held)) {
	if ctx.Err() != nil {
		return
	}
	_, ttl, err := m.kv()
	if err != nil {
		return // not set up yet
	}
	if members, err := m.beat(ctx, false); err != nil {
		m.log.Warn("apply leases: heartbeat not written, placing with the members last read", "err", err)
	} else {
		m.members = members
	}
	members := m.members
	if !slices.Contains(members, m.opts.Token) {
		members = append(slices.Clone(members), m.opts.Token)
	}
	place := Assign(want, members)
	now := time.Now()
	// Held leases: dropped when no longer placed here, lost when their
	// validity ran out with no renewal (past it by a fifth of the TTL:
	// surely expired), else renewed.
	var renew []*Held
	for it, h := range m.held {
		switch {
		case place[it] != m.opts.Token:
			m.drop(h, false, "no longer placed here")
		case now.After(h.Until().Add(ttl / 5)):
			m.drop(h, true, "not renewed in time")
		default:
			renew = append(renew, h)
		}
	}
	// Free leases: claimed when placed here, or free at two ticks in a row.
	var claim, look []Item
	for _, it := range want {
		if m.held[it] != nil || m.isDropping(it) {
			continue
		}
		if place[it] == m.opts.Token {
			claim = append(claim, it)
		} else {
			look = append(look, it)
		}
	}
	type answer struct {
		rev    uint64
		holder string
		err    error
		sent   time.Time
	}
	renewed, claimed, looked := make([]answer, len(renew)), make([]answer, len(claim)), make([]answer, len(look))
	var wg sync.WaitGroup
	for i, h := range renew {
		wg.Go(func() {
			renewed[i].sent = time.Now()
			renewed[i].rev, renewed[i].err = m.renew(ctx, h)
		})
	}
	for i, it := range claim {
		wg.Go(func() {
			claimed[i].sent = time.Now()
			claimed[i].rev, claimed[i].holder, claimed[i].err = m.claim(ctx, it)
		})
	}
	for i, it := range look {
		wg.Go(func() { looked[i].holder, looked[i].err = m.holder(ctx, it) })
	}
	wg.Wait()
	for i, h := range renew {
		a := renewed[i]
		switch {
		case errors.Is(a.err, errTaken):
			m.drop(h, true, a.err.Error())
		case a.err != nil:
			m.log.Debug("apply lease not renewed", "partition", h.Item.String(), "err", a.err)
		default:
			h.rev = a.rev
			h.setUntil(a.sent, ttl)
			if isDone(h.done) && ctx.Err() == nil {
				m.launch(ctx, h, start)
			}
		}
	}
	for i, it := range look {
		if looked[i].err != nil || looked[i].holder != "" {
			delete(m.free, it)
			continue
		}
		if m.free[it]++; m.free[it] >= 2 {
			a := answer{sent: time.Now()}
			a.rev, a.holder, a.err = m.claim(ctx, it)
			claim, claimed = append(claim, it), append(claimed, a)
		}
	}
	for i, it := range claim {
		a := claimed[i]
		if a.err != nil || a.holder != m.opts.Token || ctx.Err() != nil {
			if a.err != nil {
				m.log.Debug("apply lease not claimed", "partition", it.String(), "err", a.err)
			}
			continue
		}
		delete(m.free, it)
		h := &Held{Item: it, rev: a.rev}
		h.setUntil(a.sent, ttl)
		m.held[it] = h
		m.m.held(it.Source, 1)
		m.log.Info("apply lease claimed", "partition", it.String())
		m.launch(ctx, h, start)
	}
}

func isDone(c chan struct{}) bool {
	if c == nil {
		return true
	}
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// launch runs start on h in a goroutine, with a context that drop cancels.
func (m *Manager) launch(ctx context.Context, h *Held, start func(context.Context, *Held)) {
	lctx, cancel := context.WithCancel(ctx)
	h.cancel, h.done = cancel, make(chan struct{})
	done := h.done
	go func() {
		defer close(done)
		defer cancel()
		start(lctx, h)
	}()
}

func (m *Manager) isDropping(it Item) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.dropping[it]
}

// drop forgets h: it stops its loop and, once the loop returned, releases
// the lease (if this member wrote it last). Until then the item is not
// claimed again. lost says the lease was lost while applying.
func (m *Manager) drop(h *Held, lost bool, why string) {
	delete(m.held, h.Item)
	m.m.held(h.Item.Source, -1)
	if lost {
		m.m.lost()
		m.log.Warn("apply lease lost: the partition's loop stops", "partition", h.Item.String(), "why", why)
	} else {
		m.log.Info("apply lease released", "partition", h.Item.String(), "why", why)
	}
	m.mu.Lock()
	m.dropping[h.Item] = true
	m.mu.Unlock()
	m.drops.Go(func() {
		if h.cancel != nil {
			h.cancel()
			<-h.done
		}
		if !m.abandon.Load() {
			if err := m.release(context.Background(), h); err != nil {
				m.log.Debug("apply lease not released: it expires", "partition", h.Item.String(), "err", err)
			}
		}
		m.mu.Lock()
		delete(m.dropping, h.Item)
		m.mu.Unlock()
	})
}

// leave drops every lease, waits for their loops and releases, and
// removes this member's heartbeat; abandoned, it only stops the loops.
func (m *Manager) leave() {
	for _, h := range m.held {
		m.drop(h, false, "stopping")
	}
	m.drops.Wait()
	if m.abandon.Load() {
		return
	}
	if _, err := m.beat(context.Background(), true); err != nil {
		m.log.Debug("apply members: not left, the heartbeat expires", "err", err)
	}
}

// client is the Redis client, or an error before the store connected.
func (m *Manager) client() (redis.UniversalClient, error) {
	c := m.redis.Client()
	if c == nil {
		return nil, fmt.Errorf("redis: %w", errNotConnected)
	}
	return c, nil
}

// Position is the position the item is applied up to in the inbound
// stream made at epoch: 0 when none is stored.
func (m *Manager) Position(ctx context.Context, it Item, epoch int64) (uint64, error) {
	c, err := m.client()
	if err != nil {
		return 0, err
	}
	return ReadPosition(ctx, c, m.opts.Region, it, epoch)
}

// ReadPosition is the position region's partition it is applied up to in
// the inbound stream made at epoch: 0 when none is stored.
func ReadPosition(ctx context.Context, c redis.UniversalClient, region string, it Item, epoch int64) (uint64, error) {
	v, err := c.Get(ctx, PositionKey(region, it, epoch)).Uint64()
	if errors.Is(err, redis.Nil) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read position of %s: %w", it, err)
	}
	return v, nil
}

// SetPosition stores that the item is applied up to seq in the inbound
// stream made at epoch, unless a later position is stored, and returns
// the position after.
func (m *Manager) SetPosition(ctx context.Context, it Item, epoch int64, seq uint64) (uint64, error) {
	c, err := m.client()
	if err != nil {
		return 0, err
	}
	v, err := positionScript.Run(ctx, c, []string{PositionKey(m.opts.Region, it, epoch)}, strconv.FormatUint(seq, 10), max(m.opts.PositionTTL.Milliseconds(), 1)).Uint64()
	if err != nil {
		return 0, fmt.Errorf("store position of %s: %w", it, err)
	}
	return v, nil
}

// Assign places items over members: the items of each source in turn
// (in name order), so that each source's items spread over the members
// within one, and so do all items: a source's extra items go to the
// members least loaded so far. Each item goes to the member its
// rendezvous hash ranks first among those with room. Every member
// computes the same placement from the same members. It returns each
// item's member; none with no members.
func Assign(items []Item, members []string) map[Item]string {
	out := make(map[Item]string, len(items))
	if len(members) == 0 {
		return out
	}
	members = slices.Clone(members)
	slices.Sort(members)
	members = slices.Compact(members)
	items = slices.Clone(items)
	slices.SortFunc(items, func(a, b Item) int {
		if c := strings.Compare(a.Source, b.Source); c != 0 {
			return c
		}
		return a.Partition - b.Partition
	})
	items = slices.Compact(items)
	load := make(map[string]int, len(members))
	ranked := slices.Clone(members)
	for len(items) > 0 {
		n := 1
		for n < len(items) && items[n].Source == items[0].Source {
			n++
		}
		group := items[:n]
		items = items[n:]
		// Each member takes floor of the source's items; the extra ones go
		// to the least loaded members, ties broken by the source's hash.
		floor, extra := len(group)/len(members), len(group)%len(members)
		room := make(map[string]int, len(members))
		src := group[0].Source
		slices.SortFunc(ranked, func(a, b string) int {
			if load[a] != load[b] {
				return load[a] - load[b]
			}
			return byScore(src, a, b)
		})
		for i, mem := range ranked {
			room[mem] = floor
			if i < extra {
				room[mem]++
			}
		}
		for _, it := range group {
			key := it.String()
			slices.SortFunc(ranked, func(a, b string) int { return byScore(key, a, b) })
			for _, mem := range ranked {
				if room[mem] > 0 {
					room[mem]--
					out[it] = mem
					load[mem]++
					break
				}
			}
		}
	}
	return out
}

// byScore orders members a and b by their rendezvous hash for key, the
// highest first, then by name.
func byScore(key, a, b string) int {
	ha, hb := score(a, key), score(b, key)
	switch {
	case ha > hb:
		return -1
	case ha < hb:
		return 1
	}
	return strings.Compare(a, b)
}

// score is the rendezvous hash of member for item.
func score(member, item string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(member))
	h.Write([]byte{0})
	h.Write([]byte(item))
	x := h.Sum64()
	// A finalizer (splitmix64's), so that members named alike spread.
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// Metrics are what a Manager records. Make them with NewMetrics; they are
// safe for concurrent use. A nil *Metrics records nothing.
type Metrics struct {
	Held *prometheus.GaugeVec
	Lost prometheus.Counter
}

// NewMetrics makes the metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		Held: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_apply_partitions_held",
			Help: "Partitions of a source region's spends this reconciler holds the lease of, and applies.",
		}, []string{"source_region"}),
		Lost: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_apply_leases_lost_total",
			Help: "Leases of partitions this reconciler lost (not renewed in time, or found held by another) while applying them.",
		}),
	}
	for _, c := range []prometheus.Collector{m.Held, m.Lost} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *Metrics) lost() {
	if m != nil {
		m.Lost.Inc()
	}
}

func (m *Metrics) held(src string, delta float64) {
	if m != nil {
		m.Held.WithLabelValues(src).Add(delta)
	}
}
