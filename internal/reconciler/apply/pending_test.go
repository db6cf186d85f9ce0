package apply

import (
	"context"
	"errors"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limiterd/limiterd/internal/testenv/natstest"
)

// TestStreamPending: the counts read by a stream info request match the
// subjects the filter names, and a stream gone is ErrStreamNotFound.
func TestStreamPending(t *testing.T) {
	srv := natstest.NewServer(t)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "RETRY", Subjects: []string{"retry.>"}}); err != nil {
		t.Fatal(err)
	}
	s := StreamPending{NC: nc, Name: "RETRY"}
	got, err := s.Pending(ctx, "retry.a.*")
	if err != nil || len(got) != 0 {
		t.Fatalf("empty stream: %v, %v; want none", got, err)
	}
	for subject, n := range map[string]int{"retry.a.1": 2, "retry.a.7": 1, "retry.b.1": 3} {
		for range n {
			if _, err := js.Publish(ctx, subject, []byte("x")); err != nil {
				t.Fatal(err)
			}
		}
	}
	got, err = s.Pending(ctx, "retry.a.*")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got["retry.a.1"] != 2 || got["retry.a.7"] != 1 {
		t.Errorf("Pending(retry.a.*) = %v, want retry.a.1: 2, retry.a.7: 1", got)
	}
	if err := js.DeleteStream(ctx, "RETRY"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pending(ctx, "retry.a.*"); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Errorf("Pending on a stream gone: %v, want ErrStreamNotFound", err)
	}
}
