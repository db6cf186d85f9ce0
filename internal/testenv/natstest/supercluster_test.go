package natstest_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limiterd/limiterd/internal/testenv/natstest"
)

// waitMsgs waits until stream holds want messages, or fails after 30 s.
func waitMsgs(t *testing.T, js jetstream.JetStream, stream string, want uint64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		s, err := js.Stream(t.Context(), stream)
		if err == nil && s.CachedInfo().State.Msgs == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not %d messages after 30s (%v)", stream, want, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// msgs is how many messages stream holds now.
func msgs(t *testing.T, js jetstream.JetStream, stream string) uint64 {
	t.Helper()
	s, err := js.Stream(t.Context(), stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	return s.CachedInfo().State.Msgs
}

// TestSupercluster: a stream is placed in the cluster of the region
// that makes it, sourced into the others over the gateways; a cut gateway
// delays only what crosses it; a stopped server comes back.
func TestSupercluster(t *testing.T) {
	regions := []string{"us-east", "eu-west", "ap-south"}
	sc := natstest.NewSupercluster(t, regions, 1)
	js := map[string]jetstream.JetStream{}
	for _, r := range regions {
		nc, j := connect(t, sc.URL(r))
		if got := nc.ConnectedClusterName(); got != r {
			t.Fatalf("a client of %s is connected to cluster %q", r, got)
		}
		js[r] = j
		if _, err := j.CreateStream(t.Context(), jetstream.StreamConfig{Name: "OUT_" + r, Subjects: []string{"out." + r},
			Storage: jetstream.FileStorage, Placement: &jetstream.Placement{Cluster: r}}); err != nil {
			t.Fatalf("create OUT_%s: %v", r, err)
		}
	}
	for _, r := range regions {
		cfg := jetstream.StreamConfig{Name: "IN_" + r, Storage: jetstream.FileStorage, Placement: &jetstream.Placement{Cluster: r}}
		for _, o := range regions {
			if o != r {
				cfg.Sources = append(cfg.Sources, &jetstream.StreamSource{Name: "OUT_" + o})
			}
		}
		s, err := js[r].CreateStream(t.Context(), cfg)
		if err != nil {
			t.Fatalf("create IN_%s: %v", r, err)
		}
		if got := s.CachedInfo().Cluster.Name; got != r {
			t.Errorf("IN_%s is placed in cluster %q", r, got)
		}
	}
	publish := func(r string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		if _, err := js[r].Publish(ctx, "out."+r, []byte("x")); err != nil {
			t.Fatalf("publish in %s: %v", r, err)
		}
	}
	for _, r := range regions {
		publish(r)
	}
	for _, r := range regions {
		waitMsgs(t, js[r], "IN_"+r, 2)
	}

	sc.Cut("us-east", "eu-west")
	if !sc.Severed("eu-west", "us-east") || sc.Severed("us-east", "ap-south") {
		t.Fatal("Severed does not say what was cut")
	}
	publish("us-east")
	publish("eu-west")
	publish("ap-south")
	waitMsgs(t, js["ap-south"], "IN_ap-south", 4)
	waitMsgs(t, js["us-east"], "IN_us-east", 3) // ap-south's
	waitMsgs(t, js["eu-west"], "IN_eu-west", 3)
	time.Sleep(3 * time.Second)
	for _, r := range []string{"us-east", "eu-west"} {
		if n := msgs(t, js[r], "IN_"+r); n != 3 {
			t.Errorf("IN_%s holds %d messages while cut from its peer, want 3", r, n)
		}
	}
	healed := time.Now()
	sc.Heal("us-east", "eu-west")
	waitMsgs(t, js["us-east"], "IN_us-east", 4)
	waitMsgs(t, js["eu-west"], "IN_eu-west", 4)
	t.Logf("the messages held by the cut were sourced %v after the heal", time.Since(healed).Round(10*time.Millisecond))

	srv := sc.Servers("ap-south")[0]
	srv.Kill()
	srv.Restart(t)
	sc.WaitReady(t)
	if n := msgs(t, js["ap-south"], "IN_ap-south"); n != 4 {
		t.Errorf("IN_ap-south holds %d messages after a restart, want 4", n)
	}
	publish("us-east")
	waitMsgs(t, js["ap-south"], "IN_ap-south", 5)
}

// TestSuperclusterDelay: with a one-way delay set between two regions, a
// message published in one reaches a subscriber in the other no sooner
// than the delay, and not much later; a request's answer takes the round
// trip. A region pair without a delay stays fast.
func TestSuperclusterDelay(t *testing.T) {
	regions := []string{"us-east", "eu-west", "ap-south"}
	sc := natstest.NewSupercluster(t, regions, 1)
	const oneWay = 120 * time.Millisecond
	const margin = 150 * time.Millisecond // a loaded machine, the race detector
	sc.SetDelay("us-east", "eu-west", oneWay)
	pub, _ := connect(t, sc.URL("us-east"))
	// Each pair: the lower bound every sample meets, the upper bound the
	// quickest one does.
	for _, tt := range []struct {
		to           string
		least, most  time.Duration
		requestLeast time.Duration
	}{
		{to: "eu-west", least: oneWay, most: oneWay + margin, requestLeast: 2 * oneWay},
		{to: "ap-south", least: 0, most: margin, requestLeast: 0},
	} {
		t.Run(tt.to, func(t *testing.T) {
			sub, _ := connect(t, sc.URL(tt.to))
			got := make(chan time.Time, 16)
			subj := "delay." + tt.to
			s, err := sub.Subscribe(subj, func(*nats.Msg) { got <- time.Now() })
			if err != nil {
				t.Fatal(err)
			}
			if _, err := sub.Subscribe("echo."+tt.to, func(m *nats.Msg) { _ = m.Respond(m.Data) }); err != nil {
				t.Fatal(err)
			}
			if err := sub.Flush(); err != nil {
				t.Fatal(err)
			}
			// The subscription's interest reaches us-east over the
			// gateway: wait until a message gets through.
			deadline := time.Now().Add(20 * time.Second)
			for {
				if err := pub.Publish(subj, nil); err != nil {
					t.Fatal(err)
				}
				select {
				case <-got:
				case <-time.After(500 * time.Millisecond):
					if time.Now().After(deadline) {
						t.Fatalf("no message from us-east reached %s", tt.to)
					}
					continue
				}
				break
			}
			time.Sleep(2 * oneWay) // the probes still in flight
			for len(got) > 0 {
				<-got
			}
			var lat []time.Duration
			for range 5 {
				sent := time.Now()
				if err := pub.Publish(subj, nil); err != nil {
					t.Fatal(err)
				}
				select {
				case at := <-got:
					lat = append(lat, at.Sub(sent))
				case <-time.After(10 * time.Second):
					t.Fatal("a message was not delivered within 10s")
				}
			}
			s.Unsubscribe()
			if lo := slices.Min(lat); lo < tt.least || lo > tt.most {
				t.Errorf("us-east to %s: one-way %v, want every one >= %v and the quickest <= %v", tt.to, lat, tt.least, tt.most)
			}
			for _, l := range lat {
				if l < tt.least {
					t.Errorf("us-east to %s: a message took %v, under the delay %v", tt.to, l, tt.least)
				}
			}
			start := time.Now()
			if _, err := pub.Request("echo."+tt.to, []byte("x"), 10*time.Second); err != nil {
				t.Fatal(err)
			}
			if rtt := time.Since(start); rtt < tt.requestLeast {
				t.Errorf("a request from us-east to %s answered in %v, under the round trip %v", tt.to, rtt, tt.requestLeast)
			}
			t.Logf("us-east to %s: one-way %v", tt.to, lat)
		})
	}
}
