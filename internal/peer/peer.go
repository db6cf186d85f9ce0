// Package peer is the link between regions for rules pinned to a key's home
// region: the limiter.v1.Peer service, which decides and refunds the items
// other regions forward and holds, releases and renews the leases of pinned
// concurrency rules, open only to authenticated peer regions; and its
// client, the engine's Home and LeaseHome.
//
// A caller is a peer when it presents a client certificate the listener
// verified whose identity (a DNS or URI subject alternative name, or the
// common name) is in the allowed list, or the shared peer secret in the
// x-limiter-peer-secret metadata. Anything else is refused and counted.
package peer

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/engine/concurrency"
	"github.com/limiterd/limiterd/internal/engine/homes"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/usage"
	"github.com/limiterd/limiterd/internal/frontdoor/checkapi"
	"github.com/limiterd/limiterd/internal/secretfile"
	"github.com/limiterd/limiterd/internal/tlsconf"
	"github.com/limiterd/limiterd/pkg/bucket"
	"github.com/limiterd/limiterd/pkg/region"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// SecretHeader is the metadata that carries the shared peer secret.
const SecretHeader = "x-limiter-peer-secret"

// MinSecretLen is the shortest peer secret accepted.
const MinSecretLen = 16

// ErrUnauthenticated: a Peer call from a caller that is not a known peer.
var ErrUnauthenticated = errors.New("not an authenticated peer region")

// Auth says who may call the Peer service. The zero value admits nobody.
type Auth struct {
	// Secret is the shared peer secret; empty: none.
	Secret []byte
	// Identities are the allowed client certificate identities.
	Identities []string
}

// ReadSecret reads a peer secret file (see package secretfile): at least
// MinSecretLen characters, not open to other users.
func ReadSecret(path string, log *slog.Logger) ([]byte, error) {
	return secretfile.Read("--region.peer-secret-file", path, MinSecretLen, log)
}

// Check reports whether ctx's caller is a peer: nil, or ErrUnauthenticated.
func (a Auth) Check(ctx context.Context) error {
	if len(a.Secret) > 0 {
		if md, ok := metadata.FromIncomingContext(ctx); ok {
			for _, v := range md.Get(SecretHeader) {
				if subtle.ConstantTimeCompare([]byte(v), a.Secret) == 1 {
					return nil
				}
			}
		}
	}
	if len(a.Identities) > 0 && tlsconf.Allowed(tlsconf.VerifiedGRPC(ctx), a.Identities) {
		return nil
	}
	return ErrUnauthenticated
}

// Topologies are a region's topologies: the one in force, the one pending
// (nil: none), and a read of the topology file now (topowatch.Watcher).
type Topologies interface {
	Active() *region.Topology
	Pending() *region.Topology
	Reload() *region.Topology
}

// Service is limiter.v1.Peer over an engine. Safe for concurrent use.
type Service struct {
	limiterv1.UnimplementedPeerServer
	e       *engine.Engine
	region  string
	topo    Topologies
	auth    Auth
	refused *prometheus.CounterVec
}

// NewService returns the Peer service of region self with topologies topo
// (nil: no topology; every origin is refused).
func NewService(e *engine.Engine, self string, topo Topologies, auth Auth, reg prometheus.Registerer) (*Service, error) {
	refused := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "limiter_peer_calls_refused_total",
		Help: "Calls claiming to come from a peer region that were refused, by reason (unauthenticated: no valid peer credentials; invalid: an origin region outside the topology).",
	}, []string{"reason"})
	if err := reg.Register(refused); err != nil {
		return nil, err
	}
	for _, r := range []string{"unauthenticated", "invalid"} {
		refused.WithLabelValues(r)
	}
	return &Service{e: e, region: self, topo: topo, auth: auth, refused: refused}, nil
}

// MaxItems bounds the items of one Peer request.
const MaxItems = request.MaxItems

// authorize admits an authenticated peer whose origin is a region of the
// topology in force, or of the one pending (a region that switched a little
// earlier by its clock); it returns the topology in force.
func (s *Service) authorize(ctx context.Context, origin string) (*region.Topology, error) {
	if err := s.auth.Check(ctx); err != nil {
		s.refused.WithLabelValues("unauthenticated").Inc()
		return nil, status.Error(codes.PermissionDenied, err.Error())
	}
	var topo *region.Topology
	if s.topo != nil {
		topo = s.topo.Active()
	}
	if topo == nil || !topo.Has(origin) {
		if p := s.pending(); p == nil || !p.Has(origin) {
			s.refused.WithLabelValues("invalid").Inc()
			return nil, status.Errorf(codes.InvalidArgument, "origin_region: %q is not a region of the topology", origin)
		}
	}
	return topo, nil
}

func (s *Service) pending() *region.Topology {
	if s.topo == nil {
		return nil
	}
	return s.topo.Pending()
}

// Decide decides the items here, their keys' home, all or nothing. A
// sender with a newer topology generation makes this region read its
// topology file first; a sender with an older one is refused
// (FAILED_PRECONDITION, nothing decided) when a key is homed elsewhere
// under the topology in force here.
func (s *Service) Decide(ctx context.Context, req *limiterv1.PeerDecideRequest) (*limiterv1.PeerDecideResponse, error) {
	gen := req.GetTopologyGeneration()
	if s.topo != nil && s.auth.Check(ctx) == nil && gen > s.topo.Active().Generation() {
		s.topo.Reload()
	}
	topo, err := s.authorize(ctx, req.GetOriginRegion())
	if err != nil {
		return nil, err
	}
	if n := len(req.GetItems()); n == 0 || n > MaxItems {
		return nil, status.Errorf(codes.InvalidArgument, "items: %d items, want 1 to %d", n, MaxItems)
	}
	c := s.e.NewCheck()
	c.FromPeer(req.GetOriginRegion())
	items := make([]*request.Item, len(req.GetItems()))
	for i, pi := range req.GetItems() {
		it, err := c.AddRule(pi.GetRuleId(), pi.GetKey(), pi.GetCost())
		if err != nil {
			return nil, checkapi.Status(fmt.Errorf("items[%d].%w", i, err))
		}
		if slices.Contains(items[:i], it) {
			return nil, status.Errorf(codes.InvalidArgument, "items[%d]: rule %q and key given twice", i, pi.GetRuleId())
		}
		items[i] = it
	}
	if topo != nil && gen < topo.Generation() {
		for i, it := range items {
			if home := topo.Home(it.Key, it.Rule.HomeKeys); it.Rule.Pinned() && home != s.region {
				return nil, status.Errorf(codes.FailedPrecondition, "topology generation %d here (%d forwarded): items[%d] (rule %q): the key's home is %s",
					topo.Generation(), gen, i, it.Rule.ID, home)
			}
		}
	}
	if w := req.GetMaxWaitUs(); w != 0 {
		if err := c.Pace(time.Duration(w) * time.Microsecond); err != nil {
			return nil, checkapi.Status(err)
		}
	}
	allowed, err := s.e.Decide(ctx, c)
	if err != nil {
		return nil, checkapi.Status(err)
	}
	resp := &limiterv1.PeerDecideResponse{Allowed: allowed}
	for _, it := range items {
		resp.Statuses = append(resp.Statuses, checkapi.RuleStatus(it))
		// Set only for what this region's store spent (request.Item).
		resp.SpentAtUs = append(resp.SpentAtUs, it.Decision.At)
	}
	if allowed && c.MaxWait() > 0 {
		// Every item reserved at one instant: one wait, rounded up.
		resp.WaitUs = int64((items[0].Decision.Wait + time.Microsecond - 1) / time.Microsecond)
	}
	return resp, nil
}

// homeItems authorizes origin and reads the items of a Refund or a
// Handoff: 1 to MaxItems, each with a valid key (the engine checks the
// rules and costs).
func (s *Service) homeItems(ctx context.Context, origin string, pis []*limiterv1.PeerItem) ([]homes.Item, error) {
	if _, err := s.authorize(ctx, origin); err != nil {
		return nil, err
	}
	if n := len(pis); n == 0 || n > MaxItems {
		return nil, status.Errorf(codes.InvalidArgument, "items: %d items, want 1 to %d", n, MaxItems)
	}
	items := make([]homes.Item, len(pis))
	for i, pi := range pis {
		if err := bucket.ValidateKey(pi.GetKey()); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "items[%d].key: %v", i, err)
		}
		items[i] = homes.Item{Rule: pi.GetRuleId(), Key: pi.GetKey(), Cost: pi.GetCost(), At: pi.GetSpentAtUs()}
	}
	return items, nil
}

// Refund gives back what an allowed Decide spent.
func (s *Service) Refund(ctx context.Context, req *limiterv1.PeerRefundRequest) (*limiterv1.PeerRefundResponse, error) {
	items, err := s.homeItems(ctx, req.GetOriginRegion(), req.GetItems())
	if err != nil {
		return nil, err
	}
	if err := s.e.Refund(ctx, items); err != nil {
		return nil, checkapi.Status(err)
	}
	return &limiterv1.PeerRefundResponse{}, nil
}

// Settle settles here the estimate a pinned rule's check from the origin
// spent in this region's store, once.
func (s *Service) Settle(ctx context.Context, req *limiterv1.PeerSettleRequest) (*limiterv1.PeerSettleResponse, error) {
	if _, err := s.authorize(ctx, req.GetOriginRegion()); err != nil {
		return nil, err
	}
	r, err := s.e.SettleHere(ctx, bucket.Settlement{
		Request: bucket.Request{Rule: req.GetRuleId(), Key: req.GetKey(), Cost: req.GetEstimate()},
		At:      req.GetSpentAtUs(), Actual: req.GetActualCost(), ID: req.GetId(),
		TTL: time.Duration(req.GetTtlMs()) * time.Millisecond,
	})
	if err != nil {
		return nil, checkapi.Status(err)
	}
	return &limiterv1.PeerSettleResponse{Replay: r.Replay, ActualCost: r.Actual}, nil
}

// Acquire holds here the leases of a lease id's parts that name this
// region: pinned concurrency rules whose keys this region homes. The
// topology generation is handled as by Decide: a newer one makes this
// region read its topology file first; under an older one a key homed
// elsewhere is refused with FAILED_PRECONDITION, nothing held.
func (s *Service) Acquire(ctx context.Context, req *limiterv1.PeerAcquireRequest) (*limiterv1.PeerAcquireResponse, error) {
	gen := req.GetTopologyGeneration()
	if s.topo != nil && s.auth.Check(ctx) == nil && gen > s.topo.Active().Generation() {
		s.topo.Reload()
	}
	if _, err := s.authorize(ctx, req.GetOriginRegion()); err != nil {
		return nil, err
	}
	pl, err := s.e.Concurrency().PeerAcquire(ctx, req.GetOriginRegion(), gen, req.GetLeaseId())
	if errors.Is(err, homes.ErrStaleTopology) {
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	if err != nil {
		return nil, checkapi.Status(err)
	}
	resp := &limiterv1.PeerAcquireResponse{Allowed: pl.Allowed, Fallback: pl.Fallback}
	for _, it := range pl.Items {
		resp.Statuses = append(resp.Statuses, checkapi.RuleStatus(it))
	}
	if pl.Allowed {
		resp.ExpiresAtUs, resp.LeaseTtlMs = pl.Expires.UnixMicro(), pl.TTL.Milliseconds()
	}
	return resp, nil
}

// Release gives back the leases of a lease id held here; the parts held in
// other regions are left alone (a forwarded call is never forwarded
// again).
func (s *Service) Release(ctx context.Context, req *limiterv1.PeerLeaseRequest) (*limiterv1.PeerReleaseResponse, error) {
	if _, err := s.authorize(ctx, req.GetOriginRegion()); err != nil {
		return nil, err
	}
	sample, err := concurrency.Sample(req.DurationMs, req.GetFailed())
	if err != nil {
		return nil, checkapi.Status(err)
	}
	released, err := s.e.Concurrency().PeerRelease(ctx, req.GetLeaseId(), sample)
	if err != nil {
		return nil, checkapi.Status(err)
	}
	return &limiterv1.PeerReleaseResponse{Released: released}, nil
}

// Renew extends the leases of a lease id held here.
func (s *Service) Renew(ctx context.Context, req *limiterv1.PeerLeaseRequest) (*limiterv1.PeerRenewResponse, error) {
	if _, err := s.authorize(ctx, req.GetOriginRegion()); err != nil {
		return nil, err
	}
	renewed, l, err := s.e.Concurrency().PeerRenew(ctx, req.GetLeaseId())
	if err != nil {
		return nil, checkapi.Status(err)
	}
	resp := &limiterv1.PeerRenewResponse{Renewed: renewed}
	if l != nil {
		resp.ExpiresAtUs, resp.LeaseTtlMs = l.Expires.UnixMicro(), l.TTL.Milliseconds()
	}
	return resp, nil
}

// Handoff answers a key's new home after a topology switch: what the
// buckets of items (pinned rate rules' keys that were homed here) count.
// Nothing is spent; the topology in force here is not consulted, since the
// keys are, by then, homed elsewhere.
func (s *Service) Handoff(ctx context.Context, req *limiterv1.PeerHandoffRequest) (*limiterv1.PeerHandoffResponse, error) {
	items, err := s.homeItems(ctx, req.GetOriginRegion(), req.GetItems())
	if err != nil {
		return nil, err
	}
	used, err := s.e.Used(ctx, items)
	if err != nil {
		return nil, checkapi.Status(err)
	}
	return &limiterv1.PeerHandoffResponse{Used: used}, nil
}

// Usage answers what a check of items, whose keys are homed here, would
// see now, changing nothing.
func (s *Service) Usage(ctx context.Context, req *limiterv1.PeerUsageRequest) (*limiterv1.PeerUsageResponse, error) {
	if _, err := s.authorize(ctx, req.GetOriginRegion()); err != nil {
		return nil, err
	}
	if n := len(req.GetItems()); n == 0 || n > usage.MaxItems {
		return nil, status.Errorf(codes.InvalidArgument, "items: %d items, want 1 to %d", n, usage.MaxItems)
	}
	items := make([]homes.Item, len(req.GetItems()))
	for i, pi := range req.GetItems() {
		items[i] = homes.Item{Rule: pi.GetRuleId(), Key: pi.GetKey(), Cost: pi.GetCost()}
	}
	u := s.e.NewUsage()
	u.FromPeer(req.GetOriginRegion())
	if err := u.AddItems(items); err != nil {
		return nil, checkapi.Status(err)
	}
	if err := s.e.Usage(ctx, u); err != nil {
		return nil, checkapi.Status(err)
	}
	ds := u.Decisions()
	resp := &limiterv1.PeerUsageResponse{Statuses: make([]*limiterv1.RuleStatus, len(ds))}
	for i, d := range ds {
		resp.Statuses[i] = &limiterv1.RuleStatus{RuleId: items[i].Rule, Allowed: d.Allowed, Remaining: d.Remaining, Limit: d.Limit,
			RetryAfterMs: request.CeilMillis(d.RetryAfter), ResetAfterMs: request.CeilMillis(d.ResetAfter)}
	}
	return resp, nil
}

// Client is another region's limiterd, as the engine's Home (and
// LeaseHome).
type Client struct {
	origin     string
	secret     []byte
	generation uint64
	c          limiterv1.PeerClient
}

// WithGeneration returns a copy of c that sends generation as its
// topology's (the one the engine routes the checks it forwards with).
func (c *Client) WithGeneration(generation uint64) *Client {
	cc := *c
	cc.generation = generation
	return &cc
}

// NewClient returns the Home of a region reached over cc, for checks
// forwarded from region origin, authenticated by secret (when not empty)
// and by cc's client certificate (when it has one).
func NewClient(cc grpc.ClientConnInterface, origin string, secret []byte) *Client {
	return &Client{origin: origin, secret: secret, c: limiterv1.NewPeerClient(cc)}
}

func (c *Client) outgoing(ctx context.Context) context.Context {
	if len(c.secret) > 0 {
		return metadata.AppendToOutgoingContext(ctx, SecretHeader, string(c.secret))
	}
	return ctx
}

func items(its []homes.Item) []*limiterv1.PeerItem {
	out := make([]*limiterv1.PeerItem, len(its))
	for i, it := range its {
		out[i] = &limiterv1.PeerItem{RuleId: it.Rule, Key: it.Key, Cost: it.Cost, SpentAtUs: it.At}
	}
	return out
}

// Decide forwards items to the home region.
func (c *Client) Decide(ctx context.Context, its []homes.Item) (bool, []bucket.Decision, error) {
	req := &limiterv1.PeerDecideRequest{OriginRegion: c.origin, Items: items(its), TopologyGeneration: c.generation}
	if len(its) > 0 && its[0].MaxWait > 0 {
		req.MaxWaitUs = its[0].MaxWait.Microseconds()
	}
	resp, err := c.c.Decide(c.outgoing(ctx), req)
	if err != nil {
		return false, nil, homeError(err)
	}
	if n, m := len(resp.GetSpentAtUs()), len(resp.GetStatuses()); n != m {
		return false, nil, fmt.Errorf("home answered %d instants for %d statuses", n, m)
	}
	ds := make([]bucket.Decision, len(resp.GetStatuses()))
	for i, st := range resp.GetStatuses() {
		ds[i] = bucket.Decision{
			Allowed: st.GetAllowed(), Remaining: st.GetRemaining(), Limit: st.GetLimit(),
			RetryAfter: time.Duration(st.GetRetryAfterMs()) * time.Millisecond,
			ResetAfter: time.Duration(st.GetResetAfterMs()) * time.Millisecond,
			Wait:       time.Duration(resp.GetWaitUs()) * time.Microsecond,
			At:         max(resp.GetSpentAtUs()[i], 0),
		}
	}
	return resp.GetAllowed(), ds, nil
}

// Refund gives back what Decide spent in the home region's store.
func (c *Client) Refund(ctx context.Context, its []homes.Item) error {
	_, err := c.c.Refund(c.outgoing(ctx), &limiterv1.PeerRefundRequest{OriginRegion: c.origin, Items: items(its)})
	return homeError(err)
}

// Settle settles at the key's home region the estimate a pinned rule's
// check spent there, once. Any error of the home is the home's: the
// origin validated the settlement, so a refusal there is no fault of the
// caller's.
func (c *Client) Settle(ctx context.Context, st bucket.Settlement) (bucket.Settled, error) {
	resp, err := c.c.Settle(c.outgoing(ctx), &limiterv1.PeerSettleRequest{
		OriginRegion: c.origin, RuleId: st.Rule, Key: st.Key, Estimate: st.Cost, SpentAtUs: st.At,
		ActualCost: st.Actual, Id: st.ID, TtlMs: st.TTL.Milliseconds(),
	})
	if err != nil {
		return bucket.Settled{}, fmt.Errorf("home region: %w", err)
	}
	return bucket.Settled{Replay: resp.GetReplay(), Actual: resp.GetActualCost()}, nil
}

// Handoff asks a key's old home what the buckets of its items count.
func (c *Client) Handoff(ctx context.Context, its []homes.Item) ([]float64, error) {
	resp, err := c.c.Handoff(c.outgoing(ctx), &limiterv1.PeerHandoffRequest{OriginRegion: c.origin, Items: items(its)})
	if err != nil {
		return nil, homeError(err)
	}
	return resp.GetUsed(), nil
}

// Usage asks the home region what a check of its items would see there.
func (c *Client) Usage(ctx context.Context, its []homes.Item) ([]bucket.Decision, error) {
	resp, err := c.c.Usage(c.outgoing(ctx), &limiterv1.PeerUsageRequest{OriginRegion: c.origin, Items: items(its)})
	if err != nil {
		return nil, homeError(err)
	}
	ds := make([]bucket.Decision, len(resp.GetStatuses()))
	for i, st := range resp.GetStatuses() {
		ds[i] = bucket.Decision{
			Allowed: st.GetAllowed(), Remaining: st.GetRemaining(), Limit: st.GetLimit(),
			RetryAfter: time.Duration(st.GetRetryAfterMs()) * time.Millisecond,
			ResetAfter: time.Duration(st.GetResetAfterMs()) * time.Millisecond,
		}
	}
	return ds, nil
}

// AcquireLease asks the home region to hold the leases of leaseID's parts
// that name it.
func (c *Client) AcquireLease(ctx context.Context, leaseID string) (concurrency.HomeLease, error) {
	resp, err := c.c.Acquire(c.outgoing(ctx), &limiterv1.PeerAcquireRequest{OriginRegion: c.origin, LeaseId: leaseID, TopologyGeneration: c.generation})
	if err != nil {
		return concurrency.HomeLease{}, leaseError(err)
	}
	hl := concurrency.HomeLease{Allowed: resp.GetAllowed(), Fallback: resp.GetFallback(),
		Expires: time.UnixMicro(resp.GetExpiresAtUs()), TTL: time.Duration(resp.GetLeaseTtlMs()) * time.Millisecond}
	for _, st := range resp.GetStatuses() {
		hl.Decisions = append(hl.Decisions, bucket.Decision{
			Allowed: st.GetAllowed(), Remaining: st.GetRemaining(), Limit: st.GetLimit(),
			RetryAfter: time.Duration(st.GetRetryAfterMs()) * time.Millisecond,
			ResetAfter: time.Duration(st.GetResetAfterMs()) * time.Millisecond,
		})
	}
	return hl, nil
}

// ReleaseLease asks the region holding leases of leaseID to give them
// back, with the caller's sample of the request (nil: none).
func (c *Client) ReleaseLease(ctx context.Context, leaseID string, sample *bucket.LeaseSample) (bool, error) {
	req := &limiterv1.PeerLeaseRequest{OriginRegion: c.origin, LeaseId: leaseID}
	if sample != nil {
		ms := sample.Duration.Milliseconds()
		req.DurationMs, req.Failed = &ms, sample.Failed
	}
	resp, err := c.c.Release(c.outgoing(ctx), req)
	if err != nil {
		return false, leaseError(err)
	}
	return resp.GetReleased(), nil
}

// RenewLease asks the region holding leases of leaseID to extend them.
func (c *Client) RenewLease(ctx context.Context, leaseID string) (bool, time.Time, time.Duration, error) {
	resp, err := c.c.Renew(c.outgoing(ctx), &limiterv1.PeerLeaseRequest{OriginRegion: c.origin, LeaseId: leaseID})
	if err != nil {
		return false, time.Time{}, 0, leaseError(err)
	}
	if !resp.GetRenewed() {
		return false, time.Time{}, 0, nil
	}
	return true, time.UnixMicro(resp.GetExpiresAtUs()), time.Duration(resp.GetLeaseTtlMs()) * time.Millisecond, nil
}

// leaseError is homeError for lease calls: the home's verdict on an
// invalid lease id names lease_id.
func leaseError(err error) error {
	if status.Code(err) == codes.InvalidArgument {
		return &request.InvalidError{Field: "lease_id", Err: fmt.Errorf("home region: %s", status.Convert(err).Message())}
	}
	return homeError(err)
}

// homeError makes the home's verdict on invalid items an engine error (its
// answer stands); a call that ran out of time wraps bucket.ErrOutcomeUnknown
// (the home may have decided and spent); any other error means it did not
// answer.
func homeError(err error) error {
	switch status.Code(err) {
	case codes.OK:
		return nil
	case codes.DeadlineExceeded:
		return fmt.Errorf("home region: %w: %w", bucket.ErrOutcomeUnknown, err)
	case codes.InvalidArgument:
		return &request.InvalidError{Field: "attributes", Err: fmt.Errorf("home region: %s", status.Convert(err).Message())}
	case codes.NotFound:
		return fmt.Errorf("home region: %s: %w", status.Convert(err).Message(), request.ErrUnknownRule)
	case codes.FailedPrecondition:
		return fmt.Errorf("home region: %s: %w", status.Convert(err).Message(), homes.ErrStaleTopology)
	}
	return err
}

// Client is the engine's Home and LeaseHome.
var (
	_ homes.Home            = (*Client)(nil)
	_ concurrency.LeaseHome = (*Client)(nil)
)
