package limiterd

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/peer"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// TestPacedCheckAPI: through the gRPC API on a Redis Cluster, a paced check
// of a spent bucket is allowed with wait_ms and a reservation, which
// CancelReservation gives back; max_wait_ms 0 answers as before; a bad wait
// is INVALID_ARGUMENT naming max_wait_ms.
func TestPacedCheckAPI(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	d := startDaemon(t, c.Addrs())
	lc := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// flood: capacity 10, 2/s (a slot every 500 ms).
	if resp, err := lc.Check(ctx, &limiterv1.CheckRequest{RuleId: "flood", Key: "p", Cost: 10}); err != nil || !resp.GetAllowed() || resp.GetWaitMs() != 0 || resp.GetReservation() != "" {
		t.Fatalf("unpaced check: %v, %v", resp, err)
	}
	if resp, err := lc.Check(ctx, &limiterv1.CheckRequest{RuleId: "flood", Key: "p"}); err != nil || resp.GetAllowed() {
		t.Fatalf("unpaced check of the spent bucket: %v, %v; want refused", resp, err)
	}
	resp, err := lc.Check(ctx, &limiterv1.CheckRequest{RuleId: "flood", Key: "p", MaxWaitMs: 2000})
	if err != nil || !resp.GetAllowed() || resp.GetWaitMs() < 400 || resp.GetWaitMs() > 500 || resp.GetReservation() == "" {
		t.Fatalf("paced check: %v, %v; want allowed with a wait of about 500 ms and a reservation", resp, err)
	}
	if beyond, err := lc.Check(ctx, &limiterv1.CheckRequest{RuleId: "flood", Key: "p", MaxWaitMs: 600}); err != nil || beyond.GetAllowed() || beyond.GetRetryAfterMs() <= 0 {
		t.Fatalf("beyond the wait (next slot ~1 s): %v, %v; want refused with a retry", beyond, err)
	}
	back, err := lc.CancelReservation(ctx, &limiterv1.CancelReservationRequest{Reservation: resp.GetReservation()})
	if err != nil || !back.GetGivenBack() {
		t.Fatalf("CancelReservation: %v, %v", back, err)
	}
	again, err := lc.Check(ctx, &limiterv1.CheckRequest{RuleId: "flood", Key: "p", MaxWaitMs: 2000})
	if err != nil || again.GetWaitMs() > 500 {
		t.Fatalf("after the give-back: %v, %v; want the same slot (<= 500 ms)", again, err)
	}
	// The first reservation again, now that another holds its slot: spent.
	if stale, err := lc.CancelReservation(ctx, &limiterv1.CancelReservationRequest{Reservation: resp.GetReservation()}); err != nil || stale.GetGivenBack() {
		t.Fatalf("a stale CancelReservation: %v, %v; want nothing given back", stale, err)
	}
	// A cost written into a reservation: refused, naming the field.
	parts := strings.Split(again.GetReservation(), ".")
	parts[3] = "10"
	if _, err := lc.CancelReservation(ctx, &limiterv1.CancelReservationRequest{Reservation: strings.Join(parts, ".")}); status.Code(err) != codes.InvalidArgument ||
		!strings.HasPrefix(status.Convert(err).Message(), "reservation") {
		t.Fatalf("a forged cost: %v, want INVALID_ARGUMENT starting with reservation", err)
	}
	for _, tc := range []struct {
		name string
		req  *limiterv1.CheckRequest
	}{
		{"negative", &limiterv1.CheckRequest{RuleId: "flood", Key: "p", MaxWaitMs: -1}},
		{"above 10 s", &limiterv1.CheckRequest{RuleId: "flood", Key: "p", MaxWaitMs: 10_001}},
		{"a sliding log", &limiterv1.CheckRequest{RuleId: "log", Key: "p", MaxWaitMs: 100}},
	} {
		_, err := lc.Check(ctx, tc.req)
		if st, _ := status.FromError(err); st.Code() != codes.InvalidArgument || !strings.HasPrefix(st.Message(), "max_wait_ms") {
			t.Errorf("%s: %v, want INVALID_ARGUMENT starting with max_wait_ms", tc.name, err)
		}
	}
	if _, err := lc.CancelReservation(ctx, &limiterv1.CancelReservationRequest{Reservation: "garbage"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("malformed reservation: %v, want INVALID_ARGUMENT", err)
	}
}

// TestPeerDecidePaced: the home side of a forwarded paced check reserves
// within max_wait_us and answers wait_us.
func TestPeerDecidePaced(t *testing.T) {
	secretFile := testenv.SecretFile(t)
	secret, err := peer.ReadSecret(secretFile, nil)
	if err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, nil, func(o *Options) {
		o.Region.Name = "us-east"
		o.Region.TopologyFile = twoRegionTopology(t)
		o.Region.PeerSecretFile = secretFile
	})
	p := limiterv1.NewPeerClient(dial(t, d.GRPCAddr()))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, peer.SecretHeader, string(secret))
	item := func(cost float64) []*limiterv1.PeerItem {
		return []*limiterv1.PeerItem{{RuleId: "flood", Key: "home", Cost: cost}}
	}
	if resp, err := p.Decide(ctx, &limiterv1.PeerDecideRequest{OriginRegion: "eu-west", Items: item(10)}); err != nil || !resp.GetAllowed() {
		t.Fatalf("spending the bucket: %v, %v", resp, err)
	}
	resp, err := p.Decide(ctx, &limiterv1.PeerDecideRequest{OriginRegion: "eu-west", Items: item(1), MaxWaitUs: 2_000_000})
	if err != nil || !resp.GetAllowed() || resp.GetWaitUs() < 400_000 || resp.GetWaitUs() > 500_000 {
		t.Fatalf("paced Decide: %v, %v; want allowed with a wait of about 500 ms", resp, err)
	}
	_, err = p.Decide(ctx, &limiterv1.PeerDecideRequest{OriginRegion: "eu-west", Items: []*limiterv1.PeerItem{{RuleId: "log", Key: "home", Cost: 1}}, MaxWaitUs: 1000})
	if st, _ := status.FromError(err); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "max_wait_ms") {
		t.Fatalf("paced Decide of a sliding log: %v, want INVALID_ARGUMENT naming max_wait_ms", err)
	}
}

// TestPeerSettle: the home settles a forwarded check's estimate in its
// store once, for a peer only; a rule it does not have is NOT_FOUND.
func TestPeerSettle(t *testing.T) {
	secretFile := testenv.SecretFile(t)
	secret, err := peer.ReadSecret(secretFile, nil)
	if err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, nil, func(o *Options) {
		o.Region.Name = "us-east"
		o.Region.TopologyFile = twoRegionTopology(t)
		o.Region.PeerSecretFile = secretFile
	})
	p := limiterv1.NewPeerClient(dial(t, d.GRPCAddr()))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := p.Settle(ctx, &limiterv1.PeerSettleRequest{OriginRegion: "eu-west", RuleId: "flood", Key: "home", Estimate: 1, SpentAtUs: 1, Id: "x", TtlMs: 1000}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("Settle without the secret: %v, want PERMISSION_DENIED", err)
	}
	ctx = metadata.AppendToOutgoingContext(ctx, peer.SecretHeader, string(secret))
	resp, err := p.Decide(ctx, &limiterv1.PeerDecideRequest{OriginRegion: "eu-west", Items: []*limiterv1.PeerItem{{RuleId: "flood", Key: "home", Cost: 9}}})
	if err != nil || !resp.GetAllowed() || resp.GetSpentAtUs()[0] <= 0 {
		t.Fatalf("Decide: %v, %v", resp, err)
	}
	req := &limiterv1.PeerSettleRequest{OriginRegion: "eu-west", RuleId: "flood", Key: "home", Estimate: 9,
		SpentAtUs: resp.GetSpentAtUs()[0], ActualCost: 1, Id: "settle-1", TtlMs: 60_000}
	for i, replay := range []bool{false, true} {
		s, err := p.Settle(ctx, req)
		if err != nil || s.GetReplay() != replay || s.GetActualCost() != 1 {
			t.Fatalf("Settle #%d: %v, %v; want replay %v of 1", i+1, s, err, replay)
		}
		req.ActualCost = 5
	}
	if resp, err := p.Decide(ctx, &limiterv1.PeerDecideRequest{OriginRegion: "eu-west", Items: []*limiterv1.PeerItem{{RuleId: "flood", Key: "home", Cost: 8}}}); err != nil || !resp.GetAllowed() {
		t.Fatalf("8 more after 8 of the 9 came back: %v, %v; want allowed", resp, err)
	}
	req.RuleId = "nope"
	if _, err := p.Settle(ctx, req); status.Code(err) != codes.NotFound {
		t.Fatalf("Settle of an unknown rule: %v, want NOT_FOUND", err)
	}
}
