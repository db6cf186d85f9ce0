// Package lease spreads the partitions of the other regions' spends over a
// region's live reconcilers, each partition applied by one of them at a
// time under a lease, and keeps the position each partition is applied up
// to, all in the region's Redis.
//
// Why Redis, not a NATS KV bucket: the leases and the positions sit beside
// the debits they guard, in the store every reconciler already writes, and
// the region's Redis Cluster fails over in a few seconds without a
// JetStream meta leader (which may be in another region) in the way. A
// lease lives under its partition's own hash tag, with the partition's
// positions: a primary down holds back the partitions whose leases it
// serves, not the others, and a position is written under the lease in
// one script.
//
// The protocol:
//
//   - Members. Each reconciler beats every Options.TTL/4 in one sorted set
//     of the region, under its token; a token whose heartbeat is older than
//     the TTL is dropped.
//   - Placement. Every member computes the same placement from the members
//     it reads: each partition goes to the member its rendezvous hash
//     ranks first among those below their share, so members get as many
//     within one, and a member joining or leaving moves few partitions.
//   - Leases. A member claims the free leases of its partitions (SET NX
//     with the TTL), renews those it holds, and releases those placed
//     elsewhere once its loop on them has stopped. A lease seen free at
//     two ticks in a row is claimed by anyone: its member is gone or has
//     not seen itself placed there.
//   - Validity. A holder counts its lease valid until the renewal's send
//     time plus the TTL less a fifth of it (Held.Until). The loop on a
//     partition starts a batch only with a tick's time left, and writes
//     with that instant as its deadline; so it has stopped before the
//     lease could have expired in Redis and another member taken it.
//     A renewal that finds another holder cancels the loop at once.
//   - Positions. A partition's loop stores the sequence it applied up to
//     after each batch, under its lease, never lower than the one stored;
//     the next holder reads on from there.
package lease

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/lua"
)

// DefaultTTL is how long a lease lives without a renewal: how long a
// partition of a reconciler that died waits for another.
const DefaultTTL = 5 * time.Second

// MinTTL and MaxTTL bound Options.TTL.
const (
	MinTTL = time.Second
	MaxTTL = time.Minute
)

// ErrNotHeld is SetPosition's answer when the token does not hold the
// partition's lease: the position was not written.
var ErrNotHeld = errors.New("lease not held")

// errNotConnected is an operation's error before the store has connected.
var errNotConnected = errors.New("redis not connected")

var (
	leaseScript    = redis.NewScript(lua.PartitionLease())
	positionScript = redis.NewScript(lua.PartitionPosition())
	membersScript  = redis.NewScript(lua.PartitionMembers())
)

// Item is one partition of one source region's spends.
type Item struct {
	Source    string
	Partition int
}

func (it Item) String() string { return it.Source + "." + strconv.Itoa(it.Partition) }

// tag is the hash tag of the item's keys in region: its lease and its
// positions share a slot. No rule id starts with '~', so no bucket or
// marker key ends as these do.
func tag(region string, it Item) string { return "rl:{~apply/" + region + "/" + it.String() + "}" }

// LeaseKey is the key of the item's lease in region's Redis.
func LeaseKey(region string, it Item) string { return tag(region, it) + ":~lease" }

// PositionKey is the key of the item's applied position in region's
// Redis, in the inbound stream made at epoch (µs).
func PositionKey(region string, it Item, epoch int64) string {
	return tag(region, it) + ":~pos:" + strconv.FormatInt(epoch, 10)
}

// MembersKey is the key of region's applying reconcilers.
func MembersKey(region string) string { return "rl:{~apply/" + region + "}:~members" }

// Redis gives the client of the region's Redis: a *redisstore.Store. Its
// Client is nil until the store has connected.
type Redis interface {
	Client() redis.UniversalClient
}

// Options configure a Manager.
type Options struct {
	// Region is the region applying, whose Redis holds the leases.
	Region string
	// Token names this member; empty: a random one. Each process needs its
	// own.
	Token string
	// TTL is a lease's and a heartbeat's life (DefaultTTL when 0).
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
	opts  Options
	redis Redis
	log   *slog.Logger
	m     *Metrics

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
}

// New returns a Manager of opts' leases in r, recording in m (nil: none).
func New(opts Options, r Redis, m *Metrics) *Manager {
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
	return &Manager{opts: opts, redis: r, log: opts.Logger, m: m,
		held: map[Item]*Held{}, free: map[Item]int{}, dropping: map[Item]bool{}}
}

// Token is this member's token.
func (m *Manager) Token() string { return m.opts.Token }

// TTL is a lease's life.
func (m *Manager) TTL() time.Duration { return m.opts.TTL }

// Tick is how often leases are renewed and claimed: a quarter of the TTL.
func (m *Manager) Tick() time.Duration { return m.opts.TTL / 4 }

// margin is how long before a lease's expiry, counted from its renewal's
// send time, its holder stops writing.
func (m *Manager) margin() time.Duration { return m.opts.TTL / 5 }

// Held is a lease this member holds. Its methods are safe for concurrent
// use.
type Held struct {
	Item Item
	// until is when the lease stops being valid (Unix ns).
	until atomic.Int64
	// cancel stops the loop; done is closed when it returned.
	cancel context.CancelFunc
	done   chan struct{}
}

// Until is the instant the lease stops being valid for its holder: the
// last renewal's send time plus the TTL less a margin. Every write of the
// partition's loop must be over by then.
func (h *Held) Until() time.Time { return time.Unix(0, h.until.Load()) }

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
	t := time.NewTicker(m.Tick())
	defer t.Stop()
	for {
		m.tick(ctx, items(), start)
		select {
		case <-ctx.Done():
			m.leave()
			return
		case <-t.C:
		}
	}
}

// opTimeout bounds one lease or heartbeat call: a tick's time.
func (m *Manager) opTimeout() time.Duration { return m.Tick() }

// client is the Redis client, or an error before the store connected.
func (m *Manager) client() (redis.UniversalClient, error) {
	c := m.redis.Client()
	if c == nil {
		return nil, errNotConnected
	}
	return c, nil
}

// lease runs op on the item's lease and returns its holder after it
// (empty when free).
func (m *Manager) lease(ctx context.Context, op string, it Item) (string, error) {
	c, err := m.client()
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, m.opTimeout())
	defer cancel()
	return leaseScript.Run(ctx, c, []string{LeaseKey(m.opts.Region, it)}, op, m.opts.Token, m.opts.TTL.Milliseconds()).Text()
}

// beat writes this member's heartbeat (op "beat") or removes it ("leave"),
// and returns the members.
func (m *Manager) beat(ctx context.Context, op string) ([]string, error) {
	c, err := m.client()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, m.opTimeout())
	defer cancel()
	return membersScript.Run(ctx, c, []string{MembersKey(m.opts.Region)}, op, m.opts.Token, m.opts.TTL.Milliseconds()).StringSlice()
}

// tick is one round of Run.
func (m *Manager) tick(ctx context.Context, want []Item, start func(context.Context, *Held)) {
	if ctx.Err() != nil {
		return
	}
	if members, err := m.beat(ctx, "beat"); err != nil {
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
	// Held leases: dropped when no longer wanted here, lost when their
	// validity ran out with no renewal, else renewed.
	var renew []*Held
	for it, h := range m.held {
		switch {
		case place[it] != m.opts.Token:
			m.drop(h, false, "no longer placed here")
		case now.After(h.Until().Add(m.margin())):
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
		holder string
		err    error
		sent   time.Time
	}
	renewed, claimed, looked := make([]answer, len(renew)), make([]answer, len(claim)), make([]answer, len(look))
	var wg sync.WaitGroup
	for i, h := range renew {
		wg.Go(func() {
			renewed[i].sent = time.Now()
			renewed[i].holder, renewed[i].err = m.lease(ctx, "renew", h.Item)
		})
	}
	for i, it := range claim {
		wg.Go(func() {
			claimed[i].sent = time.Now()
			claimed[i].holder, claimed[i].err = m.lease(ctx, "claim", it)
		})
	}
	for i, it := range look {
		wg.Go(func() { looked[i].holder, looked[i].err = m.lease(ctx, "read", it) })
	}
	wg.Wait()
	for i, h := range renew {
		a := renewed[i]
		switch {
		case a.err != nil:
			m.log.Debug("apply lease not renewed", "partition", h.Item.String(), "err", a.err)
		case a.holder != m.opts.Token:
			m.drop(h, true, "held by another: "+a.holder)
		default:
			h.until.Store(a.sent.Add(m.opts.TTL - m.margin()).UnixNano())
			if isDone(h.done) && ctx.Err() == nil {
				m.launch(ctx, h, start)
			}
		}
	}
	for i, it := range look {
		if looked[i].err == nil && looked[i].holder == "" {
			m.free[it]++
			if m.free[it] >= 2 {
				claim = append(claim, it)
				a := answer{sent: time.Now()}
				a.holder, a.err = m.lease(ctx, "claim", it)
				claimed = append(claimed, a)
			}
		} else {
			delete(m.free, it)
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
		h := &Held{Item: it}
		h.until.Store(a.sent.Add(m.opts.TTL - m.margin()).UnixNano())
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
// the lease (if it is still this member's). Until then the item is not
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
		// Compare and delete: a lease another member holds now stays.
		if _, err := m.lease(context.Background(), "release", h.Item); err != nil {
			m.log.Debug("apply lease not released: it expires", "partition", h.Item.String(), "err", err)
		}
		m.mu.Lock()
		delete(m.dropping, h.Item)
		m.mu.Unlock()
	})
}

// leave drops every lease, waits for their loops and releases, and
// removes this member's heartbeat.
func (m *Manager) leave() {
	for _, h := range m.held {
		m.drop(h, false, "stopping")
	}
	m.drops.Wait()
	if _, err := m.beat(context.Background(), "leave"); err != nil {
		m.log.Debug("apply members: not left, the heartbeat expires", "err", err)
	}
}

// Position is the position it is applied up to in the inbound stream made
// at epoch: 0 when none is stored.
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

// SetPosition stores that it is applied up to seq in the inbound stream
// made at epoch, unless a later position is stored, and returns the
// position after. It writes nothing and returns ErrNotHeld when this
// member does not hold the item's lease.
func (m *Manager) SetPosition(ctx context.Context, it Item, epoch int64, seq uint64) (uint64, error) {
	c, err := m.client()
	if err != nil {
		return 0, err
	}
	keys := []string{PositionKey(m.opts.Region, it, epoch), LeaseKey(m.opts.Region, it)}
	v, err := positionScript.Run(ctx, c, keys, strconv.FormatUint(seq, 10), max(m.opts.PositionTTL.Milliseconds(), 1), m.opts.Token).Int64()
	if err != nil {
		return 0, fmt.Errorf("store position of %s: %w", it, err)
	}
	if v < 0 {
		return 0, fmt.Errorf("store position of %s: %w", it, ErrNotHeld)
	}
	return uint64(v), nil
}

// Assign places items over members: each item, in a fixed order, goes to
// the member its rendezvous hash ranks first among those below their
// share, so that loads differ by one at most. Every member computes the same placement
// from the same members. It returns each item's member; none with no
// members.
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
		if a.Source != b.Source {
			if a.Source < b.Source {
				return -1
			}
			return 1
		}
		return a.Partition - b.Partition
	})
	items = slices.Compact(items)
	// Each member takes floor items, and extra of them one more.
	floor, extra := len(items)/len(members), len(items)%len(members)
	load := make(map[string]int, len(members))
	ranked := make([]string, len(members))
	for _, it := range items {
		copy(ranked, members)
		key := it.String()
		slices.SortFunc(ranked, func(a, b string) int {
			ha, hb := score(a, key), score(b, key)
			switch {
			case ha > hb:
				return -1
			case ha < hb:
				return 1
			}
			if a < b {
				return -1
			}
			return 1
		})
		for _, mem := range ranked {
			if load[mem] < floor || (load[mem] == floor && extra > 0) {
				if load[mem] == floor {
					extra--
				}
				out[it] = mem
				load[mem]++
				break
			}
		}
	}
	return out
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
