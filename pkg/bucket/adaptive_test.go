package bucket

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestAdaptiveNext(t *testing.T) {
	a := Adaptive{Min: 2, Max: 20, Target: 100 * time.Millisecond}
	fast, slow := LeaseSample{Duration: 50 * time.Millisecond}, LeaseSample{Duration: 101 * time.Millisecond}
	const now = 1_000_000 // µs
	const cut = 500_000   // the last cut
	st := func(limit, good int) AdaptiveState { return AdaptiveState{Limit: limit, Cut: cut, Good: good} }
	cases := []struct {
		name     string
		st       AdaptiveState
		inFlight int
		s        LeaseSample
		want     AdaptiveState
	}{
		{"under target, busy: counts", st(10, 0), 5, fast, st(10, 1)},
		{"at the target exactly: counts", st(10, 3), 10, LeaseSample{Duration: 100 * time.Millisecond}, st(10, 4)},
		{"as many as the limit: +1", st(10, 9), 10, fast, st(11, 0)},
		{"under half used: not counted", st(10, 9), 4, fast, st(10, 9)},
		{"over target: x0.9", st(10, 5), 10, slow, AdaptiveState{Limit: 9, Cut: now}},
		{"failed: x0.9", st(20, 0), 1, LeaseSample{Duration: time.Millisecond, Failed: true}, AdaptiveState{Limit: 18, Cut: now}},
		{"rounded down", st(15, 0), 15, slow, AdaptiveState{Limit: 13, Cut: now}},
		{"below 10: minus one", st(9, 0), 9, slow, AdaptiveState{Limit: 8, Cut: now}},
		{"clamped to max", st(20, 19), 20, fast, st(20, 0)},
		{"clamped to min", st(2, 0), 2, slow, AdaptiveState{Limit: 2, Cut: now}},
		{"started before the last cut: not cut again", st(10, 2), 10, LeaseSample{Duration: 600 * time.Millisecond}, st(10, 2)},
		{"started at the last cut: cut", st(10, 2), 10, LeaseSample{Duration: 500 * time.Millisecond}, AdaptiveState{Limit: 9, Cut: now}},
		{"a limit out of range is clamped first", st(30, 0), 30, slow, AdaptiveState{Limit: 18, Cut: now}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := a.Next(tc.st, now, tc.inFlight, tc.s); got != tc.want {
				t.Fatalf("Next(%+v, %d, %+v) = %+v, want %+v", tc.st, tc.inFlight, tc.s, got, tc.want)
			}
		})
	}
}

func TestAdaptiveValidate(t *testing.T) {
	ok := LeaseLimit{Limit: 10, TTL: 30 * time.Second, Adaptive: Adaptive{Min: 1, Max: 100, Target: 200 * time.Millisecond}}
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name  string
		edit  func(l *LeaseLimit)
		field string
	}{
		{"min 0", func(l *LeaseLimit) { l.Adaptive.Min = 0 }, "adaptive.min"},
		{"max under min", func(l *LeaseLimit) { l.Adaptive.Min, l.Adaptive.Max, l.Limit = 5, 4, 5 }, "adaptive.max"},
		{"max over the bound", func(l *LeaseLimit) { l.Adaptive.Max = MaxConcurrency + 1 }, "adaptive.max"},
		{"target 0", func(l *LeaseLimit) { l.Adaptive.Target = 0 }, "adaptive.target_latency"},
		{"target negative", func(l *LeaseLimit) { l.Adaptive.Target = -time.Second }, "adaptive.target_latency"},
		{"target over lease_ttl", func(l *LeaseLimit) { l.Adaptive.Target = time.Minute }, "adaptive.target_latency"},
		{"target fractional ms", func(l *LeaseLimit) { l.Adaptive.Target = 1500 * time.Microsecond }, "adaptive.target_latency"},
		{"limit outside the range", func(l *LeaseLimit) { l.Limit = 101 }, "limit"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l := ok
			tc.edit(&l)
			err := l.Validate()
			var le *LimitError
			if !errors.As(err, &le) || le.Field != tc.field || !errors.Is(err, ErrInvalidLimit) {
				t.Fatalf("Validate(%+v) = %v, want an error of field %s", l, err, tc.field)
			}
		})
	}
}

func TestLeaseSampleValidate(t *testing.T) {
	for _, d := range []time.Duration{-time.Millisecond, MaxSampleDuration + time.Millisecond} {
		if err := (LeaseSample{Duration: d}).Validate(); !errors.Is(err, ErrInvalidSample) {
			t.Errorf("duration %v: %v, want ErrInvalidSample", d, err)
		}
	}
	for _, d := range []time.Duration{0, time.Second, MaxSampleDuration} {
		if err := (LeaseSample{Duration: d}).Validate(); err != nil {
			t.Errorf("duration %v: %v", d, err)
		}
	}
}

// TestLeasesAdaptive: the key's limit starts at the rule's, moves with the
// samples of leases held, and is forgotten AdaptiveTTL after the last.
func TestLeasesAdaptive(t *testing.T) {
	l := LeaseLimit{Limit: 4, TTL: time.Minute, Adaptive: Adaptive{Min: 1, Max: 8, Target: 100 * time.Millisecond}}
	var s Leases
	now := int64(1_000_000)
	for _, m := range []string{"a", "b", "c", "d"} {
		if d := s.Acquire(now, l, m); !d.Allowed || d.Limit != 4 {
			t.Fatalf("acquire %s: %+v", m, d)
		}
	}
	if d := s.Acquire(now, l, "e"); d.Allowed {
		t.Fatalf("fifth of 4: %+v", d)
	}
	// Four fast samples (as many as the limit) make it 5.
	for i := range 4 {
		s.Release(now, l, "a", &LeaseSample{Duration: 10 * time.Millisecond})
		if d := s.Acquire(now, l, "a"); !d.Allowed || d.Limit != 4+(i+1)/4 {
			t.Fatalf("after %d fast samples: %+v", i+1, d)
		}
	}
	if d := s.Acquire(now, l, "e"); !d.Allowed || d.InFlight != 5 {
		t.Fatalf("the fifth of 5: %+v", d)
	}
	// A release of a lease not held reports nothing.
	s.Release(now, l, "zz", &LeaseSample{Failed: true})
	s.Release(now+1, l, "a", &LeaseSample{Failed: true})
	if d := s.Acquire(now+1, l, "a"); d.Allowed || d.Limit != 4 {
		t.Fatalf("after a failure, 4 held of 4: %+v", d)
	}
	if d := s.Acquire(now+AdaptiveTTL.Microseconds(), l, "a"); !d.Allowed || d.Limit != 4 {
		t.Fatalf("forgotten after AdaptiveTTL: %+v", d)
	}
}

// TestMemoryAdaptiveKept: the embedded store keeps a key's adaptive limit
// after its last lease is released.
func TestMemoryAdaptiveKept(t *testing.T) {
	ctx := context.Background()
	m := NewMemory()
	l := LeaseLimit{Limit: 2, TTL: time.Minute, Adaptive: Adaptive{Min: 1, Max: 8, Target: 100 * time.Millisecond}}
	req := []LeaseRequest{{Rule: "r", Key: "k", Limit: l}}
	rel := []LeaseRequest{{Rule: "r", Key: "k", Limit: l, Sample: &LeaseSample{Duration: time.Millisecond}}}
	for _, member := range []string{"a", "b"} {
		if _, err := m.Acquire(ctx, req, member); err != nil {
			t.Fatal(err)
		}
	}
	// Two fast samples at a limit of 2, the last with no lease left.
	for _, member := range []string{"a", "b"} {
		if r, _ := m.Release(ctx, rel, member); !r[0] {
			t.Fatal("not released")
		}
	}
	d, err := m.Acquire(ctx, req, "c")
	if err != nil || !d[0].Allowed || d[0].Limit != 3 {
		t.Fatalf("after a fast sample with no lease left: %+v, %v", d, err)
	}
}

// TestLeasesAdaptiveRenew: a renewal reports the key's adaptive limit, as
// an Acquire does, not the rule's starting limit.
func TestLeasesAdaptiveRenew(t *testing.T) {
	l := LeaseLimit{Limit: 4, TTL: time.Minute, Adaptive: Adaptive{Min: 1, Max: 8, Target: 100 * time.Millisecond}}
	var s Leases
	now := int64(1_000_000)
	for _, m := range []string{"a", "b"} {
		s.Acquire(now, l, m)
	}
	s.Release(now+1, l, "b", &LeaseSample{Failed: true}) // 4 → 3
	if d := s.Renew(now+2, l, "a"); !d.Allowed || d.Limit != 3 {
		t.Fatalf("renew after a cut to 3: %+v", d)
	}
	if d := s.Renew(now+2, l, "gone"); d.Allowed || d.Limit != 3 {
		t.Fatalf("renew of a lease not held, after a cut to 3: %+v", d)
	}
	ctx := context.Background()
	m := NewMemory()
	req := []LeaseRequest{{Rule: "r", Key: "k", Limit: l}}
	for _, member := range []string{"a", "b"} {
		if _, err := m.Acquire(ctx, req, member); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := m.Release(ctx, []LeaseRequest{{Rule: "r", Key: "k", Limit: l, Sample: &LeaseSample{Failed: true}}}, "b"); err != nil {
		t.Fatal(err)
	}
	if d, err := m.Renew(ctx, req, "a"); err != nil || !d[0].Allowed || d[0].Limit != 3 {
		t.Fatalf("Memory renew after a cut to 3: %+v, %v", d, err)
	}
}
