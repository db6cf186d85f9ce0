package soak

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/redisstore"
)

// The rules of the soak. The slow and fast shapes and the ledger are
// reconciled; the pinned rule is decided in each key's home region; the
// fail-closed rule is a window far above its traffic, not reconciled, so
// that each region's count of a key is exactly what its store decided.
const (
	ruleSlow = iota
	ruleFast
	rulePinned
	ruleClosed
	ruleLedger
	numRules
)

var ruleIDs = [numRules]string{"slow", "fast", "pinned", "closed", "ledger"}

// The limits of the token bucket rules, which the audit holds the
// admissions to.
var bucketLimits = map[int]struct{ capacity, rate float64 }{
	ruleSlow:   {50, 20},
	ruleFast:   {10, 100},
	rulePinned: {20, 5},
}

const soakRules = `rules:
  - id: slow
    capacity: 50
    refill_per_second: 20
  - id: fast
    capacity: 10
    refill_per_second: 100
  - id: pinned
    capacity: 20
    refill_per_second: 5
    home: pinned
    on_failure: closed
  - id: closed
    algorithm: fixed_window
    limit: 1000000000
    window: 8760h
    on_failure: closed
    reconcile: false
  - id: ledger
    algorithm: fixed_window
    limit: 1000000000
    window: 8760h
`

// ruleWeights is the share of the traffic of each rule, in percent.
var ruleWeights = [numRules]int{25, 25, 15, 10, 25}

// numKeys is the number of keys of each rule (per region for the ledger).
const numKeys = 500

// answer is one check and what it got.
type answer struct {
	sent, done int64 // ns since the soak began
	region     uint8
	rule       uint8
	key        uint16
	cost       float32
	allowed    bool
	code       uint8 // gRPC code, 0 when answered
}

// keyName is the key of rule's key number i checked in region: the
// ledger's keys carry their region, the others are shared.
func keyName(rule int, region string, i int) string {
	if rule == ruleLedger {
		return fmt.Sprintf("%s-k%03d", region, i)
	}
	return fmt.Sprintf("k%03d", i)
}

// recorder keeps every answer, per region.
type recorder struct {
	began time.Time
	mu    sync.Mutex
	log   [][]answer
	sent  atomic.Int64
}

func (rec *recorder) since() int64 { return int64(time.Since(rec.began)) }

func (rec *recorder) add(a answer) {
	rec.mu.Lock()
	rec.log[a.region] = append(rec.log[a.region], a)
	rec.mu.Unlock()
}

// all returns a copy of every answer.
func (rec *recorder) all() []answer {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	var out []answer
	for _, l := range rec.log {
		out = append(out, l...)
	}
	return out
}

// runTraffic sends perRegion checks a second to each region until ctx
// ends: rule by ruleWeights, key by a Zipf law (s = 1.5: the hottest key
// takes about 38%, the tail hundreds of keys), at most 64 in flight per
// region.
func (s *stack) runTraffic(ctx context.Context, rec *recorder, seed uint64, perRegion int) {
	var wg sync.WaitGroup
	for ri, name := range regions {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(ri)+1))
			zipf := rand.NewZipf(rng, 1.5, 1, numKeys-1)
			sem := make(chan struct{}, 64)
			var inflight sync.WaitGroup
			defer inflight.Wait()
			const tick = 10 * time.Millisecond
			t := time.NewTicker(tick)
			defer t.Stop()
			owed := 0.0
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				owed += float64(perRegion) * tick.Seconds()
				for ; owed >= 1; owed-- {
					w := rng.IntN(100)
					rule := 0
					for w >= ruleWeights[rule] {
						w -= ruleWeights[rule]
						rule++
					}
					k := int(zipf.Uint64())
					cost := 1.0
					switch rule {
					case ruleFast:
						cost = float64(1 + rng.IntN(8))
					case ruleLedger:
						cost = float64(1 + rng.IntN(3))
					}
					select {
					case sem <- struct{}{}:
					default:
						continue // a region that cannot keep up: the check is not sent
					}
					inflight.Go(func() {
						defer func() { <-sem }()
						a := answer{sent: rec.since(), region: uint8(ri), rule: uint8(rule), key: uint16(k), cost: float32(cost)}
						resp, err := s.check(context.Background(), name, ruleIDs[rule], keyName(rule, name, k), cost)
						a.done = rec.since()
						rec.sent.Add(1)
						if err != nil {
							a.code = uint8(status.Code(err))
						} else {
							a.allowed = resp.GetAllowed()
						}
						rec.add(a)
					})
				}
			}
		})
	}
	wg.Wait()
}

// probePeriod is how often each region checks its probes.
const probePeriod = 200 * time.Millisecond

// probes measure, for every pair of regions and every third of the hash
// slots, how far behind the destination's knowledge of the source's
// spending is: each tick the source checks, for each third of the slots,
// a new ledger key of that third (one admission each), and a monitor
// looks for those keys in the destination's Redis. The newest tick found
// applied says up to when the destination has heard of the source there
// (spends of one source apply in order per slot; a tick lost, to a killed
// limiterd or a failover, is passed over by the next one found).
type probes struct {
	began time.Time
	mu    sync.Mutex
	// admitted[src][third] are the ticks admitted, in order.
	admitted [][3][]probeTick
	// errored[src] are the ticks without an answer (counted or not).
	errored [][]probeTick
	// seen[dst][src][third] are the samples of the monitor.
	seen [][][3][]probeSample
}

type probeTick struct {
	key        string
	sent, done int64 // ns since began
}

type probeSample struct {
	at   int64 // ns since began
	upTo int64 // sent time of the newest tick applied, -1 for none
	next int64 // sent time of the oldest admitted tick not applied, -1 for none
}

// thirdOf says which third of the slots a slot is in: redis-cli gives the
// three primaries these ranges, and a failover moves a whole range.
func thirdOf(slot int) int {
	switch {
	case slot <= 5460:
		return 0
	case slot <= 10922:
		return 1
	}
	return 2
}

// probeKey is the ledger key of tick i of src in third: the first name
// probe-<src>-<i>-<n> whose slot is in it.
func probeKey(src string, i, third int) string {
	for n := 0; ; n++ {
		k := fmt.Sprintf("probe-%s-%d-%d", src, i, n)
		if thirdOf(redisstore.Slot(redisstore.Key(ruleIDs[ruleLedger], k))) == third {
			return k
		}
	}
}

func newProbes(began time.Time) *probes {
	p := &probes{began: began, admitted: make([][3][]probeTick, len(regions)), errored: make([][]probeTick, len(regions)), seen: make([][][3][]probeSample, len(regions))}
	for d := range regions {
		p.seen[d] = make([][3][]probeSample, len(regions))
	}
	return p
}

// run checks the probes in every region and watches for them in the
// others until ctx ends.
func (p *probes) run(ctx context.Context, s *stack) {
	var wg sync.WaitGroup
	for si, src := range regions {
		wg.Go(func() {
			t := time.NewTicker(probePeriod)
			defer t.Stop()
			for i := 0; ; i++ {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				for third := range 3 {
					k := probeKey(src, i, third)
					sent := int64(time.Since(p.began))
					resp, err := s.check(context.Background(), src, ruleIDs[ruleLedger], k, 1)
					tk := probeTick{key: k, sent: sent, done: int64(time.Since(p.began))}
					p.mu.Lock()
					switch {
					case err != nil:
						p.errored[si] = append(p.errored[si], tk)
					case resp.GetAllowed():
						p.admitted[si][third] = append(p.admitted[si][third], tk)
					}
					p.mu.Unlock()
				}
			}
		})
	}
	for di, dst := range regions {
		wg.Go(func() {
			// cursor[src][third]: index of the newest tick found applied, -1 for none.
			cursor := make([][3]int, len(regions))
			for i := range cursor {
				cursor[i] = [3]int{-1, -1, -1}
			}
			t := time.NewTicker(probePeriod)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				for si := range regions {
					if si == di {
						continue
					}
					for third := range 3 {
						p.mu.Lock()
						ticks := p.admitted[si][third]
						p.mu.Unlock()
						c := cursor[si][third]
						hi := min(len(ticks), c+1+50)
						if hi <= c+1 {
							p.sample(di, si, third, ticks, c)
							continue
						}
						pipe := s.regions[dst].rc.Pipeline()
						for _, tk := range ticks[c+1 : hi] {
							pipe.Exists(ctx, redisstore.Key(ruleIDs[ruleLedger], tk.key))
						}
						cmds, _ := pipe.Exec(ctx)
						failed := false
						for j, cmd := range cmds {
							n, err := cmd.(interface{ Result() (int64, error) }).Result()
							if err != nil {
								failed = true // a node down: say nothing of this third now
								break
							}
							if n == 1 {
								c = cursor[si][third] + 1 + j
							}
						}
						if failed {
							continue
						}
						cursor[si][third] = c
						p.sample(di, si, third, ticks, c)
					}
				}
			}
		})
	}
	wg.Wait()
}

func (p *probes) sample(di, si, third int, ticks []probeTick, c int) {
	sm := probeSample{at: int64(time.Since(p.began)), upTo: -1, next: -1}
	if c >= 0 {
		sm.upTo = ticks[c].sent
	}
	if c+1 < len(ticks) {
		sm.next = ticks[c+1].sent
	}
	p.mu.Lock()
	p.seen[di][si][third] = append(p.seen[di][si][third], sm)
	p.mu.Unlock()
}
