// Package loadgen sends Check (or health) requests to limiterd at a chosen
// concurrency and rate, and reports throughput, latency, decisions, errors
// and how closely the admissions follow the rule.
//
// In closed-loop mode each worker sends as soon as its previous answer
// arrives. In open-loop mode (a target rate) requests are due on a fixed
// schedule, and latency is measured from the time a request was due, not
// from when a free worker got to send it, so a slow server shows as latency
// instead of as fewer samples (no coordinated omission).
package loadgen

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// Latencies are recorded in microseconds with 3 significant digits, up to
// maxLatency; longer ones are recorded as maxLatency.
const (
	sigFigs    = 3
	maxLatency = 2 * (MaxWarmup + MaxDuration + MaxTimeout)
)

// CodeNotServing is the key in Result.ErrorsByCode of health answers whose
// status is not SERVING; the other keys are gRPC code names.
const CodeNotServing = "NotServing"

var errNotServing = errors.New("health status is not SERVING")

// Run sends load to o.Target as o describes and returns what it measured.
// It connects every connection first and fails if one is not ready within
// o.Timeout. The run stops by itself after o.Warmup + o.Duration (plus the
// answers in flight) or after o.Requests measured requests. When ctx ends
// first, Run returns what it measured so far, with Interrupted set.
func Run(ctx context.Context, o Options) (*Result, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	conns, err := dial(ctx, o.Target, o.Conns, o.Timeout)
	if err != nil {
		return nil, err
	}
	defer func() {
		for _, cc := range conns {
			cc.Close()
		}
	}()
	checkers := make([]checker, len(conns))
	for i, cc := range conns {
		switch o.Mode {
		case ModeHealth:
			checkers[i] = healthChecker{client: healthpb.NewHealthClient(cc), timeout: o.Timeout}
		default:
			checkers[i] = limiterChecker{client: limiterv1.NewLimiterClient(cc), rule: o.Rule, cost: o.Cost, timeout: o.Timeout}
		}
	}
	return newRunner(o, checkers).run(ctx), nil
}

// dial opens n connections to target and waits until all are ready.
func dial(ctx context.Context, target string, n int, timeout time.Duration) ([]*grpc.ClientConn, error) {
	conns := make([]*grpc.ClientConn, 0, n)
	closeAll := func() {
		for _, cc := range conns {
			cc.Close()
		}
	}
	for range n {
		cc, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("dial %s: %w", target, err)
		}
		conns = append(conns, cc)
		cc.Connect()
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for _, cc := range conns {
		for s := cc.GetState(); s != connectivity.Ready; s = cc.GetState() {
			if !cc.WaitForStateChange(ctx, s) {
				closeAll()
				return nil, fmt.Errorf("connect to %s: still %s: %w", target, s, ctx.Err())
			}
		}
	}
	return conns, nil
}

// checker sends one request and says whether it was allowed.
type checker interface {
	check(ctx context.Context, key string) (allowed bool, err error)
}

type limiterChecker struct {
	client  limiterv1.LimiterClient
	rule    string
	cost    float64
	timeout time.Duration
}

func (c limiterChecker) check(ctx context.Context, key string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	resp, err := c.client.Check(ctx, &limiterv1.CheckRequest{RuleId: c.rule, Key: key, Cost: c.cost})
	if err != nil {
		return false, err
	}
	return resp.GetAllowed(), nil
}

// healthChecker counts a SERVING answer as allowed.
type healthChecker struct {
	client  healthpb.HealthClient
	timeout time.Duration
}

func (c healthChecker) check(ctx context.Context, _ string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	resp, err := c.client.Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return false, err
	}
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return false, errNotServing
	}
	return true, nil
}

// errorCode names the kind of a request error for Result.ErrorsByCode.
func errorCode(err error) string {
	if errors.Is(err, errNotServing) {
		return CodeNotServing
	}
	return status.Code(err).String()
}

// keyStats counts one key over the whole run. first and last are offsets
// from the start of the run, in nanoseconds.
type keyStats struct {
	sent, allowed, limited, errors atomic.Int64
	first, last                    atomic.Int64
}

func (k *keyStats) sentAt(off int64) {
	k.sent.Add(1)
	for {
		cur := k.first.Load()
		if off >= cur || k.first.CompareAndSwap(cur, off) {
			return
		}
	}
}

func (k *keyStats) doneAt(off int64, allowed bool, err error) {
	switch {
	case err != nil:
		k.errors.Add(1)
	case allowed:
		k.allowed.Add(1)
	default:
		k.limited.Add(1)
	}
	for {
		cur := k.last.Load()
		if off <= cur || k.last.CompareAndSwap(cur, off) {
			return
		}
	}
}

// shard holds the measured results of some of the workers.
type shard struct {
	mu      sync.Mutex
	hist    *hdrhistogram.Histogram
	allowed int64
	limited int64
	errors  map[string]int64
}

func newHistogram() *hdrhistogram.Histogram {
	return hdrhistogram.New(1, maxLatency.Microseconds(), sigFigs)
}

func (s *shard) record(latency time.Duration, allowed bool, err error) {
	us := min(max(latency.Microseconds(), 0), maxLatency.Microseconds())
	s.mu.Lock()
	defer s.mu.Unlock()
	_ = s.hist.RecordValue(us) // in range by construction
	switch {
	case err != nil:
		s.errors[errorCode(err)]++
	case allowed:
		s.allowed++
	default:
		s.limited++
	}
}

// runner is the state of one load run.
type runner struct {
	o        Options
	checkers []checker
	seed     uint64
	keys     []string
	perKey   []keyStats // nil in health mode
	shards   []*shard

	start, measureStart, end time.Time
	// interval is the time between due times in nanoseconds, 0 in a
	// closed loop. Request i of an open loop is due at start + i*interval,
	// and is measured from firstMeasured on.
	interval      float64
	firstMeasured int64
	// next is the next request index of an open loop, or the number of
	// measured requests taken in a closed loop.
	next         atomic.Int64
	measuredSent atomic.Int64
}

func newRunner(o Options, checkers []checker) *runner {
	r := &runner{o: o, checkers: checkers, seed: o.Seed}
	if r.seed == 0 {
		r.seed = rand.Uint64()
	}
	if o.Mode == ModeCheck {
		r.keys = keyNames(o.KeyPrefix, o.Keys)
		r.perKey = make([]keyStats, o.Keys)
		for i := range r.perKey {
			r.perKey[i].first.Store(math.MaxInt64)
			r.perKey[i].last.Store(-1)
		}
	}
	n := min(o.Concurrency, 2*runtime.GOMAXPROCS(0))
	for range n {
		r.shards = append(r.shards, &shard{hist: newHistogram(), errors: make(map[string]int64)})
	}
	if o.Rate > 0 {
		r.interval = float64(time.Second) / o.Rate
		r.firstMeasured = int64(math.Ceil(float64(o.Warmup) / r.interval))
	}
	return r
}

// due returns the time request i of an open loop is due.
func (r *runner) due(i int64) time.Time {
	return r.start.Add(time.Duration(float64(i) * r.interval))
}

func (r *runner) run(ctx context.Context) *Result {
	r.start = time.Now()
	r.measureStart = r.start.Add(r.o.Warmup)
	r.end = r.measureStart.Add(r.o.Duration)
	var wg sync.WaitGroup
	for w := range r.o.Concurrency {
		wg.Go(func() { r.work(ctx, w) })
	}
	wg.Wait()
	finish := time.Now()
	return r.result(finish, interrupted(ctx, finish))
}

// interrupted reports whether ctx ended by now. The deadline of ctx counts
// once passed, before ctx's own timer fires: a request context derived from
// ctx can fail on it first.
func interrupted(ctx context.Context, now time.Time) bool {
	if ctx.Err() != nil {
		return true
	}
	dl, ok := ctx.Deadline()
	return ok && !now.Before(dl)
}

// work is the loop of worker w.
func (r *runner) work(ctx context.Context, w int) {
	c := r.checkers[w%len(r.checkers)]
	sh := r.shards[w%len(r.shards)]
	var picker *keyPicker
	if r.perKey != nil {
		picker = newKeyPicker(r.o.KeyDist, r.o.Keys, r.o.ZipfS, r.seed, uint64(w))
	}
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		due, measured, ok := r.take(ctx, timer)
		if !ok {
			return
		}
		var key string
		var ks *keyStats
		if picker != nil {
			k := picker.next()
			key, ks = r.keys[k], &r.perKey[k]
			ks.sentAt(int64(time.Since(r.start)))
		}
		if measured {
			r.measuredSent.Add(1)
		}
		allowed, err := c.check(ctx, key)
		done := time.Now()
		if interrupted(ctx, done) {
			return // the answer may be cut short, so it is not counted
		}
		if ks != nil {
			ks.doneAt(int64(done.Sub(r.start)), allowed, err)
		}
		if measured {
			sh.record(done.Sub(due), allowed, err)
		}
	}
}

// take waits for the next request a worker may send and returns the time it
// is due and whether it is measured. It returns ok false when the run is over.
func (r *runner) take(ctx context.Context, timer *time.Timer) (due time.Time, measured, ok bool) {
	if interrupted(ctx, time.Now()) {
		return time.Time{}, false, false
	}
	if r.interval == 0 {
		now := time.Now()
		if !now.Before(r.end) {
			return time.Time{}, false, false
		}
		measured = !now.Before(r.measureStart)
		if measured && r.o.Requests > 0 && r.next.Add(1) > r.o.Requests {
			return time.Time{}, false, false
		}
		return now, measured, true
	}
	i := r.next.Add(1) - 1
	measured = i >= r.firstMeasured
	if measured && r.o.Requests > 0 && i-r.firstMeasured >= r.o.Requests {
		return time.Time{}, false, false
	}
	due = r.due(i)
	if !due.Before(r.end) {
		return time.Time{}, false, false
	}
	if d := time.Until(due); d > 0 {
		timer.Reset(d)
		select {
		case <-ctx.Done():
			return time.Time{}, false, false
		case <-timer.C:
		}
	} else if !time.Now().Before(r.end) {
		return time.Time{}, false, false // behind schedule at the end: the rest is unsent
	}
	return due, measured, true
}

// scheduled returns the number of measured requests an open loop has due
// before the end.
func (r *runner) scheduled() int64 {
	n := int64(math.Ceil(float64(r.end.Sub(r.start)) / r.interval))
	for n > 0 && !r.due(n-1).Before(r.end) {
		n--
	}
	for r.due(n).Before(r.end) {
		n++
	}
	n = max(n-r.firstMeasured, 0)
	if r.o.Requests > 0 {
		n = min(n, r.o.Requests)
	}
	return n
}

func (r *runner) result(finish time.Time, interrupted bool) *Result {
	res := &Result{
		Options:      r.o,
		Seed:         r.seed,
		Elapsed:      max(finish.Sub(r.measureStart), 0),
		ErrorsByCode: make(map[string]int64),
		Histogram:    newHistogram(),
		Interrupted:  interrupted,
	}
	if r.perKey == nil {
		res.Seed = 0
	}
	for _, sh := range r.shards {
		res.Histogram.Merge(sh.hist)
		res.Allowed += sh.allowed
		res.Limited += sh.limited
		for code, n := range sh.errors {
			res.ErrorsByCode[code] += n
			res.Errors += n
		}
	}
	res.Total = res.Allowed + res.Limited + res.Errors
	if s := res.Elapsed.Seconds(); s > 0 {
		res.ChecksPerSecond = float64(res.Total) / s
	}
	res.Latency = latencyOf(res.Histogram)
	if r.interval > 0 && !interrupted {
		res.Unsent = max(r.scheduled()-r.measuredSent.Load(), 0)
	}
	for i := range r.perKey {
		ks := &r.perKey[i]
		sent := ks.sent.Load()
		if sent == 0 {
			continue
		}
		kr := KeyResult{
			Key:     r.keys[i],
			Sent:    sent,
			Allowed: ks.allowed.Load(),
			Limited: ks.limited.Load(),
			Errors:  ks.errors.Load(),
		}
		if first, last := ks.first.Load(), ks.last.Load(); last > first {
			kr.Window = time.Duration(last - first)
		}
		res.PerKey = append(res.PerKey, kr)
	}
	if r.o.accuracy() {
		a := ComputeAccuracy(res.PerKey, r.o.ExpectRate, r.o.ExpectBurst, r.o.Cost)
		res.Accuracy = &a
	}
	return res
}
