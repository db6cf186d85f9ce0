package spendpub

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/pkg/gossip"
	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// sink records what a publisher sends, at the bubble's time.
type sink struct {
	mu    sync.Mutex
	start time.Time
	fail  bool
	sent  []sentMsg
	tries int
}

type sentMsg struct {
	at    time.Duration
	batch *gossipv1.SpendBatch
}

func (s *sink) send(_ context.Context, data []byte, _ string, _ nats.Header) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tries++
	if s.fail {
		return errors.New("NATS unreachable")
	}
	b, err := gossip.Decode(data, gossip.DefaultMaxMessageBytes)
	if err != nil {
		return err
	}
	s.sent = append(s.sent, sentMsg{at: time.Since(s.start), batch: b})
	return nil
}

func (s *sink) messages() []sentMsg {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.sent)
}

func keys(b *gossipv1.SpendBatch) map[string]float64 {
	m := map[string]float64{}
	for _, sp := range b.GetSpends() {
		m[sp.GetKey()] += sp.GetCost()
	}
	return m
}

// runPublisher starts a publisher flushing every interval to a sink, in
// the calling bubble, stopped when the test ends.
func runPublisher(t *testing.T, interval time.Duration) (*Publisher, *sink) {
	t.Helper()
	p, err := newPublisher("us-east", "i1", interval, 0, "", slog.New(slog.NewTextHandler(io.Discard, nil)), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	s := &sink{start: time.Now()}
	p.send = s.send
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return p, s
}

// TestBudgetPublishesHotKeysWithinTheTick: keys that reach their budget
// go out within BudgetTick of the first of them, together in one message;
// keys under it wait for the interval.
func TestBudgetPublishesHotKeysWithinTheTick(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p, s := runPublisher(t, time.Second)
		acc := p.Accumulator()
		now := func() int64 { return time.Now().UnixMicro() }

		time.Sleep(100 * time.Millisecond)
		for i := range 50 {
			acc.Add("r", fmt.Sprint("quiet-", i), 0.5, 1, now())
		}
		acc.Add("r", "hot", 0.6, 1, now())
		acc.Add("r", "hot", 0.6, 1, now()) // 1.2: reaches the budget of 1
		time.Sleep(5 * time.Millisecond)
		acc.Add("r", "hot2", 2, 1, now())
		time.Sleep(BudgetTick)
		synctest.Wait()
		got := s.messages()
		if len(got) != 1 {
			t.Fatalf("%v after the first hot key: %d messages, want 1 (both hot keys, batched)", BudgetTick+5*time.Millisecond, len(got))
		}
		if want := 100*time.Millisecond + BudgetTick; got[0].at != want {
			t.Errorf("the hot keys went out at %v, want %v (the first hot key's tick)", got[0].at, want)
		}
		if k := keys(got[0].batch); len(k) != 2 || k["hot"] != 1.2 || k["hot2"] != 2 {
			t.Errorf("the tick's message holds %v, want hot 1.2 and hot2 2 only", k)
		}

		// More under the budget after the tick: it waits with the quiet keys.
		acc.Add("r", "hot", 0.5, 1, now())
		time.Sleep(time.Second - 100*time.Millisecond - BudgetTick - 5*time.Millisecond)
		synctest.Wait()
		got = s.messages()
		if len(got) != 2 || got[1].at != time.Second {
			t.Fatalf("at 1 s: %d messages (the last at %v), want 2, the second at the interval", len(got), got[len(got)-1].at)
		}
		k := keys(got[1].batch)
		if len(k) != 51 || k["hot"] != 0.5 || k["quiet-7"] != 0.5 || k["hot2"] != 0 {
			t.Errorf("the interval's message holds %d keys (hot %v, quiet-7 %v, hot2 %v), want the 50 quiet keys and hot's 0.5", len(k), k["hot"], k["quiet-7"], k["hot2"])
		}
		if n := testutil.ToFloat64(p.budgetMsgs); n != 1 {
			t.Errorf("limiter_spend_messages_total{trigger=budget} = %v, want 1", n)
		}
	})
}

// TestBudgetQuietKeysCostNoMoreMessages: keys that never reach their
// budget cost one message an interval, as before there was a budget,
// however many of them spend and however often.
func TestBudgetQuietKeysCostNoMoreMessages(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p, s := runPublisher(t, time.Second)
		acc := p.Accumulator()
		const intervals = 5
		// 1,000 keys, each spending 1 token of a capacity of 100 (budget
		// 10) every 10 s, spread over every millisecond.
		for ms := range intervals * 1000 {
			time.Sleep(time.Millisecond)
			key := fmt.Sprint("k", ms%1000)
			acc.Add("r", key, 1, 10, time.Now().UnixMicro())
		}
		time.Sleep(time.Millisecond)
		synctest.Wait()
		got := s.messages()
		if len(got) != intervals {
			t.Fatalf("%d intervals of quiet keys: %d messages, want %d", intervals, len(got), intervals)
		}
		for i, m := range got {
			if want := time.Duration(i+1) * time.Second; m.at != want {
				t.Errorf("message %d at %v, want %v", i, m.at, want)
			}
		}
		if n := testutil.ToFloat64(p.budgetMsgs); n != 0 {
			t.Errorf("limiter_spend_messages_total{trigger=budget} = %v, want 0", n)
		}
		if n := testutil.ToFloat64(p.intervalMsgs); n != intervals {
			t.Errorf("limiter_spend_messages_total{trigger=interval} = %v, want %d", n, intervals)
		}
	})
}

// TestBudgetWaitsForTheIntervalWhileNATSIsDown: with a flush waiting to
// be published, hot keys wait for the interval too: an outage does not
// fill the backlog with a message every tick.
func TestBudgetWaitsForTheIntervalWhileNATSIsDown(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p, s := runPublisher(t, time.Second)
		acc := p.Accumulator()
		s.mu.Lock()
		s.fail = true
		s.mu.Unlock()
		acc.Add("r", "quiet", 1, 10, time.Now().UnixMicro())
		time.Sleep(time.Second + time.Millisecond) // the interval's flush fails
		for range 20 {
			acc.Add("r", "hot", 5, 1, time.Now().UnixMicro())
			time.Sleep(BudgetTick)
		}
		synctest.Wait()
		s.mu.Lock()
		tries := s.tries
		s.fail = false
		s.mu.Unlock()
		if tries != 1 {
			t.Fatalf("%d publish attempts, want 1: hot keys during an outage must wait for the interval", tries)
		}
		if n := testutil.ToFloat64(p.backlogGauge); n != 1 {
			t.Fatalf("limiter_spend_backlog_messages = %v, want 1", n)
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		var total float64
		for _, m := range s.messages() {
			total += keys(m.batch)["hot"]
		}
		if total != 100 {
			t.Errorf("hot's spends published after the outage: %v, want 100", total)
		}
	})
}
