package topowatch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"

	"github.com/limiterd/limiterd/pkg/region"
)

// syncBuffer is a log sink safe for the watcher's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func topoFile(gen int, at time.Time, names ...string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "generation: %d\n", gen)
	if !at.IsZero() {
		fmt.Fprintf(&b, "effective_at: %s\n", at.UTC().Format(time.RFC3339Nano))
	}
	b.WriteString("regions:\n")
	for i, n := range names {
		fmt.Fprintf(&b, "  - name: %s\n    limiter_address: 127.0.0.1:%d\n", n, 1000+i)
	}
	return b.String()
}

type fixture struct {
	t        *testing.T
	file     string
	w        *Watcher
	reg      *prometheus.Registry
	log      *syncBuffer
	mu       sync.Mutex
	switched []uint64 // generations OnSwitch was called with
	validate func(*region.Topology) error
}

func newFixture(t *testing.T, content string) *fixture {
	t.Helper()
	f := &fixture{t: t, file: filepath.Join(t.TempDir(), "topology.yml"), reg: prometheus.NewRegistry(), log: &syncBuffer{}}
	f.write(content)
	w, err := New(Options{File: f.file, Region: "a", Poll: time.Second,
		Logger: slog.New(slog.NewTextHandler(f.log, nil)),
		Validate: func(t *region.Topology) error {
			if f.validate != nil {
				return f.validate(t)
			}
			return nil
		},
		OnSwitch: func(old, next *region.Topology) error {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.switched = append(f.switched, next.Generation())
			return nil
		}}, f.reg)
	if err != nil {
		t.Fatal(err)
	}
	f.w = w
	return f
}

func (f *fixture) write(content string) {
	f.t.Helper()
	// As a ConfigMap update does: a new file renamed over the old one.
	tmp := f.file + ".new"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		f.t.Fatal(err)
	}
	if err := os.Rename(tmp, f.file); err != nil {
		f.t.Fatal(err)
	}
}

func (f *fixture) gauge(state string) (float64, bool) {
	f.t.Helper()
	mfs, err := f.reg.Gather()
	if err != nil {
		f.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "limiter_topology_generation" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == state {
				return m.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}

func (f *fixture) switches() []uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]uint64(nil), f.switched...)
}

// TestScheduledSwitch: a file with effective_at ahead is pending until
// that instant, and the switch happens at it (the timer), not at the next
// poll; one whose effective_at has passed switches at the next poll.
func TestScheduledSwitch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, topoFile(1, time.Time{}, "a", "b"))
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go f.w.Run(ctx)

		start := time.Now()
		at := start.Add(5*time.Second + 300*time.Millisecond) // between two polls
		f.write(topoFile(2, at, "a", "b", "c"))
		time.Sleep(time.Second + time.Millisecond) // one poll
		synctest.Wait()
		if g, ok := f.gauge("pending"); !ok || g != 2 {
			t.Fatalf("pending gauge = %v (exported %v), want 2", g, ok)
		}
		if g, _ := f.gauge("active"); g != 1 || f.w.Active().Generation() != 1 || f.w.Pending().Generation() != 2 {
			t.Fatalf("active %d (gauge %v), pending %v; want 1 active, 2 pending", f.w.Active().Generation(), g, f.w.Pending())
		}
		time.Sleep(time.Until(at) - time.Nanosecond)
		synctest.Wait()
		if f.w.Active().Generation() != 1 {
			t.Fatal("switched before effective_at")
		}
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		if f.w.Active().Generation() != 2 || !time.Now().Equal(at) {
			t.Fatalf("at effective_at (%v after start): generation %d in force, want 2", time.Since(start), f.w.Active().Generation())
		}
		if _, ok := f.gauge("pending"); ok {
			t.Error("pending gauge still exported after the switch")
		}
		if g, _ := f.gauge("active"); g != 2 {
			t.Errorf("active gauge = %v, want 2", g)
		}
		if n := testutil.ToFloat64(f.w.regions); n != 3 {
			t.Errorf("regions gauge = %v, want 3", n)
		}

		// Late: a file whose effective_at passed switches at the next poll.
		f.write(topoFile(3, time.Now().Add(-time.Minute), "a", "b"))
		polled := time.Now()
		for f.w.Active().Generation() != 3 {
			time.Sleep(10 * time.Millisecond)
		}
		if d := time.Since(polled); d > time.Second {
			t.Errorf("late file in force %v after it landed, want at most one poll (1s)", d)
		}
		if got := f.switches(); fmt.Sprint(got) != "[2 3]" {
			t.Errorf("OnSwitch calls %v, want [2 3]", got)
		}
		if n := testutil.ToFloat64(f.w.failures); n != 0 {
			t.Errorf("reload failures = %v, want 0", n)
		}
		problems, err := promlint.NewWithMetricFamilies(mustGather(t, f.reg)).Lint()
		if err != nil || len(problems) > 0 {
			t.Errorf("promlint: %v %v", problems, err)
		}
	})
}

func mustGather(t *testing.T, reg *prometheus.Registry) []*dto.MetricFamily {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	return mfs
}

// TestStartUsesTheFileAtOnce: at start the file's topology is in force
// whatever its effective_at.
func TestStartUsesTheFileAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, topoFile(4, time.Now().Add(time.Hour), "a", "b"))
		if f.w.Active().Generation() != 4 || f.w.Pending() != nil {
			t.Fatalf("at start: active %d, pending %v; want 4 in force", f.w.Active().Generation(), f.w.Pending())
		}
	})
}

// TestRefusals: each bad file keeps the topology in force, is logged once
// (however many polls read it) naming the file and the field, and counted
// once; a good file after them is taken.
func TestRefusals(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, topoFile(2, time.Time{}, "a", "b"))
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go f.w.Run(ctx)
		f.validate = nil
		tests := []struct {
			name     string
			content  string
			validate func(*region.Topology) error
			want     error
			field    string
		}{
			{"syntax error", "generation: 3\nregions: [\n", nil, region.ErrInvalid, "yaml:"},
			{"unknown field", topoFile(3, time.Time{}, "a", "b") + "zones: 2\n", nil, region.ErrInvalid, "field zones not found"},
			{"lower generation", topoFile(1, time.Time{}, "a", "b", "c"), nil, region.ErrGenerationLower, "generation: 1 is lower than 2"},
			{"regions changed, same generation", topoFile(2, time.Time{}, "a", "b", "c"), nil, region.ErrGenerationNotRaised, "c added"},
			{"own region missing", topoFile(3, time.Time{}, "b", "c"), nil, ErrOwnRegionMissing, "regions: "},
			{"rules invalid under it", topoFile(3, time.Time{}, "a"), func(*region.Topology) error {
				return errRule
			}, errRule, "home_keys.k"},
		}
		for i, tt := range tests {
			f.validate = tt.validate
			f.write(tt.content)
			time.Sleep(3*time.Second + time.Millisecond) // three polls
			synctest.Wait()
			if g := f.w.Active().Generation(); g != 2 {
				t.Fatalf("%s: generation %d in force, want 2", tt.name, g)
			}
			if err := f.w.LastError(); !errors.Is(err, tt.want) {
				t.Fatalf("%s: LastError = %v, want %v", tt.name, err, tt.want)
			}
			if n := testutil.ToFloat64(f.w.failures); n != float64(i+1) {
				t.Fatalf("%s: reload failures = %v, want %d (one per distinct content)", tt.name, n, i+1)
			}
			lines := strings.Split(strings.TrimSpace(f.log.String()), "\n")
			last := lines[len(lines)-1]
			if !strings.Contains(last, "topology file refused") || !strings.Contains(last, f.file) || !strings.Contains(last, tt.field) {
				t.Fatalf("%s: last log line %q: want the refusal, naming %s and %q", tt.name, last, f.file, tt.field)
			}
			if n := strings.Count(f.log.String(), "topology file refused"); n != i+1 {
				t.Fatalf("%s: %d refusals logged, want %d", tt.name, n, i+1)
			}
		}
		f.validate = nil
		f.write(topoFile(3, time.Time{}, "a", "b", "c"))
		time.Sleep(time.Second + time.Millisecond)
		synctest.Wait()
		if g := f.w.Active().Generation(); g != 3 {
			t.Fatalf("good file after the bad ones: generation %d in force, want 3", g)
		}
	})
}

var errRule = errors.New(`rule "pin": home_keys.k: region "b" is not in the topology`)

// TestReload: a forced read takes a new file at once, and reads again at
// most once per forcedGap.
func TestReload(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, topoFile(1, time.Time{}, "a", "b"))
		f.write(topoFile(2, time.Time{}, "a", "b", "c"))
		if g := f.w.Reload().Generation(); g != 2 {
			t.Fatalf("Reload: generation %d, want 2", g)
		}
		f.write(topoFile(3, time.Time{}, "a", "b"))
		if g := f.w.Reload().Generation(); g != 2 {
			t.Fatalf("second Reload within %v read the file again (generation %d)", forcedGap, g)
		}
		time.Sleep(forcedGap)
		if g := f.w.Reload().Generation(); g != 3 {
			t.Fatalf("Reload after %v: generation %d, want 3", forcedGap, g)
		}
	})
}
