// Package topowatch keeps a daemon's topology current: it reads
// --region.topology-file again every poll, checks a changed file against
// the topology it would replace, and puts it in force at its effective_at,
// by this process's clock (a timer, not the next poll), or at once when it
// has none or it has passed. Both daemons use it.
package topowatch

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/pkg/region"
)

// DefaultPoll is the default of --region.topology-poll: reading a small file
// once a second costs nothing, and a file replaced by a Kubernetes ConfigMap
// (a symlink swapped) is seen like any other change.
const DefaultPoll = time.Second

// Poll bounds, for the flag's validation.
const (
	MinPoll = 10 * time.Millisecond
	MaxPoll = 10 * time.Minute
)

// forcedGap is the shortest time between two reads asked for by Reload (a
// peer's forward): a burst of forwards costs one read per gap.
const forcedGap = 20 * time.Millisecond

// ErrOwnRegionMissing: a topology without this process's --region.
var ErrOwnRegionMissing = fmt.Errorf("%w: this process's --region is not in it", region.ErrInvalid)

// Options configure a Watcher. File and Region are required.
type Options struct {
	// File is --region.topology-file.
	File string
	// Region is this process's --region: a topology without it is refused.
	Region string
	// Poll is how often the file is read (0: DefaultPoll).
	Poll time.Duration
	// Validate, when set, is what a new topology must also pass: the rules
	// in force must be valid under it. Its error should name the rule and
	// the field.
	Validate func(*region.Topology) error
	// OnSwitch, when set, is called with each topology put in force after
	// New, one at a time, in order; an error keeps the old one in force (the
	// switch is logged and counted as a failure).
	OnSwitch func(old, next *region.Topology) error
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Watcher holds the topology in force and the one pending, if any. Make it
// with New and run it with Run; its methods are safe for concurrent use.
type Watcher struct {
	opts Options
	log  *slog.Logger

	active  atomic.Pointer[region.Topology]
	pending atomic.Pointer[region.Topology]

	mu sync.Mutex // orders reads and switches; guards the fields below
	// content is the file's content last read; refused says it was not
	// loaded, and refusal is the error logged for it (logged once).
	content    []byte
	refused    bool
	refusal    string
	lastErr    error
	timer      *time.Timer
	lastForced time.Time
	stopped    bool

	generation *prometheus.GaugeVec
	regions    prometheus.Gauge
	failures   prometheus.Counter
	switches   prometheus.Counter
}

// New reads the file and puts its topology in force at once, whatever its
// effective_at (the process has no other); it registers the metrics on reg.
func New(opts Options, reg prometheus.Registerer) (*Watcher, error) {
	if opts.Poll == 0 {
		opts.Poll = DefaultPoll
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	data, err := os.ReadFile(opts.File)
	if err != nil {
		return nil, err
	}
	topo, err := region.Parse(opts.File, data)
	if err != nil {
		return nil, err
	}
	if !topo.Has(opts.Region) {
		return nil, fmt.Errorf("%s: %w: regions: %q is not one of them", opts.File, ErrOwnRegionMissing, opts.Region)
	}
	w := &Watcher{opts: opts, log: opts.Logger.With("component", "topology", "file", opts.File), content: data,
		generation: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limiter_topology_generation",
			Help: "Generation of the topology in force (state active) and of the one loaded and waiting for its effective_at (state pending, only while one waits).",
		}, []string{"state"}),
		regions: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "limiter_topology_regions",
			Help: "Regions of the topology in force.",
		}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_topology_reload_failures_total",
			Help: "Topology files refused (unreadable, invalid, a lower generation, regions changed without a higher one, this region missing, the rules in force invalid under it), once per distinct content, and switches refused.",
		}),
		switches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limiter_topology_switches_total",
			Help: "Topologies put in force after start.",
		}),
	}
	for _, c := range []prometheus.Collector{w.generation, w.regions, w.failures, w.switches} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	w.active.Store(topo)
	w.generation.WithLabelValues("active").Set(float64(topo.Generation()))
	w.regions.Set(float64(len(topo.Names())))
	return w, nil
}

// Active is the topology in force.
func (w *Watcher) Active() *region.Topology { return w.active.Load() }

// Pending is the topology waiting for its effective_at, or nil.
func (w *Watcher) Pending() *region.Topology { return w.pending.Load() }

// Run reads the file every poll until ctx ends; a pending topology's
// timer is stopped then.
func (w *Watcher) Run(ctx context.Context) {
	t := time.NewTicker(w.opts.Poll)
	defer t.Stop()
	defer func() {
		w.mu.Lock()
		w.stopped = true
		if w.timer != nil {
			w.timer.Stop()
		}
		w.mu.Unlock()
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			w.mu.Lock()
			w.read()
			w.mu.Unlock()
		}
	}
}

// LastError is why the file last read was refused, or nil when it was
// loaded (or is the one in force).
func (w *Watcher) LastError() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lastErr
}

// Reload reads the file now, unless it was read for another Reload in the
// last few milliseconds, and returns the topology in force then. A peer
// region's forward from a newer generation calls it, so a region whose
// file came late catches up on the first forward, not at the next poll.
func (w *Watcher) Reload() *region.Topology {
	w.mu.Lock()
	defer w.mu.Unlock()
	if now := time.Now(); !w.stopped && now.Sub(w.lastForced) >= forcedGap {
		w.lastForced = now
		w.read()
	}
	return w.active.Load()
}

// read reads the file and loads it if it changed. Called with mu held.
func (w *Watcher) read() {
	if w.stopped {
		return
	}
	if p := w.pending.Load(); p != nil && !p.EffectiveAt().After(time.Now()) {
		// Its timer is due: never decide with a topology past its time.
		w.switchTo(p)
	}
	data, err := os.ReadFile(w.opts.File)
	if err != nil {
		w.refuse(nil, err)
		return
	}
	if bytes.Equal(data, w.content) && !w.refused {
		return
	}
	w.content = data
	next, err := w.check(data)
	if err != nil {
		w.refuse(data, err)
		return
	}
	w.refused, w.refusal, w.lastErr = false, "", nil
	w.load(next)
}

// check validates a file's content as the next topology.
func (w *Watcher) check(data []byte) (*region.Topology, error) {
	next, err := region.Parse(w.opts.File, data)
	if err != nil {
		return nil, err
	}
	if !next.Has(w.opts.Region) {
		return nil, fmt.Errorf("%s: %w: regions: %q is not one of them", w.opts.File, ErrOwnRegionMissing, w.opts.Region)
	}
	if err := w.latest().CheckNext(next); err != nil {
		return nil, fmt.Errorf("%s: %w", w.opts.File, err)
	}
	if w.opts.Validate != nil {
		if err := w.opts.Validate(next); err != nil {
			return nil, fmt.Errorf("%s: the rules in force are invalid under it: %w", w.opts.File, err)
		}
	}
	return next, nil
}

// latest is the topology a new file replaces: the pending one, else the
// one in force.
func (w *Watcher) latest() *region.Topology {
	if p := w.pending.Load(); p != nil {
		return p
	}
	return w.active.Load()
}

// refuse keeps the topology in force; the error is logged and counted
// once per distinct content (data nil: the file could not be read).
func (w *Watcher) refuse(data []byte, err error) {
	w.refused = data != nil
	w.lastErr = err
	if err.Error() == w.refusal {
		return
	}
	w.refusal = err.Error()
	w.failures.Inc()
	w.log.Error("topology file refused, the topology in force stays", "generation", w.active.Load().Generation(), "err", err)
}

// load schedules next, or puts it in force at once.
func (w *Watcher) load(next *region.Topology) {
	cur := w.latest()
	if next.Generation() == cur.Generation() && next.SameRegions(cur) &&
		(next.EffectiveAt().Equal(cur.EffectiveAt()) || cur == w.active.Load()) {
		return // another spelling of the same topology, or one in force already
	}
	if w.timer != nil {
		w.timer.Stop()
		w.timer = nil
	}
	w.pending.Store(nil)
	at := next.EffectiveAt()
	if wait := time.Until(at); wait > 0 {
		w.pending.Store(next)
		w.generation.WithLabelValues("pending").Set(float64(next.Generation()))
		w.timer = time.AfterFunc(wait, func() { w.due(next) })
		w.log.Info("topology loaded, pending until its effective_at", "generation", next.Generation(),
			"effective_at", at, "regions", next.Names())
		return
	}
	w.generation.DeleteLabelValues("pending")
	w.switchTo(next)
}

// due runs at a pending topology's effective_at.
func (w *Watcher) due(next *region.Topology) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped || w.pending.Load() != next {
		return // replaced meanwhile
	}
	w.switchTo(next)
}

// switchTo puts next in force. Called with mu held.
func (w *Watcher) switchTo(next *region.Topology) {
	if w.pending.Load() == next {
		w.pending.Store(nil)
		w.generation.DeleteLabelValues("pending")
		w.timer = nil
	}
	old := w.active.Load()
	if w.opts.OnSwitch != nil {
		if err := w.opts.OnSwitch(old, next); err != nil {
			w.failures.Inc()
			w.lastErr = err
			w.log.Error("topology switch refused, the topology in force stays", "generation", old.Generation(),
				"next_generation", next.Generation(), "err", err)
			return
		}
	}
	w.active.Store(next)
	w.generation.WithLabelValues("active").Set(float64(next.Generation()))
	w.regions.Set(float64(len(next.Names())))
	w.switches.Inc()
	w.log.Info("topology switched", "generation", next.Generation(), "previous_generation", old.Generation(),
		"regions", next.Names())
}
