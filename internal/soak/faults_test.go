package soak

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// The kinds of fault.
const (
	faultReconciler = "reconciler-kill"
	faultNATS       = "nats-kill"
	faultPrimary    = "redis-primary-kill"
	faultLimiterd   = "limiterd-kill"
	faultCut        = "gateway-cut"
	faultPause      = "redis-pause"
)

var faultKinds = []string{faultReconciler, faultNATS, faultPrimary, faultLimiterd, faultCut, faultPause}

// fault is one injected fault, from start to end (ns since the soak
// began): end is when what it broke is back (a restarted daemon ready, a
// cluster healthy again, a gateway healed).
type fault struct {
	kind   string
	region string // the region it hit; for a cut, the first of the pair
	other  string // for a cut, the second region
	target string // the process, server or node
	start  int64
	end    int64
	// killedAt is when a limiterd was killed (its unflushed spends are
	// never published).
	killedAt int64
	// thirds are the thirds of the slots whose primary was killed or
	// paused (Redis faults).
	thirds []int
	err    string
	// u and n are the fault's own draws from the seed (its length, its
	// target), taken when it is picked.
	u float64
	n int
}

func (f *fault) String() string {
	where := f.region
	if f.other != "" {
		where += "<->" + f.other
	}
	s := fmt.Sprintf("%-18s %-17s %-22s %6.1fs -> %6.1fs (%4.1fs)", f.kind, where, f.target,
		time.Duration(f.start).Seconds(), time.Duration(f.end).Seconds(), time.Duration(f.end-f.start).Seconds())
	if f.err != "" {
		s += " ERROR: " + f.err
	}
	return s
}

// driver injects faults at random, at most two at a time, one per
// region's Redis, one NATS server down and one cut at a time.
type driver struct {
	s     *stack
	began time.Time
	rng   *rand.Rand
	scale float64 // of the cut's 10-30 s to the soak's length

	mu     sync.Mutex
	faults []*fault
	active []*fault
	// scrapes keeps each daemon's metrics taken before every kill and at
	// the end, by daemon name.
	scrapes map[string][]string
}

func (d *driver) since() int64 { return int64(time.Since(d.began)) }

// run injects faults until ctx ends, then waits for the active ones to end.
// The first faults take each kind once, in an order drawn from the seed.
func (d *driver) run(ctx context.Context) {
	var wg sync.WaitGroup
	defer wg.Wait()
	order := slices.Clone(faultKinds)
	d.rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
	for n := 0; ; n++ {
		gap := time.Duration((0.5 + d.rng.Float64()*2.5) * float64(time.Second))
		select {
		case <-ctx.Done():
			return
		case <-time.After(gap):
		}
		deadline, _ := ctx.Deadline()
		left := time.Until(deadline)
		var f *fault
		for try := 0; try < 20 && f == nil; try++ {
			kind := faultKinds[d.rng.IntN(len(faultKinds))]
			if len(order) > 0 {
				kind = order[0]
			}
			f = d.pick(kind, left)
			if f == nil && len(order) > 0 {
				// Its turn again later, after the next kind: one that
				// waits for another of its kind to end, or for more time
				// than is left, does not hold up the others.
				order = append(order[1:], order[0])
				break
			}
		}
		if f == nil {
			continue
		}
		if len(order) > 0 && order[0] == f.kind {
			order = order[1:]
		}
		wg.Go(func() { d.inject(f) })
	}
}

// pick chooses a target for a fault of kind that fits what is active and
// the time left, or returns nil.
func (d *driver) pick(kind string, left time.Duration) *fault {
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.active) >= 2 {
		return nil
	}
	busy := func(k, region string) bool {
		for _, a := range d.active {
			if (a.kind == k || k == "") && (region == "" || a.region == region || a.other == region) {
				return true
			}
		}
		return false
	}
	r := regions[d.rng.IntN(len(regions))]
	f := &fault{kind: kind, region: r}
	switch kind {
	case faultCut:
		if busy(faultCut, "") || left < d.cutLength(0)+5*time.Second {
			return nil
		}
		others := slices.DeleteFunc(slices.Clone(regions), func(x string) bool { return x == r })
		f.other = others[d.rng.IntN(len(others))]
		f.target = "gateways"
	case faultNATS:
		if busy(faultNATS, "") || left < 15*time.Second {
			return nil
		}
	case faultPrimary, faultPause:
		if busy(faultPrimary, r) || busy(faultPause, r) || left < 12*time.Second {
			return nil
		}
	case faultReconciler, faultLimiterd:
		if busy(kind, r) || left < 8*time.Second {
			return nil
		}
	}
	f.u, f.n = d.rng.Float64(), d.rng.IntN(1<<20)
	f.start = d.since()
	d.active = append(d.active, f)
	d.faults = append(d.faults, f)
	return f
}

// cutLength is how long a cut lasts: 10-30 s in a 3-minute soak, scaled
// to shorter ones (at least 4 s); u in [0, 1) picks within the range.
func (d *driver) cutLength(u float64) time.Duration {
	return time.Duration(max(4, (10+20*u)*d.scale) * float64(time.Second))
}

func (d *driver) inject(f *fault) {
	defer func() {
		d.mu.Lock()
		f.end = d.since()
		d.active = slices.DeleteFunc(d.active, func(a *fault) bool { return a == f })
		d.mu.Unlock()
	}()
	s := d.s
	r := s.regions[f.region]
	u := f.u
	hold := func(lo, hi float64) { time.Sleep(time.Duration((lo + (hi-lo)*u) * float64(time.Second))) }
	switch f.kind {
	case faultReconciler:
		f.target = r.rec.name
		d.scrape(r.rec.name, r.rec.httpAddr)
		r.rec.kill()
		hold(2, 6)
		if err := r.rec.start(); err != nil {
			f.err = err.Error()
		}
	case faultLimiterd:
		f.target = r.lim.name
		d.scrape(r.lim.name, r.lim.httpAddr)
		f.killedAt = d.since()
		r.lim.kill()
		hold(1, 4)
		if err := r.lim.start(); err != nil {
			f.err = err.Error()
		}
	case faultNATS:
		servers := s.super.Servers(f.region)
		srv := servers[f.n%len(servers)]
		f.target = srv.Name()
		srv.Kill()
		hold(3, 8)
		srv.Restart(s.t)
		s.super.WaitReady(s.t)
	case faultCut:
		s.super.Cut(f.region, f.other)
		time.Sleep(d.cutLength(u))
		s.super.Heal(f.region, f.other)
		// Healed: the gateways connect again within a few seconds.
		s.super.WaitReady(s.t)
	case faultPrimary:
		addr, thirds, err := pickPrimary(r, f.n)
		if err != nil {
			f.err = err.Error()
			return
		}
		f.target, f.thirds = "redis "+addr, thirds
		var node *redistest.Node
		for _, n := range r.redis.Nodes() {
			if n.Addr() == addr {
				node = n
			}
		}
		if node == nil {
			f.err = "no node at " + addr
			return
		}
		node.Stop()
		// Its replica takes over in 2-3 s; the killed node comes back
		// empty and rejoins as the new primary's replica.
		hold(4, 8)
		node.Start()
		r.redis.WaitHealthy(s.t)
	case faultPause:
		addr, thirds, err := pickPrimary(r, f.n)
		if err != nil {
			f.err = err.Error()
			return
		}
		f.target, f.thirds = "redis "+addr, thirds
		ms := int64(2000 + 3000*u)
		c := redis.NewClient(&redis.Options{Addr: addr})
		err = c.Do(context.Background(), "CLIENT", "PAUSE", strconv.FormatInt(ms, 10), "ALL").Err()
		c.Close()
		if err != nil {
			f.err = err.Error()
			return
		}
		time.Sleep(time.Duration(ms) * time.Millisecond)
	}
}

// scrape keeps a daemon's metrics, before it is killed or at the end.
func (d *driver) scrape(name, httpAddr string) {
	text := scrape(httpAddr)
	d.mu.Lock()
	d.scrapes[name] = append(d.scrapes[name], text)
	d.mu.Unlock()
}

// pickPrimary picks one of region's primaries at random and says which
// thirds of the slots it serves.
func pickPrimary(r *regionStack, n int) (string, []int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	slots, err := r.rc.ClusterSlots(ctx).Result() //nolint:staticcheck // SA1019: the thirds of the slots are what the test needs; CLUSTER SLOTS still serves them
	if err != nil {
		return "", nil, fmt.Errorf("cluster slots: %w", err)
	}
	if len(slots) == 0 {
		return "", nil, fmt.Errorf("cluster slots: none")
	}
	byAddr := map[string][]int{}
	var addrs []string
	for _, sl := range slots {
		if len(sl.Nodes) == 0 {
			continue
		}
		a := sl.Nodes[0].Addr
		if _, ok := byAddr[a]; !ok {
			addrs = append(addrs, a)
		}
		for th := range 3 {
			if thirdOf(int(sl.Start)) == th || thirdOf(int(sl.End)) == th {
				if !slices.Contains(byAddr[a], th) {
					byAddr[a] = append(byAddr[a], th)
				}
			}
		}
	}
	slices.Sort(addrs)
	a := addrs[n%len(addrs)]
	return strings.TrimSpace(a), byAddr[a], nil
}
