package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
)

// TestScrape reads a real two-region supercluster: the server is up, its
// gateway to the other region has a round-trip time, and a consumer's lag
// is the messages it has not been sent. A target not in --targets is
// refused; one that does not answer is nats_up 0.
func TestScrape(t *testing.T) {
	sc := natstest.NewSupercluster(t, []string{"east", "west"}, 1)
	east := sc.Servers("east")[0]
	down := testenv.FreeAddr(t)
	srv := httptest.NewServer(handler([]string{east.MonitorAddr(), down}, http.DefaultClient))
	defer srv.Close()

	nc, err := nats.Connect(sc.URL("east"))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "SPENDS", Subjects: []string{"spends.>"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "apply", AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := js.Publish(ctx, "spends.east", []byte("x")); err != nil {
			t.Fatal(err)
		}
	}

	scrape := func(target string) (int, map[string]*dto.MetricFamily) {
		t.Helper()
		resp, err := http.Get(srv.URL + "/scrape?target=" + url.QueryEscape(target))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, map[string]*dto.MetricFamily{"body": {Name: new(string(b))}}
		}
		parser := expfmt.NewTextParser(model.UTF8Validation)
		mfs, err := parser.TextToMetricFamilies(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, mfs
	}
	value := func(mfs map[string]*dto.MetricFamily, name string, labels ...string) (float64, bool) {
		mf := mfs[name]
		if mf == nil {
			return 0, false
		}
	metrics:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, l := range m.GetLabel() {
					if l.GetName() == labels[i] && l.GetValue() == labels[i+1] {
						found = true
					}
				}
				if !found {
					continue metrics
				}
			}
			if g := m.GetGauge(); g != nil {
				return g.GetValue(), true
			}
			return m.GetCounter().GetValue(), true
		}
		return 0, false
	}

	testenv.WaitFor(t, "the gateway's round-trip time and the consumer's lag", func() bool {
		code, mfs := scrape(east.MonitorAddr())
		if code != http.StatusOK {
			t.Fatalf("scrape: %d", code)
		}
		up, _ := value(mfs, "nats_up")
		rtt, hasRTT := value(mfs, "nats_gateway_rtt_seconds", "gateway", "west")
		lag, _ := value(mfs, "nats_jetstream_consumer_pending_messages", "stream", "SPENDS", "consumer", "apply")
		msgs, _ := value(mfs, "nats_jetstream_stream_messages", "stream", "SPENDS")
		in, _ := value(mfs, "nats_in_messages_total")
		return up == 1 && hasRTT && rtt > 0 && lag == 3 && msgs == 3 && in >= 3
	})

	if code, mfs := scrape(down); code != http.StatusOK {
		t.Errorf("scrape of a target that does not answer: %d, want 200 with nats_up 0", code)
	} else if up, ok := value(mfs, "nats_up"); !ok || up != 0 {
		t.Errorf("nats_up of a target that does not answer: %v (%v), want 0", up, ok)
	}
	if code, mfs := scrape("169.254.169.254:80"); code != http.StatusBadRequest || !strings.Contains(mfs["body"].GetName(), "target") {
		t.Errorf("scrape of a target not in --targets: %d, want 400 naming target", code)
	}
}

func TestParseTargets(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want string
	}{
		{"", "at least one"},
		{" , ", "at least one"},
		{"127.0.0.1", `"127.0.0.1" is not host:port`},
		{"127.0.0.1:8222,nope", `"nope" is not host:port`},
	} {
		if _, err := parseTargets(tt.in); err == nil || !strings.Contains(err.Error(), tt.want) || !strings.Contains(err.Error(), "--targets") {
			t.Errorf("parseTargets(%q): %v, want an error naming --targets and %q", tt.in, err, tt.want)
		}
	}
	if got, err := parseTargets("127.0.0.1:8222, 127.0.0.1:8223"); err != nil || len(got) != 2 {
		t.Errorf("two targets: %v, %v", got, err)
	}
}
