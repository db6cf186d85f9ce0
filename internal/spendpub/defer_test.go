package spendpub

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// startPublisher starts a publisher with maxDefer in the calling bubble
// and returns it, its sink and a stop that ends Run and waits for its
// final flush.
func startPublisher(t *testing.T, interval, maxDefer time.Duration) (*Publisher, *sink, func()) {
	t.Helper()
	p, err := newPublisher("us-east", "i1", interval, maxDefer, "", slog.New(slog.NewTextHandler(io.Discard, nil)), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	s := &sink{start: time.Now()}
	p.send = s.send
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }()
	stop := func() { cancel(); <-done }
	t.Cleanup(stop)
	return p, s, stop
}

// TestDeferHoldsAQuietKeyUntilTheBound: a key under its budget is not in
// the interval's message; it goes out at the interval its wait reaches
// max-defer at, and its later spends wait again.
func TestDeferHoldsAQuietKeyUntilTheBound(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p, s, _ := startPublisher(t, time.Second, 5*time.Second)
		acc := p.Accumulator()
		time.Sleep(100 * time.Millisecond)
		acc.Add("r", "quiet", 1, 10, time.Now().UnixMicro())
		acc.Add("r", "other", 1, 0, time.Now().UnixMicro()) // no budget: never held
		time.Sleep(5*time.Second - 100*time.Millisecond - time.Millisecond)
		synctest.Wait()
		got := s.messages()
		if len(got) != 1 || got[0].at != time.Second {
			t.Fatalf("before 5 s: %d messages, want 1 at 1 s (other, with no budget)", len(got))
		}
		if k := keys(got[0].batch); len(k) != 1 || k["other"] != 1 {
			t.Fatalf("the first interval's message holds %v, want other alone: quiet is held", k)
		}
		acc.Add("r", "quiet", 2, 10, time.Now().UnixMicro())
		time.Sleep(time.Millisecond)
		synctest.Wait()
		got = s.messages()
		if len(got) != 2 || got[1].at != 5*time.Second {
			t.Fatalf("at 5 s: %d messages (the last at %v), want 2, the second at 5 s: the bound", len(got), got[len(got)-1].at)
		}
		if k := keys(got[1].batch); len(k) != 1 || k["quiet"] != 3 {
			t.Fatalf("the bound's message holds %v, want quiet 3 (all it spent)", k)
		}
		acc.Add("r", "quiet", 1, 10, time.Now().UnixMicro())
		time.Sleep(4 * time.Second)
		synctest.Wait()
		if n := len(s.messages()); n != 2 {
			t.Fatalf("quiet's next spend went out before its own bound: %d messages", n)
		}
	})
}

// TestDeferHeldKeyAtItsBudgetGoesOutWithinTheTick: a held key that
// reaches its budget is published within BudgetTick, not at the bound.
func TestDeferHeldKeyAtItsBudgetGoesOutWithinTheTick(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p, s, _ := startPublisher(t, time.Second, 10*time.Second)
		acc := p.Accumulator()
		time.Sleep(100 * time.Millisecond)
		acc.Add("r", "k", 4, 10, time.Now().UnixMicro())
		time.Sleep(2400 * time.Millisecond) // held at 1 s and 2 s
		synctest.Wait()
		if n := len(s.messages()); n != 0 {
			t.Fatalf("%d messages while k is under its budget, want 0", n)
		}
		acc.Add("r", "k", 6, 10, time.Now().UnixMicro()) // 10: its budget
		time.Sleep(BudgetTick)
		synctest.Wait()
		got := s.messages()
		if len(got) != 1 || got[0].at != 2500*time.Millisecond+BudgetTick {
			t.Fatalf("%d messages, want 1 at %v (the tick)", len(got), 2500*time.Millisecond+BudgetTick)
		}
		if k := keys(got[0].batch); k["k"] != 10 {
			t.Fatalf("the tick's message holds %v, want k 10", k)
		}
		if n := testutil.ToFloat64(p.budgetMsgs); n != 1 {
			t.Errorf("limiter_spend_messages_total{trigger=budget} = %v, want 1", n)
		}
	})
}

// TestDeferDrainPublishesHeldKeys: at shutdown every held key goes out.
func TestDeferDrainPublishesHeldKeys(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p, s, stop := startPublisher(t, time.Second, 10*time.Second)
		acc := p.Accumulator()
		for i := range 100 {
			acc.Add("r", fmt.Sprint("k", i), 1, 10, time.Now().UnixMicro())
		}
		time.Sleep(3500 * time.Millisecond)
		synctest.Wait()
		if n := len(s.messages()); n != 0 {
			t.Fatalf("%d messages while every key is held, want 0", n)
		}
		stop()
		var total float64
		n := 0
		for _, m := range s.messages() {
			for _, c := range keys(m.batch) {
				total += c
				n++
			}
		}
		if n != 100 || total != 100 {
			t.Fatalf("after the drain: %d keys published, %v tokens; want 100 and 100", n, total)
		}
	})
}

// TestDeferFullPublishesEverything: at MaxWaitingKeys waiting keys every
// key goes out within the tick, held ones included, and none is lost.
func TestDeferFullPublishesEverything(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p, s, _ := startPublisher(t, time.Second, 10*time.Second)
		acc := p.Accumulator()
		acc.MaxKeys = 50 // MaxWaitingKeys, scaled down
		for i := range 30 {
			acc.Add("r", fmt.Sprint("held-", i), 1, 10, time.Now().UnixMicro())
		}
		time.Sleep(1500 * time.Millisecond) // held at 1 s
		synctest.Wait()
		for i := range 20 {
			acc.Add("r", fmt.Sprint("new-", i), 1, 10, time.Now().UnixMicro())
		}
		time.Sleep(BudgetTick)
		synctest.Wait()
		got := s.messages()
		if len(got) != 1 || got[0].at != 1500*time.Millisecond+BudgetTick {
			t.Fatalf("%d messages at 50 waiting keys, want 1 within the tick", len(got))
		}
		if k := keys(got[0].batch); len(k) != 50 {
			t.Fatalf("the full flush holds %d keys, want all 50", len(k))
		}
		if n := testutil.ToFloat64(p.fullMsgs); n != 1 {
			t.Errorf("limiter_spend_messages_total{trigger=full} = %v, want 1", n)
		}
	})
}

// TestDeferCostsFewerMessagesAndEntries: the long tail (keys that spend 1
// of a budget of 10 once in 2 s) costs fewer messages and far fewer
// entries (debit scripts in every other region) with deferral than
// without, and every token still goes out.
func TestDeferCostsFewerMessagesAndEntries(t *testing.T) {
	const keysN, period, run = 50, 2 * time.Second, 20 * time.Second
	type result struct{ msgs, entries, tokens float64 }
	measure := func(maxDefer time.Duration) (r result) {
		synctest.Test(t, func(t *testing.T) {
			p, s, stop := startPublisher(t, time.Second, maxDefer)
			acc := p.Accumulator()
			step := period / keysN
			for i := range int(run / step) {
				time.Sleep(step)
				acc.Add("r", fmt.Sprint("k", i%keysN), 1, 10, time.Now().UnixMicro())
			}
			r.msgs = float64(len(s.messages()))
			r.entries = testutil.ToFloat64(p.published)
			stop()
			for _, m := range s.messages() {
				for _, c := range keys(m.batch) {
					r.tokens += c
				}
			}
		})
		return r
	}
	before, after := measure(0), measure(10*time.Second)
	t.Logf("%d keys, one spend each in %v, for %v: messages %v -> %v, entries %v -> %v", keysN, period, run, before.msgs, after.msgs, before.entries, after.entries)
	if want := float64(run / (period / keysN)); before.tokens != want || after.tokens != want {
		t.Fatalf("tokens published %v without deferral, %v with; want %v", before.tokens, after.tokens, want)
	}
	if after.msgs*2 > before.msgs {
		t.Errorf("messages: %v with deferral, %v without; want at most half", after.msgs, before.msgs)
	}
	if after.entries*3 > before.entries {
		t.Errorf("entries: %v with deferral, %v without; want at most a third", after.entries, before.entries)
	}
}
