package rulesource

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
)

const fileRules = "rules:\n  - id: from-file\n    capacity: 1\n    refill_per_second: 1\n"

// watcher collects the sets a Source hands over.
type watcher struct {
	mu   sync.Mutex
	sets []*rules.Set
}

func (w *watcher) onChange(s *rules.Set) error {
	w.mu.Lock()
	w.sets = append(w.sets, s)
	w.mu.Unlock()
	return nil
}

func (w *watcher) waitFor(t *testing.T, ok func(*rules.Set) bool) *rules.Set {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		w.mu.Lock()
		var last *rules.Set
		if n := len(w.sets); n > 0 {
			last = w.sets[n-1]
		}
		w.mu.Unlock()
		if last != nil && ok(last) {
			return last
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("the expected rule set never came")
	return nil
}

func newSource(t *testing.T, nc *nats.Conn, w *watcher) (*Source, *prometheus.Registry) {
	t.Helper()
	file := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(file, []byte(fileRules), 0o644); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	s, err := New(Options{File: file, NATS: nc, ResyncInterval: 200 * time.Millisecond, OnChange: w.onChange,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, reg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return s, reg
}

// TestBucketRules: rules put in the bucket join the file's; a rule that
// clashes with a file rule or does not validate is refused; one written
// around the API that does not parse is left out, and the rest stay.
func TestBucketRules(t *testing.T) {
	ns := natstest.NewServer(t)
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	var w watcher
	s, reg := newSource(t, nc, &w)
	ctx := context.Background()
	if _, err := s.Put(ctx, []byte("id: dyn\ncapacity: 3\nrefill_per_second: 1\n")); err != nil {
		t.Fatal(err)
	}
	w.waitFor(t, func(set *rules.Set) bool { return set.Get("dyn") != nil && set.Get("from-file") != nil })

	if _, err := s.Put(ctx, []byte("id: from-file\ncapacity: 3\nrefill_per_second: 1\n")); !errors.Is(err, rules.ErrInvalid) {
		t.Fatalf("Put of a file rule's id: %v", err)
	}
	if _, err := s.Put(ctx, []byte("id: bad\ncapacity: -3\n")); !errors.Is(err, rules.ErrInvalid) {
		t.Fatalf("Put of an invalid rule: %v", err)
	}

	// Written around the API: refused, counted, the rest in force.
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(ctx, DefaultBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "broken", []byte("id: broken\ncapacity: lots\n")); err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "more", []byte("id: more\ncapacity: 1\nrefill_per_second: 1\n")); err != nil {
		t.Fatal(err)
	}
	set := w.waitFor(t, func(set *rules.Set) bool { return set.Get("more") != nil })
	if set.Get("broken") != nil || set.Get("dyn") == nil {
		t.Fatalf("rules in force: %v", set.Rules())
	}
	if got := testutil.ToFloat64(s.m.reloads.WithLabelValues("admin", "failure")); got < 1 {
		t.Fatalf("the refused bucket entry is not counted (%v)", got)
	}

	if err := s.Delete(ctx, "dyn"); err != nil {
		t.Fatal(err)
	}
	w.waitFor(t, func(set *rules.Set) bool { return set.Get("dyn") == nil })
	if err := s.Delete(ctx, "dyn"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("second Delete: %v", err)
	}
	if n, err := testutil.GatherAndCount(reg, "limiter_rules_version_info"); err != nil || n != 1 {
		t.Fatalf("version info series: %d, %v", n, err)
	}
}

// TestNoBucket: without NATS the file's rules are in force, and Put says why
// it cannot change them.
func TestNoBucket(t *testing.T) {
	var w watcher
	s, _ := newSource(t, nil, &w)
	if s.Current().Get("from-file") == nil {
		t.Fatal("file rule not in force")
	}
	if _, err := s.Put(context.Background(), []byte("id: dyn\ncapacity: 3\nrefill_per_second: 1\n")); !errors.Is(err, ErrNoStore) {
		t.Fatalf("Put without a bucket: %v", err)
	}
}

// TestValidateAndCap: a rule ValidateRule refuses, or past MaxRules, is
// refused by Put naming the field; one written around the API is left out
// alone and counted; a set OnChange refuses is not reported as in force.
func TestValidateAndCap(t *testing.T) {
	ns := natstest.NewServer(t)
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	file := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(file, []byte(fileRules), 0o644); err != nil {
		t.Fatal(err)
	}
	errNotHere := errors.New("not here")
	validate := func(r *rules.Rule) error {
		if r.Cost == 7 {
			return &rules.Error{Index: -1, ID: r.ID, Field: "cost", Err: errNotHere}
		}
		return nil
	}
	var w watcher
	refuse := make(chan bool, 1)
	refuse <- false
	onChange := func(s *rules.Set) error {
		r := <-refuse
		refuse <- r
		if r {
			return errors.New("refused by the engine")
		}
		return w.onChange(s)
	}
	reg := prometheus.NewRegistry()
	s, err := New(Options{File: file, NATS: nc, MaxRules: 3, ValidateRule: validate, OnChange: onChange,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, reg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	failures := func() float64 { return testutil.ToFloat64(s.m.reloads.WithLabelValues("admin", "failure")) }

	if _, err := s.Put(ctx, []byte("id: seven\ncapacity: 9\nrefill_per_second: 1\ncost: 7\n")); !errors.Is(err, errNotHere) || !errors.Is(err, rules.ErrInvalid) {
		t.Fatalf("Put of a rule ValidateRule refuses: %v", err)
	}
	for _, id := range []string{"a", "b"} {
		if _, err := s.Put(ctx, []byte("id: "+id+"\ncapacity: 1\nrefill_per_second: 1\n")); err != nil {
			t.Fatal(err)
		}
	}
	w.waitFor(t, func(set *rules.Set) bool { return set.Get("b") != nil })
	_, err = s.Put(ctx, []byte("id: c\ncapacity: 1\nrefill_per_second: 1\n"))
	var re *rules.Error
	if !errors.Is(err, ErrTooManyRules) || !errors.As(err, &re) || re.Field != "rules" {
		t.Fatalf("Put past the cap: %v", err)
	}

	// Around the API: past the cap, and refused by ValidateRule.
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(ctx, DefaultBucket)
	if err != nil {
		t.Fatal(err)
	}
	before := failures()
	if _, err := kv.Put(ctx, "c", []byte("id: c\ncapacity: 1\nrefill_per_second: 1\n")); err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "seven", []byte("id: seven\ncapacity: 9\nrefill_per_second: 1\ncost: 7\n")); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	// With a gone, c fits under the cap; seven never does.
	set := w.waitFor(t, func(set *rules.Set) bool { return set.Get("c") != nil })
	if set.Get("seven") != nil || set.Get("b") == nil || set.Get("from-file") == nil {
		t.Fatalf("rules in force: %v", set.Rules())
	}
	if got := failures(); got < before+2 {
		t.Fatalf("failures counted: %v, want at least %v (the cap, the refused entry)", got, before+2)
	}

	// A set the daemon refuses is not reported as in force.
	<-refuse
	refuse <- true
	version := s.Current().Version()
	before = failures()
	if err := s.Delete(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for failures() == before {
		if time.Now().After(deadline) {
			t.Fatal("the refused set is not counted")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if s.Current().Version() != version || s.Current().Get("c") == nil {
		t.Fatal("a set the daemon refused is reported as in force")
	}
}

// TestFileOverTheCap: a rules file over MaxRules, or with a rule
// ValidateRule refuses, is refused at start naming the field.
func TestFileOverTheCap(t *testing.T) {
	file := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(file, []byte(fileRules+"  - id: second\n    capacity: 1\n    refill_per_second: 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := New(Options{File: file, MaxRules: 1}, prometheus.NewRegistry())
	var re *rules.Error
	if !errors.Is(err, ErrTooManyRules) || !errors.As(err, &re) || re.Field != "rules" || re.File != file {
		t.Fatalf("New with a file over the cap: %v", err)
	}
	refuse := func(r *rules.Rule) error {
		if r.ID == "second" {
			return &rules.Error{Index: -1, ID: r.ID, Field: "home_keys.x", Err: errors.New("no")}
		}
		return nil
	}
	_, err = New(Options{File: file, ValidateRule: refuse}, prometheus.NewRegistry())
	if !errors.As(err, &re) || re.Field != "home_keys.x" || re.Index != 1 {
		t.Fatalf("New with a file rule ValidateRule refuses: %v", err)
	}
}
