// Package rulesource keeps a daemon's rules current without a deploy: the
// rules file, reloaded when it changes, and the rules put through the admin
// API, kept in a NATS JetStream key-value bucket that every limiterd and
// reconciler watches, with a periodic full read that heals a missed update.
package rulesource

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/rules"
)

// Defaults.
const (
	DefaultBucket         = "limiter_rules"
	DefaultFileInterval   = time.Second
	DefaultResyncInterval = 30 * time.Second
	// DefaultMaxRules caps the rules in force (file and admin together):
	// a thousand rules cost a daemon a few hundred kilobytes and keep a
	// change to one of them well under a millisecond of work per daemon.
	DefaultMaxRules = 1000
	// MaxMaxRules is the largest cap accepted.
	MaxMaxRules = 100_000
)

// ErrTooManyRules: the rules would be more than Options.MaxRules. It is
// wrapped in a *rules.Error whose Field is "rules".
var ErrTooManyRules = errors.New("too many rules")

// ErrNoStore is returned by Put and Delete without a key-value bucket.
var ErrNoStore = errors.New("no rules store: start with --nats.url to change rules at run time")

// ErrReadOnly is returned by Put and Delete of a daemon whose NATS identity
// may only read the rules bucket.
var ErrReadOnly = errors.New("this limiterd's NATS identity only reads rules: put them through a limiterd started with --admin.nats-nkey-seed-file or --admin.nats-creds-file (the admin identity)")

// ErrNoBucket is the watchers' error while the key-value bucket does not
// exist: only a writer (Put, Delete) creates it.
var ErrNoBucket = errors.New("the rules bucket does not exist yet: the first rule put through the admin API creates it")

// ErrNotFound is returned by Delete for an id the bucket does not hold.
var ErrNotFound = errors.New("no such rule put through the admin API")

// Options configure a Source.
type Options struct {
	// File is the rules file; it is read again when its content changes.
	File string
	// FileInterval is how often the file is looked at.
	FileInterval time.Duration
	// NATS, when set, holds the admin rules in Bucket; Run watches it.
	NATS *nats.Conn
	// Writer, when set, is the connection Put and Delete write the bucket
	// through (an identity allowed to); without it they use NATS. Only a
	// writer creates the bucket: watchers wait for it.
	Writer *nats.Conn
	// ReadOnly, without a Writer, makes Put and Delete fail at once with
	// ErrReadOnly instead of trying NATS: the daemon's identity only reads
	// rules (the server would refuse the write, and the caller would wait).
	ReadOnly bool
	Bucket   string
	// ResyncInterval is how often the whole bucket is read again.
	ResyncInterval time.Duration
	// MaxRules caps the rules in force, the file's and the bucket's
	// together (0: DefaultMaxRules). A file over it is refused, a Put past
	// it too; bucket entries past it (written around the API) are left out.
	MaxRules int
	// ValidateRule, when set, is what a rule must also pass to be in
	// force, beyond its own validation: the daemons check pinned rules'
	// home_keys against their topology. Its error should be a *rules.Error
	// naming the field. A file rule it refuses refuses the file; a bucket
	// rule it refuses is left out alone (counted, logged), the others stay.
	ValidateRule func(*rules.Rule) error
	// OnChange gets every new rule set, from the goroutine of Run, before
	// it is reported as in force (Current, the version metric); an error
	// refuses the set, and the rules in force stay.
	OnChange func(*rules.Set) error
	Logger   *slog.Logger
}

// Source is the current rule set of one daemon. Safe for concurrent use.
type Source struct {
	opts Options
	log  *slog.Logger
	m    *metrics

	// rebuildMu orders rebuilds: the set handed to OnChange last is the
	// one in force.
	rebuildMu sync.Mutex

	mu        sync.Mutex
	fileRules []*rules.Rule
	fileData  []byte
	kvRules   map[string]kvRule
	// refused are the bucket entries refused, by id, with their revision:
	// counted and logged once, not at every resync.
	refused map[string]uint64
	// overCap are the bucket rules left out last by the cap, to log a
	// change only.
	overCap string
	current *rules.Set

	kvMu sync.Mutex
	kv   jetstream.KeyValue // read and watched through NATS
	wkv  jetstream.KeyValue // written through Writer, or NATS
	// created wakes a watcher waiting for the bucket once the writer has it.
	created chan struct{}
}

type kvRule struct {
	rule     *rules.Rule
	revision uint64
}

// New loads the rules file: a bad file is an error here, since a daemon
// must not start without its rules. Later bad versions are refused and the
// rules in force kept.
func New(opts Options, reg prometheus.Registerer) (*Source, error) {
	if opts.FileInterval <= 0 {
		opts.FileInterval = DefaultFileInterval
	}
	if opts.ResyncInterval <= 0 {
		opts.ResyncInterval = DefaultResyncInterval
	}
	if opts.Bucket == "" {
		opts.Bucket = DefaultBucket
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.MaxRules <= 0 {
		opts.MaxRules = DefaultMaxRules
	}
	s := &Source{opts: opts, log: opts.Logger, kvRules: map[string]kvRule{}, refused: map[string]uint64{}, created: make(chan struct{}, 1)}
	data, err := os.ReadFile(opts.File)
	if err != nil {
		return nil, err
	}
	set, err := s.parseFile(data)
	if err != nil {
		return nil, err
	}
	s.fileRules, s.fileData, s.current = set.Rules(), data, set
	if s.m, err = newMetrics(reg, s); err != nil {
		return nil, err
	}
	s.m.reloads.WithLabelValues("file", "success").Inc()
	return s, nil
}

// parseFile parses and validates the rules file: each rule, the cap and
// ValidateRule.
func (s *Source) parseFile(data []byte) (*rules.Set, error) {
	set, err := rules.Parse(s.opts.File, data)
	if err != nil {
		return nil, err
	}
	if n := len(set.Rules()); n > s.opts.MaxRules {
		return nil, &rules.Error{File: s.opts.File, Index: -1, Field: "rules",
			Err: fmt.Errorf("%w: %d rules, the cap is %d (--rules.max-rules)", ErrTooManyRules, n, s.opts.MaxRules)}
	}
	if s.opts.ValidateRule != nil {
		for i, r := range set.Rules() {
			if err := s.opts.ValidateRule(r); err != nil {
				var e *rules.Error
				if errors.As(err, &e) {
					e.File, e.Index = s.opts.File, i
					return nil, e
				}
				return nil, &rules.Error{File: s.opts.File, Index: i, ID: r.ID, Err: err}
			}
		}
	}
	return set, nil
}

// UseNATS gives the source its connection, before Run.
func (s *Source) UseNATS(nc *nats.Conn) { s.opts.NATS = nc }

// UseWriter gives Put and Delete a connection of their own, before Run.
func (s *Source) UseWriter(nc *nats.Conn) { s.opts.Writer = nc }

// Current is the rule set in force.
func (s *Source) Current() *rules.Set {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.current
}

// Run watches the file and the bucket until ctx ends.
func (s *Source) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() { s.watchFile(ctx) })
	if s.opts.NATS != nil {
		wg.Go(func() { s.watchBucket(ctx) })
	}
	wg.Wait()
}

func (s *Source) watchFile(ctx context.Context) {
	t := time.NewTicker(s.opts.FileInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		data, err := os.ReadFile(s.opts.File)
		if err != nil {
			s.failed("file", fmt.Errorf("read %s: %w", s.opts.File, err))
			continue
		}
		s.mu.Lock()
		same := bytes.Equal(data, s.fileData)
		s.mu.Unlock()
		if same {
			continue
		}
		set, err := s.parseFile(data)
		if err != nil {
			s.mu.Lock()
			s.fileData = data // do not log the same bad file every second
			s.mu.Unlock()
			s.failed("file", err)
			continue
		}
		s.mu.Lock()
		s.fileRules, s.fileData = set.Rules(), data
		s.mu.Unlock()
		s.rebuild("file")
	}
}

func (s *Source) failed(source string, err error) {
	s.m.reloads.WithLabelValues(source, "failure").Inc()
	s.log.Error("rules not reloaded; the rules in force stay", "source", source, "err", err)
}

// rebuild makes the set from the file's rules and the bucket's, and puts
// it in force. A bucket rule that clashes with the file's, or past the cap,
// is left out, with an error; a set OnChange refuses is counted as a
// failure and the rules in force stay, so that Current, the version metric
// and the daemon's engine always agree.
func (s *Source) rebuild(source string) {
	s.rebuildMu.Lock()
	defer s.rebuildMu.Unlock()
	s.mu.Lock()
	list := slices.Clone(s.fileRules)
	ids := make(map[string]bool, len(list))
	for _, r := range list {
		ids[r.ID] = true
	}
	kv := make([]kvRule, 0, len(s.kvRules))
	var clashes []string
	for id, r := range s.kvRules {
		if ids[id] {
			clashes = append(clashes, id)
			continue
		}
		kv = append(kv, r)
	}
	// The earliest puts first: past the cap, the latest are left out.
	slices.SortFunc(kv, func(a, b kvRule) int { return cmp.Compare(a.revision, b.revision) })
	var over []string
	for _, r := range kv {
		if len(list) >= s.opts.MaxRules {
			over = append(over, r.rule.ID)
			continue
		}
		list = append(list, r.rule)
	}
	overCap := strings.Join(over, ",")
	overChanged := overCap != s.overCap
	s.overCap = overCap
	s.mu.Unlock()
	if len(clashes) > 0 {
		slices.Sort(clashes)
		s.log.Error("admin rules with the id of a file rule are ignored", "ids", clashes)
	}
	if overChanged && len(over) > 0 {
		s.m.reloads.WithLabelValues("admin", "failure").Inc()
		s.log.Error("admin rules past --rules.max-rules are left out", "max_rules", s.opts.MaxRules, "ids", over)
	}
	set, err := rules.Build(list)
	if err == nil && s.opts.OnChange != nil {
		err = s.opts.OnChange(set)
	}
	if err != nil {
		s.failed(source, err)
		return
	}
	s.mu.Lock()
	s.current = set
	s.mu.Unlock()
	s.m.reloads.WithLabelValues(source, "success").Inc()
	s.m.lastReload.SetToCurrentTime()
	s.log.Info("rules in force", "source", source, "rules", len(set.Rules()), "version", set.Version())
}

// bucket opens the key-value bucket for reading; it creates nothing (a
// reader's identity may not), so a missing bucket is ErrNoBucket.
func (s *Source) bucket(ctx context.Context) (jetstream.KeyValue, error) {
	s.kvMu.Lock()
	defer s.kvMu.Unlock()
	if s.kv != nil {
		return s.kv, nil
	}
	if s.opts.NATS == nil {
		return nil, ErrNoStore
	}
	js, err := jetstream.New(s.opts.NATS)
	if err != nil {
		return nil, err
	}
	kv, err := js.KeyValue(ctx, s.opts.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("%w (%s)", ErrNoBucket, s.opts.Bucket)
	}
	if err != nil {
		return nil, err
	}
	s.kv = kv
	return kv, nil
}

// writeBucket opens the key-value bucket through the writer, creating it
// when it is missing.
func (s *Source) writeBucket(ctx context.Context) (jetstream.KeyValue, error) {
	s.kvMu.Lock()
	defer s.kvMu.Unlock()
	if s.wkv != nil {
		return s.wkv, nil
	}
	nc := s.opts.Writer
	if nc == nil {
		if s.opts.ReadOnly && s.opts.NATS != nil {
			return nil, ErrReadOnly
		}
		nc = s.opts.NATS
	}
	if nc == nil {
		return nil, ErrNoStore
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	kv, err := natsconn.EnsureKeyValue(ctx, js, jetstream.KeyValueConfig{
		Bucket: s.opts.Bucket, Description: "limiterd rules put through the admin API", History: 5,
	})
	if err != nil {
		return nil, err
	}
	s.wkv = kv
	select {
	case s.created <- struct{}{}:
	default:
	}
	return kv, nil
}

// watchBucket follows the bucket's updates, and reads it whole every
// ResyncInterval; both retry while NATS is away.
func (s *Source) watchBucket(ctx context.Context) {
	missing := false
	for ctx.Err() == nil {
		err := s.watchOnce(ctx)
		switch {
		case err == nil || ctx.Err() != nil:
		case errors.Is(err, ErrNoBucket):
			// Logged once: a fleet without admin rules waits quietly.
			if !missing {
				s.log.Info("rules bucket not there yet, watching for it (only the admin API's writer creates it)", "bucket", s.opts.Bucket)
			}
			missing = true
		default:
			s.log.Warn("rules bucket not watched, retrying", "err", err)
		}
		if err != nil && ctx.Err() == nil {
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			case <-s.created:
			}
		}
	}
}

func (s *Source) watchOnce(ctx context.Context) error {
	kv, err := s.bucket(ctx)
	if err != nil {
		return err
	}
	w, err := kv.WatchAll(ctx)
	if err != nil {
		return err
	}
	defer w.Stop()
	resync := time.NewTicker(s.opts.ResyncInterval)
	defer resync.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-resync.C:
			if err := s.resync(ctx, kv); err != nil {
				return err
			}
		case e, ok := <-w.Updates():
			if !ok {
				return errors.New("watcher closed")
			}
			if e == nil {
				// The initial values are in.
				s.rebuild("admin")
				continue
			}
			if s.apply(e) {
				s.rebuild("admin")
			}
		}
	}
}

// apply records one bucket entry; it reports whether anything changed.
func (s *Source) apply(e jetstream.KeyValueEntry) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	id := e.Key()
	if e.Operation() != jetstream.KeyValuePut {
		delete(s.refused, id)
		if _, ok := s.kvRules[id]; !ok {
			return false
		}
		delete(s.kvRules, id)
		return true
	}
	if old, ok := s.kvRules[id]; ok && old.revision == e.Revision() {
		return false
	}
	if rev, ok := s.refused[id]; ok && rev == e.Revision() {
		return false
	}
	r, err := rules.ParseRule(e.Value(), rules.SourceAdmin)
	if err == nil && r.ID != id {
		err = fmt.Errorf("stored under %q but its id is %q", id, r.ID)
	}
	if err == nil && s.opts.ValidateRule != nil {
		err = s.opts.ValidateRule(r)
	}
	if err != nil {
		// Written around the API: refuse it alone, keep the rest (and
		// this id's previous revision, if one was in force).
		s.refused[id] = e.Revision()
		s.m.reloads.WithLabelValues("admin", "failure").Inc()
		s.log.Error("admin rule refused; the other rules stay in force", "id", id, "revision", e.Revision(), "err", err)
		return false
	}
	delete(s.refused, id)
	s.kvRules[id] = kvRule{rule: r, revision: e.Revision()}
	return true
}

// resync reads the whole bucket, healing an update the watcher missed.
func (s *Source) resync(ctx context.Context, kv jetstream.KeyValue) error {
	lister, err := kv.ListKeys(ctx)
	if err != nil {
		return err
	}
	seen := map[string]bool{}
	changed := false
	for id := range lister.Keys() {
		seen[id] = true
		e, err := kv.Get(ctx, id)
		if err != nil {
			continue
		}
		changed = s.apply(e) || changed
	}
	s.mu.Lock()
	for id := range s.kvRules {
		if !seen[id] {
			delete(s.kvRules, id)
			changed = true
		}
	}
	for id := range s.refused {
		if !seen[id] {
			delete(s.refused, id)
		}
	}
	s.mu.Unlock()
	if changed {
		s.rebuild("admin")
	}
	return nil
}

// Put validates a rule (one entry of "rules:", YAML or JSON) against the
// rules in force and stores it; every watcher then puts it in force. An
// invalid rule is an error wrapping rules.ErrInvalid, and nothing changes.
func (s *Source) Put(ctx context.Context, data []byte) (uint64, error) {
	r, err := rules.ParseRule(data, rules.SourceAdmin)
	if err != nil {
		return 0, err
	}
	if err := s.Validate(r); err != nil {
		return 0, err
	}
	kv, err := s.writeBucket(ctx)
	if err != nil {
		return 0, err
	}
	return kv.Put(ctx, r.ID, r.YAML())
}

// Validate checks an admin rule against the whole set it would join: the
// file's rules, the bucket's and this one (rules.Build), the cap and
// ValidateRule. Its errors wrap rules.ErrInvalid and name the field.
func (s *Source) Validate(r *rules.Rule) error {
	if s.opts.ValidateRule != nil {
		if err := s.opts.ValidateRule(r); err != nil {
			return err
		}
	}
	s.mu.Lock()
	list := make([]*rules.Rule, 0, len(s.fileRules)+len(s.kvRules)+1)
	for _, f := range s.fileRules {
		if f.ID == r.ID {
			s.mu.Unlock()
			return &rules.Error{Index: -1, ID: r.ID, Field: "id", Err: fmt.Errorf("%q is a rule of the rules file; change it there", r.ID)}
		}
		list = append(list, f)
	}
	for id, k := range s.kvRules {
		if id != r.ID {
			list = append(list, k.rule)
		}
	}
	s.mu.Unlock()
	list = append(list, r)
	if len(list) > s.opts.MaxRules {
		return &rules.Error{Index: -1, ID: r.ID, Field: "rules", Err: fmt.Errorf(
			"%w: %d rules would be in force, the cap is %d (--rules.max-rules): delete one first", ErrTooManyRules, len(list), s.opts.MaxRules)}
	}
	_, err := rules.Build(list)
	return err
}

// casAttempts bounds the reads and writes of one override change that
// another change of the same rule overtook.
const casAttempts = 8

// PutOverride sets key's override of the admin rule id to o (nil:
// removes it), validated as a put rule is, and stores the rule with it;
// every watcher then puts it in force. The rule's other fields and
// overrides stay: the rule is read and written back only if no other
// change came between. An unknown rule is ErrNotFound; a rule of the rules
// file, a bad field or a new key past rules.MaxOverrides an error wrapping
// rules.ErrInvalid; removing a key the rule does not override is
// ErrNotFound. Nothing changes on an error.
func (s *Source) PutOverride(ctx context.Context, id, key string, o *rules.Override) (uint64, error) {
	if err := rules.CheckID(id); err != nil {
		return 0, err
	}
	if s.fileRule(id) {
		return 0, &rules.Error{Index: -1, ID: id, Field: "overrides", Err: fmt.Errorf("%q is a rule of the rules file; change its overrides there", id)}
	}
	kv, err := s.writeBucket(ctx)
	if err != nil {
		return 0, err
	}
	for range casAttempts {
		e, err := kv.Get(ctx, id)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return 0, fmt.Errorf("%w: %q", ErrNotFound, id)
		} else if err != nil {
			return 0, err
		}
		r, err := rules.ParseRule(e.Value(), rules.SourceAdmin)
		if err != nil {
			return 0, fmt.Errorf("rule %q as stored: %w", id, err)
		}
		if _, ok := r.Overrides[key]; o == nil && !ok {
			return 0, fmt.Errorf("%w: rule %q has no override of key %q", ErrNotFound, id, key)
		}
		c, err := r.WithOverride(key, o)
		if err != nil {
			return 0, err
		}
		if err := s.Validate(c); err != nil {
			return 0, err
		}
		rev, err := kv.Update(ctx, id, c.YAML(), e.Revision())
		if errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
			continue // changed meanwhile: read it again
		}
		return rev, err
	}
	return 0, fmt.Errorf("rule %q changed %d times while its override was put: try again", id, casAttempts)
}

// fileRule reports whether id is a rule of the rules file.
func (s *Source) fileRule(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.ContainsFunc(s.fileRules, func(r *rules.Rule) bool { return r.ID == id })
}

// Delete removes a rule put through the admin API.
func (s *Source) Delete(ctx context.Context, id string) error {
	kv, err := s.writeBucket(ctx)
	if err != nil {
		return err
	}
	if _, err := kv.Get(ctx, id); errors.Is(err, jetstream.ErrKeyNotFound) {
		return fmt.Errorf("%w: %q", ErrNotFound, id)
	} else if err != nil {
		return err
	}
	return kv.Delete(ctx, id)
}

type metrics struct {
	reloads    *prometheus.CounterVec
	lastReload prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer, s *Source) (*metrics, error) {
	m := &metrics{
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limiter_rules_reloads_total",
			Help: "Rule set reloads, by source (file, admin) and result (success, failure: the rules in force stay).",
		}, []string{"source", "result"}),
		lastReload: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "limiter_rules_last_reload_timestamp_seconds",
			Help: "When the rules in force were last changed.",
		}),
	}
	info := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "limiter_rules_in_force",
		Help: "Rules in force.",
	}, func() float64 { return float64(len(s.Current().Rules())) })
	version := &versionCollector{s: s, desc: prometheus.NewDesc("limiter_rules_version_info",
		"The version (a digest) of the rules in force, as a label; 1.", []string{"version"}, nil)}
	for _, c := range []prometheus.Collector{m.reloads, m.lastReload, info, version} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, src := range []string{"file", "admin"} {
		for _, res := range []string{"success", "failure"} {
			m.reloads.WithLabelValues(src, res)
		}
	}
	m.lastReload.SetToCurrentTime()
	return m, nil
}

// versionCollector exports the current version as an info metric.
type versionCollector struct {
	s    *Source
	desc *prometheus.Desc
}

func (c *versionCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *versionCollector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, 1, c.s.Current().Version())
}
