package peer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// topologies is a fixed pair of topologies, in force and pending.
type topologies struct{ active, pending *region.Topology }

func (t topologies) Active() *region.Topology  { return t.active }
func (t topologies) Pending() *region.Topology { return t.pending }
func (t topologies) Reload() *region.Topology  { return t.active }

func topology(t *testing.T, names ...string) *region.Topology {
	t.Helper()
	var rs []region.Region
	for i, n := range names {
		rs = append(rs, region.Region{Name: n, LimiterAddress: fmt.Sprintf("127.0.0.1:%d", 8081+i)})
	}
	topo, err := region.New(rs)
	if err != nil {
		t.Fatal(err)
	}
	return topo
}

func incoming(kv ...string) context.Context {
	return metadata.NewIncomingContext(context.Background(), metadata.Pairs(kv...))
}

// TestAuthCheck: the shared secret admits only when it matches exactly;
// the zero Auth admits nobody; identities without a verified client
// certificate admit nobody.
func TestAuthCheck(t *testing.T) {
	secret := []byte("0123456789abcdef")
	for _, tc := range []struct {
		name string
		auth Auth
		ctx  context.Context
		ok   bool
	}{
		{"secret", Auth{Secret: secret}, incoming(SecretHeader, string(secret)), true},
		{"secret among others", Auth{Secret: secret}, incoming(SecretHeader, "nope", SecretHeader, string(secret)), true},
		{"wrong secret", Auth{Secret: secret}, incoming(SecretHeader, "0123456789abcdeX"), false},
		{"secret's prefix", Auth{Secret: secret}, incoming(SecretHeader, "0123456789abcde"), false},
		{"no metadata", Auth{Secret: secret}, context.Background(), false},
		{"zero value", Auth{}, incoming(SecretHeader, ""), false},
		{"identities, no certificate", Auth{Identities: []string{"us-east"}}, incoming(SecretHeader, string(secret)), false},
	} {
		err := tc.auth.Check(tc.ctx)
		if (err == nil) != tc.ok {
			t.Errorf("%s: Check = %v, want ok %v", tc.name, err, tc.ok)
		}
		if err != nil && !errors.Is(err, ErrUnauthenticated) {
			t.Errorf("%s: %v, want ErrUnauthenticated", tc.name, err)
		}
	}
}

// TestAuthorize: an authenticated caller is admitted when its origin is a
// region of the topology in force or of the pending one; otherwise, or
// unauthenticated, it is refused and counted by reason.
func TestAuthorize(t *testing.T) {
	secret := []byte("0123456789abcdef")
	active, pending := topology(t, "us-east", "eu-west"), topology(t, "us-east", "eu-west", "ap-south")
	for _, tc := range []struct {
		name   string
		topo   Topologies
		ctx    context.Context
		origin string
		code   codes.Code
		reason string
	}{
		{"in force", topologies{active: active}, incoming(SecretHeader, string(secret)), "eu-west", codes.OK, ""},
		{"pending only", topologies{active: active, pending: pending}, incoming(SecretHeader, string(secret)), "ap-south", codes.OK, ""},
		{"unknown origin", topologies{active: active, pending: pending}, incoming(SecretHeader, string(secret)), "mars", codes.InvalidArgument, "invalid"},
		{"no topology", nil, incoming(SecretHeader, string(secret)), "eu-west", codes.InvalidArgument, "invalid"},
		{"unauthenticated", topologies{active: active}, incoming(SecretHeader, "wrong-secret-000"), "eu-west", codes.PermissionDenied, "unauthenticated"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := NewService(nil, "us-east", tc.topo, Auth{Secret: secret}, prometheus.NewRegistry())
			if err != nil {
				t.Fatal(err)
			}
			_, err = s.authorize(tc.ctx, tc.origin)
			if got := status.Code(err); got != tc.code {
				t.Fatalf("authorize(%s) = %v, want %v", tc.origin, err, tc.code)
			}
			for _, r := range []string{"unauthenticated", "invalid", "legacy_marker"} {
				want := 0.0
				if r == tc.reason {
					want = 1
				}
				if got := testutil.ToFloat64(s.refused.WithLabelValues(r)); got != want {
					t.Errorf("refusals %s = %v, want %v", r, got, want)
				}
			}
		})
	}
}

// TestHandoffRequests: the Handoff a key's new home sends is authorized as
// every Peer call, validated item by item (the error names the field), and
// answered with what each bucket counts, spending nothing.
func TestHandoffRequests(t *testing.T) {
	set, err := rules.Parse("rules.yml", []byte(`rules:
  - id: pin
    capacity: 10
    refill_per_second: 0.001
    home: pinned
  - id: free
    capacity: 10
    refill_per_second: 0.001
  - id: conc
    algorithm: concurrency
    limit: 5
    lease_ttl: 10s
    home: pinned
`))
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(engine.Options{Store: bucket.NewMemory(), Region: "us-east"}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	c := e.NewCheck()
	if _, err := c.AddRule("pin", "alice", 3); err != nil {
		t.Fatal(err)
	}
	if ok, err := e.Decide(context.Background(), c); !ok || err != nil {
		t.Fatalf("spend: %v, %v", ok, err)
	}
	secret := []byte("0123456789abcdef")
	s, err := NewService(e, "us-east", topologies{active: topology(t, "us-east", "eu-west")}, Auth{Secret: secret}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	authed := incoming(SecretHeader, string(secret))
	item := func(rule, key string) *limiterv1.PeerItem { return &limiterv1.PeerItem{RuleId: rule, Key: key} }
	many := make([]*limiterv1.PeerItem, MaxItems+1)
	for i := range many {
		many[i] = item("pin", fmt.Sprint("k", i))
	}
	for _, tc := range []struct {
		name  string
		ctx   context.Context
		items []*limiterv1.PeerItem
		code  codes.Code
		msg   string
	}{
		{"unauthenticated", incoming(SecretHeader, "wrong-secret-000"), []*limiterv1.PeerItem{item("pin", "alice")}, codes.PermissionDenied, ""},
		{"no items", authed, nil, codes.InvalidArgument, "items: 0 items"},
		{"too many items", authed, many, codes.InvalidArgument, fmt.Sprintf("items: %d items", MaxItems+1)},
		{"empty key", authed, []*limiterv1.PeerItem{item("pin", "alice"), item("pin", "")}, codes.InvalidArgument, "items[1].key"},
		{"unknown rule", authed, []*limiterv1.PeerItem{item("nope", "alice")}, codes.NotFound, "nope"},
		{"rule not pinned", authed, []*limiterv1.PeerItem{item("free", "alice")}, codes.InvalidArgument, "rule_id"},
		{"concurrency rule", authed, []*limiterv1.PeerItem{item("conc", "alice")}, codes.InvalidArgument, "rule_id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := s.Handoff(tc.ctx, &limiterv1.PeerHandoffRequest{OriginRegion: "eu-west", Items: tc.items})
			if status.Code(err) != tc.code || !strings.Contains(status.Convert(err).Message(), tc.msg) {
				t.Fatalf("Handoff = %v; want %v containing %q", err, tc.code, tc.msg)
			}
		})
	}
	for range 2 { // answering spends nothing
		resp, err := s.Handoff(authed, &limiterv1.PeerHandoffRequest{OriginRegion: "eu-west", Items: []*limiterv1.PeerItem{item("pin", "alice"), item("pin", "bob")}})
		if err != nil {
			t.Fatal(err)
		}
		if got := resp.GetUsed(); len(got) != 2 || math.Abs(got[0]-3) > 1e-3 || got[1] != 0 {
			t.Fatalf("used = %v, want [3 0]", got)
		}
	}
}
