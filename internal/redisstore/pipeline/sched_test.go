package pipeline

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestSchedWatch: a wake schedLate late or more marks the process starved
// from then on for checks queued before it, and not for checks queued
// after it; a watch that has not woken for that long marks it starved now;
// wakes on time mark nothing.
func TestSchedWatch(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	lateWakes := prometheus.NewCounter(prometheus.CounterOpts{Name: "late"})
	w := newSchedWatch(t0, lateWakes)
	for i := 1; i <= 10; i++ {
		w.observe(at(time.Duration(i) * (schedEvery + schedLate/2)))
	}
	last := 10 * (schedEvery + schedLate/2)
	if w.starvedSince(t0.UnixNano(), at(last)) {
		t.Fatal("starved after wakes each under schedLate late")
	}
	if !w.starvedSince(t0.UnixNano(), at(last+schedEvery+schedLate)) {
		t.Fatal("not starved with no wake for schedEvery+schedLate")
	}
	queuedBefore, late := at(last+time.Millisecond), last+schedEvery+schedLate
	w.observe(at(late))
	if !w.starvedSince(queuedBefore.UnixNano(), at(late)) {
		t.Fatal("a check queued before a late wake: not starved")
	}
	if w.starvedSince(at(late+time.Millisecond).UnixNano(), at(late+schedEvery)) {
		t.Fatal("a check queued after a late wake, with a wake on time since: starved")
	}
	if got := testutil.ToFloat64(lateWakes); got != 1 {
		t.Errorf("late wakes counted %v, want 1", got)
	}
}
