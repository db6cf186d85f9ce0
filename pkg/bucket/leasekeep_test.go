package bucket

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// With reserve {critical: 0.2, default: 0.05} of a limit of 20, sheddable
// (keeping 0.25) takes a lease only while fewer than 15 are held, default
// (0.2) fewer than 16, critical (0) fewer than 20.
func TestLeasesAcquireKeeping(t *testing.T) {
	l := LeaseLimit{Limit: 20, TTL: time.Second}
	now := int64(1_000_000)
	for _, tc := range []struct {
		class string
		keep  float64
		room  int
	}{{"critical", 0, 20}, {"default", 0.2, 16}, {"sheddable", 0.2 + 0.05, 15}} {
		var s Leases
		for i := range tc.room {
			if d := s.AcquireKeeping(now+int64(i), l, tc.keep, fmt.Sprint(i)); !d.Allowed || d.Reserved {
				t.Fatalf("%s: lease %d refused: %+v", tc.class, i+1, d)
			}
		}
		d := s.AcquireKeeping(now+100, l, tc.keep, "over")
		if d.Allowed {
			t.Fatalf("%s: lease %d allowed: %+v", tc.class, tc.room+1, d)
		}
		// Refused for the reserve alone while below the limit; its retry is
		// until enough leases expire for the class to fit: the first one.
		if want := tc.room < l.Limit; d.Reserved != want || d.RetryAfter != time.Second-100*time.Microsecond || d.InFlight != tc.room || d.Limit != 20 {
			t.Fatalf("%s: refusal %+v, want reserved %v", tc.class, d, want)
		}
		// A member already held is renewed whatever it keeps.
		if d := s.AcquireKeeping(now+200, l, tc.keep, "0"); !d.Allowed {
			t.Fatalf("%s: renewal of a held member refused: %+v", tc.class, d)
		}
	}
}

// A reserved refusal's retry is until as many leases expire as the class
// needs to fit: with 18 held and room for 15, the fourth soonest.
func TestLeasesKeepingRetry(t *testing.T) {
	l := LeaseLimit{Limit: 20, TTL: time.Second}
	now := int64(1_000_000)
	var s Leases
	for i := range 18 {
		s.AcquireKeeping(now+int64(i)*1000, l, 0, fmt.Sprint(i))
	}
	d := s.AcquireKeeping(now+50_000, l, 0.25, "shed")
	if d.Allowed || !d.Reserved || d.RetryAfter != time.Second+3*time.Millisecond-50*time.Millisecond {
		t.Fatalf("reserved refusal with 18 held: %+v", d)
	}
	// At the limit, the refusal is the limit's, retried at the soonest.
	for i := 18; i < 20; i++ {
		s.AcquireKeeping(now+50_000, l, 0, fmt.Sprint(i))
	}
	d = s.AcquireKeeping(now+60_000, l, 0.25, "shed")
	if d.Allowed || d.Reserved || d.RetryAfter != time.Second-60*time.Millisecond {
		t.Fatalf("refusal at the limit: %+v", d)
	}
}

// The room a class keeps is of the key's adaptive limit, when adaptive.
func TestLeasesKeepingAdaptive(t *testing.T) {
	l := LeaseLimit{Limit: 10, TTL: time.Minute, Adaptive: Adaptive{Min: 2, Max: 20, Target: 10 * time.Millisecond}}
	now := int64(1_000_000)
	var s Leases
	for i := range 10 {
		s.AcquireKeeping(now, l, 0, fmt.Sprint(i))
	}
	// A failure cuts 10 to 9; 8 leases are held.
	s.Release(now+1, l, "9", &LeaseSample{Failed: true})
	s.Release(now+1, l, "8", nil)
	if d := s.AcquireKeeping(now+2, l, 0.5, "half"); d.Allowed || !d.Reserved || d.Limit != 9 {
		t.Fatalf("keeping half of 9 with 8 held: %+v", d)
	}
	for i := range 4 {
		s.Release(now+3, l, fmt.Sprint(i), nil)
	}
	// 4 held, 9 - floor(4.5) = 5 of room.
	if d := s.AcquireKeeping(now+4, l, 0.5, "half"); !d.Allowed {
		t.Fatalf("keeping half of 9 with 4 held: %+v", d)
	}
	if d := s.AcquireKeeping(now+5, l, 0.5, "half2"); d.Allowed || !d.Reserved {
		t.Fatalf("keeping half of 9 with 5 held: %+v", d)
	}
}

// Memory's Acquire keeps each request's reserve, all or nothing.
func TestMemoryLeasesKeep(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	m := NewMemory(WithClock(func() time.Time { return now }))
	ctx := context.Background()
	l := LeaseLimit{Limit: 4, TTL: 2 * time.Second}
	for i := range 3 {
		if d, err := m.Acquire(ctx, []LeaseRequest{{Rule: "r", Key: "a", Limit: l}}, fmt.Sprint(i)); err != nil || !d[0].Allowed {
			t.Fatalf("lease %d: %+v, %v", i, d, err)
		}
	}
	reqs := []LeaseRequest{{Rule: "r", Key: "b", Limit: l, Keep: 0.25}, {Rule: "r", Key: "a", Limit: l, Keep: 0.25}}
	d, err := m.Acquire(ctx, reqs, "shed")
	if err != nil || d[0].Allowed != true || d[1].Allowed || !d[1].Reserved || d[1].InFlight != 3 {
		t.Fatalf("keeping a quarter of 4 with 3 held: %+v, %v", d, err)
	}
	// Nothing was held of b.
	if d, _ := m.Acquire(ctx, []LeaseRequest{{Rule: "r", Key: "b", Limit: l}}, "x"); d[0].InFlight != 1 {
		t.Fatalf("b after the refusal: %+v", d)
	}
	reqs[1].Keep = 0
	if d, _ := m.Acquire(ctx, reqs, "crit"); !d[0].Allowed || !d[1].Allowed || d[1].InFlight != 4 {
		t.Fatalf("keeping nothing: %+v", d)
	}
}

// A usage keeping a class's reserve answers what an Acquire of that class
// would: allowed while fewer than its room are held; else refused, as
// reserved below the limit, with the retry of the refused Acquire (until
// as many leases expire as the class needs to fit). It changes nothing.
func TestLeasesUsageKeeping(t *testing.T) {
	l := LeaseLimit{Limit: 20, TTL: time.Second}
	now := int64(1_000_000)
	var s Leases
	held := func(n int) {
		for i := s.Len(); i < n; i++ {
			s.AcquireKeeping(now+int64(i)*1000, l, 0, fmt.Sprint(i))
		}
	}
	at := now + 50_000
	for _, tc := range []struct {
		held     int
		keep     float64
		allowed  bool
		reserved bool
	}{
		{14, 0.25, true, false},
		{15, 0.25, false, true}, // sheddable's room is 15: the soonest
		{15, 0.2, true, false},
		{18, 0.25, false, true}, // the fourth soonest
		{18, 0.2, false, true},  // the third
		{18, 0, true, false},
		{20, 0, false, false}, // the limit's: the soonest
		{20, 0.25, false, false},
	} {
		held(tc.held)
		u := s.UsageKeeping(at, l, tc.keep)
		if u.Allowed != tc.allowed || u.Reserved != tc.reserved || u.InFlight != tc.held || u.Limit != 20 ||
			u.Expires != time.UnixMicro(now+int64(tc.held-1)*1000+1_000_000) {
			t.Fatalf("%d held, keeping %v: %+v; want allowed %v, reserved %v", tc.held, tc.keep, u, tc.allowed, tc.reserved)
		}
		if s.Len() != tc.held {
			t.Fatalf("the usage changed the set: %d held, want %d", s.Len(), tc.held)
		}
		if tc.allowed {
			if u.RetryAfter != 0 {
				t.Fatalf("%d held, keeping %v: allowed with a retry: %+v", tc.held, tc.keep, u)
			}
			continue
		}
		// The Acquire it answers for, refused, changes nothing either.
		d := s.AcquireKeeping(at, l, tc.keep, "new")
		if d.Allowed || d.RetryAfter != u.RetryAfter || d.Reserved != u.Reserved {
			t.Fatalf("%d held, keeping %v: usage %+v, Acquire %+v", tc.held, tc.keep, u, d)
		}
	}
	if u := s.Usage(at, l); u != s.UsageKeeping(at, l, 0) {
		t.Fatalf("Usage %+v, UsageKeeping of 0 %+v", u, s.UsageKeeping(at, l, 0))
	}
}

// Memory's LeaseUsage keeps each request's Keep.
func TestMemoryLeaseUsageKeep(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	m := NewMemory(WithClock(func() time.Time { return now }))
	ctx := context.Background()
	l := LeaseLimit{Limit: 4, TTL: 2 * time.Second}
	for i := range 3 {
		if d, err := m.Acquire(ctx, []LeaseRequest{{Rule: "r", Key: "a", Limit: l}}, fmt.Sprint(i)); err != nil || !d[0].Allowed {
			t.Fatalf("lease %d: %+v, %v", i, d, err)
		}
	}
	u, err := m.LeaseUsage(ctx, []LeaseRequest{{Rule: "r", Key: "a", Limit: l, Keep: 0.25}, {Rule: "r", Key: "a", Limit: l}})
	if err != nil || u[0].Allowed || !u[0].Reserved || u[0].InFlight != 3 || u[0].RetryAfter != 2*time.Second || !u[1].Allowed {
		t.Fatalf("keeping a quarter of 4 with 3 held, then nothing: %+v, %v", u, err)
	}
}
