package engine

import (
	"context"
	"errors"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/concurrency"
	"github.com/limiterd/limiterd/internal/engine/leaseid"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

func (s *faultStore) Acquire(ctx context.Context, reqs []bucket.LeaseRequest, member string) ([]bucket.LeaseDecision, error) {
	if err := s.before(); err != nil {
		return nil, err
	}
	return s.Memory.Acquire(ctx, reqs, member)
}

func (s *faultStore) Release(ctx context.Context, reqs []bucket.LeaseRequest, member string) ([]bool, error) {
	if err := s.before(); err != nil {
		return nil, err
	}
	return s.Memory.Release(ctx, reqs, member)
}

func (s *faultStore) Renew(ctx context.Context, reqs []bucket.LeaseRequest, member string) ([]bucket.LeaseDecision, error) {
	if err := s.before(); err != nil {
		return nil, err
	}
	return s.Memory.Renew(ctx, reqs, member)
}

func newLeaseEngine(t *testing.T) (*Engine, *faultStore, *prometheus.Registry) {
	t.Helper()
	set, err := rules.Load("testdata/concurrency.yml")
	if err != nil {
		t.Fatal(err)
	}
	store := newFaultStore()
	reg := prometheus.NewRegistry()
	e, err := New(Options{Store: store, Region: "local", Logger: quietLogger()}, set, reg)
	if err != nil {
		t.Fatal(err)
	}
	return e, store, reg
}

func acquireAttrs(t *testing.T, e *Engine, a *rules.Attributes) (bool, *concurrency.Lease, *concurrency.Acquire, error) {
	t.Helper()
	c := e.NewAcquire()
	if _, _, err := c.AddAttributes(a, 1); err != nil {
		t.Fatal(err)
	}
	ok, l, err := e.Acquire(context.Background(), c)
	return ok, l, c, err
}

func TestAcquireReleaseRenew(t *testing.T) {
	e, _, _ := newLeaseEngine(t)
	ctx := context.Background()
	acquire := func() (bool, *concurrency.Lease) {
		c := e.NewAcquire()
		if _, err := c.AddRule("reports", "user:ann", 0); err != nil {
			t.Fatal(err)
		}
		ok, l, err := e.Acquire(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		if !ok && c.Leases()[0].Decision.RetryAfter <= 0 {
			t.Fatalf("a refusal without a retry: %+v", c.Leases()[0].Decision)
		}
		return ok, l
	}
	ok1, l1 := acquire()
	ok2, _ := acquire()
	ok3, _ := acquire()
	if !ok1 || !ok2 || ok3 {
		t.Fatalf("three acquires at limit 2: %v %v %v", ok1, ok2, ok3)
	}
	if l1.TTL != time.Second || time.Until(l1.Expires) > time.Second || time.Until(l1.Expires) < 900*time.Millisecond {
		t.Fatalf("lease %+v", l1)
	}
	if ok, l, err := e.Concurrency().Renew(ctx, l1.ID); !ok || err != nil || !l.Expires.After(l1.Expires.Add(-time.Millisecond)) {
		t.Fatalf("renew = %v, %+v, %v", ok, l, err)
	}
	for i, want := range []bool{true, false} {
		if got, err := e.Concurrency().Release(ctx, l1.ID, nil); got != want || err != nil {
			t.Fatalf("release %d = %v, %v; want %v (idempotent)", i, got, err, want)
		}
	}
	if ok, _, err := e.Concurrency().Renew(ctx, l1.ID); ok || err != nil {
		t.Fatalf("renew of a released lease = %v, %v; want gone", ok, err)
	}
	if ok, _ := acquire(); !ok {
		t.Fatal("acquire after a release refused")
	}
}

// An Acquire by attributes is all or nothing across concurrency and rate
// rules: a rate rule refusing holds no lease, a concurrency rule refusing
// spends no token.
func TestAcquireMixedAllOrNothing(t *testing.T) {
	e, _, _ := newLeaseEngine(t)
	ctx := context.Background()
	a := &rules.Attributes{User: "bob", Path: "/reports/1"}
	var leases []*concurrency.Lease
	for range 2 {
		ok, l, _, err := acquireAttrs(t, e, a)
		if !ok || err != nil || l == nil {
			t.Fatalf("acquire = %v, %v, %v", ok, l, err)
		}
		leases = append(leases, l)
	}
	// The concurrency rule refuses: no token spent (3 - 2 = 1 left).
	ok, _, c, err := acquireAttrs(t, e, a)
	if ok || err != nil || c.Leases()[0].Decision.Allowed {
		t.Fatalf("third acquire = %v, %v; want refused by the concurrency rule", ok, err)
	}
	_, _ = e.Concurrency().Release(ctx, leases[0].ID, nil)
	// The last token is still there (the refusal spent none): spend it;
	// then the rate rule refuses, and no lease is held.
	if ok, l, _, err := acquireAttrs(t, e, a); !ok || err != nil {
		t.Fatalf("acquire = %v, %v", ok, err)
	} else {
		_, _ = e.Concurrency().Release(ctx, l.ID, nil)
	}
	_, _ = e.Concurrency().Release(ctx, leases[1].ID, nil)
	ok, l, c, err := acquireAttrs(t, e, a)
	if ok || err != nil || l != nil {
		t.Fatalf("acquire with the rate rule empty = %v, %v, %v; want refused", ok, l, err)
	}
	if c.Leases()[0].Decision.Remaining != 2 {
		t.Errorf("concurrency status after the give-back: %+v, want 2 left", c.Leases()[0].Decision)
	}
	// No lease held: two acquires of the concurrency rule alone pass.
	for i := range 2 {
		c := e.NewAcquire()
		if _, err := c.AddRule("reports", "user:bob", 0); err != nil {
			t.Fatal(err)
		}
		if ok, _, err := e.Acquire(ctx, c); !ok || err != nil {
			t.Fatalf("acquire %d by rule id after the refusal = %v, %v: a lease was left held", i, ok, err)
		}
	}
}

func TestCheckOfAConcurrencyRuleIsInvalid(t *testing.T) {
	e, _, _ := newLeaseEngine(t)
	c := e.NewCheck()
	_, err := c.AddRule("reports", "k", 0)
	var inv *request.InvalidError
	if !errors.As(err, &inv) || inv.Field != "rule_id" || !errors.Is(err, request.ErrConcurrencyRule) || !strings.Contains(err.Error(), `"reports"`) {
		t.Fatalf("Check of a concurrency rule: %v", err)
	}
	_, _, err = e.NewCheck().AddAttributes(&rules.Attributes{User: "u", Path: "/reports/x"}, 1)
	if !errors.As(err, &inv) || inv.Field != "attributes" || !errors.Is(err, request.ErrConcurrencyRule) {
		t.Fatalf("Check by attributes matching a concurrency rule: %v", err)
	}
	_, err = e.NewAcquire().AddRule("api", "k", 0)
	if !errors.As(err, &inv) || inv.Field != "rule_id" || !errors.Is(err, concurrency.ErrNotConcurrency) {
		t.Fatalf("Acquire of a rate rule by id: %v", err)
	}
	_, err = e.NewAcquire().AddRule("reports", "k", 2)
	if !errors.As(err, &inv) || inv.Field != "cost" {
		t.Fatalf("Acquire at cost 2: %v", err)
	}
}

func TestLeaseIDValidation(t *testing.T) {
	e, _, _ := newLeaseEngine(t)
	ctx := context.Background()
	c := e.NewAcquire()
	if _, err := c.AddRule("reports", "user:cy", 0); err != nil {
		t.Fatal(err)
	}
	_, l, err := e.Acquire(ctx, c)
	if err != nil || l == nil {
		t.Fatal(err)
	}
	real, _ := leaseid.Parse(l.ID)
	forged := *real
	forged.Nonce[0] ^= 1
	otherRule := *real
	otherRule.Parts = []leaseid.Part{{Rule: "api", Key: "user:cy", Region: "local"}}
	otherRegion := *real
	otherRegion.Parts = []leaseid.Part{{Rule: real.Parts[0].Rule, Key: real.Parts[0].Key, Region: "mars"}}
	v1 := *real
	v1.Parts = []leaseid.Part{{Rule: real.Parts[0].Rule, Key: real.Parts[0].Key, Region: "local", Flags: 4}}
	for _, tt := range []struct {
		name    string
		id      string
		invalid bool
	}{
		{"empty", "", true},
		{"not base64", "!!!", true},
		{"truncated", l.ID[:len(l.ID)-3], true},
		{"trailing bytes", (&leaseid.ID{Parts: real.Parts}).String() + "AAAA", true},
		{"too long", strings.Repeat("A", leaseid.MaxLen+1), true},
		{"a rate rule's", otherRule.String(), true},
		{"held in a region not in the topology", otherRegion.String(), true},
		{"unknown flags", v1.String(), true},
		{"forged nonce", forged.String(), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			released, err := e.Concurrency().Release(ctx, tt.id, nil)
			var inv *request.InvalidError
			if tt.invalid {
				if !errors.As(err, &inv) || inv.Field != "lease_id" {
					t.Fatalf("Release(%q) = %v, %v; want an *request.InvalidError of lease_id", tt.id, released, err)
				}
				return
			}
			if released || err != nil {
				t.Fatalf("Release of a forged id = %v, %v; want not released, no error", released, err)
			}
		})
	}
	// The real lease is still held.
	if ok, _, err := e.Concurrency().Renew(ctx, l.ID); !ok || err != nil {
		t.Fatalf("the real lease after the forgeries: %v, %v", ok, err)
	}
}

// When the store fails, a fail-open concurrency rule holds a fallback
// lease (released through the same instance), and a fail-closed one
// refuses with ErrUnavailable.
func TestAcquireStoreFailure(t *testing.T) {
	e, store, _ := newLeaseEngine(t)
	ctx := context.Background()
	store.setFail(errors.New("connection refused"))
	c := e.NewAcquire()
	if _, err := c.AddRule("reports", "user:dee", 0); err != nil {
		t.Fatal(err)
	}
	ok, l, err := e.Acquire(ctx, c)
	if !ok || err != nil || c.Leases()[0].Route != request.RouteFallback {
		t.Fatalf("fail-open acquire with the store down = %v, %v", ok, err)
	}
	c = e.NewAcquire()
	if _, err := c.AddRule("strict", "k", 0); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Acquire(ctx, c); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("fail-closed acquire with the store down: %v, want ErrUnavailable", err)
	}
	store.setFail(nil)
	if released, err := e.Concurrency().Release(ctx, l.ID, nil); !released || err != nil {
		t.Fatalf("release of the fallback lease = %v, %v", released, err)
	}
}

// An abandoned lease expires after its length, and its slot comes back.
func TestAbandonedLeaseExpires(t *testing.T) {
	// In a bubble: the sleep past the leases' TTL takes no real time.
	synctest.Test(t, func(t *testing.T) {
		e, _, reg := newLeaseEngine(t)
		ctx := context.Background()
		for range 2 {
			c := e.NewAcquire()
			if _, err := c.AddRule("reports", "user:eve", 0); err != nil {
				t.Fatal(err)
			}
			if ok, _, _ := e.Acquire(ctx, c); !ok {
				t.Fatal("refused")
			}
		}
		if got := sumOf(t, reg, "limiter_concurrency_leases_in_flight"); got != 2 {
			t.Fatalf("in flight = %v, want 2", got)
		}
		c := e.NewAcquire()
		if _, err := c.AddRule("reports", "user:eve", 0); err != nil {
			t.Fatal(err)
		}
		if ok, _, _ := e.Acquire(ctx, c); ok {
			t.Fatal("a third lease at limit 2")
		}
		time.Sleep(time.Second + 20*time.Millisecond)
		c = e.NewAcquire()
		if _, err := c.AddRule("reports", "user:eve", 0); err != nil {
			t.Fatal(err)
		}
		if ok, _, _ := e.Acquire(ctx, c); !ok {
			t.Fatal("refused after the abandoned leases expired")
		}
		if got := sumOf(t, reg, "limiter_concurrency_leases_in_flight"); got != 1 {
			t.Fatalf("in flight = %v, want 1", got)
		}
		if got := sumOf(t, reg, "limiter_concurrency_leases_total"); got < 5 {
			t.Fatalf("lease events = %v, want at least 3 acquired, 1 refused, 2 expired", got)
		}
	})
}

// partStore fails the lease acquire of one key and refuses another's, as a
// store whose clients live on two nodes, one down, would.
type partStore struct{ *faultStore }

func (s partStore) Acquire(ctx context.Context, reqs []bucket.LeaseRequest, member string) ([]bucket.LeaseDecision, error) {
	ds := make([]bucket.LeaseDecision, len(reqs))
	errs := make([]error, len(reqs))
	for i, r := range reqs {
		if strings.HasSuffix(r.Key, ":down") {
			errs[i] = errors.New("connection refused")
		} else {
			ds[i] = bucket.LeaseDecision{Limit: r.Limit.Limit, InFlight: r.Limit.Limit, RetryAfter: time.Second}
		}
	}
	return ds, &bucket.MultiError{Errs: errs}
}

// A refusal decided by one client's slot refuses the Acquire even when
// another client's slot failed: the fallback never admits what the store
// refused.
func TestAcquirePartlyDecidedRefuses(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte("rules:\n  - {id: u, algorithm: concurrency, limit: 1, key_by: user, match: {path: /x}}\n  - {id: k, algorithm: concurrency, limit: 1, key_by: api_key, match: {path: /x}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Store: partStore{newFaultStore()}, Region: "local", Logger: quietLogger()}, set, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ok, l, c, err := acquireAttrs(t, e, &rules.Attributes{User: "down", APIKey: "full", Path: "/x"})
	if ok || l != nil || err != nil {
		t.Fatalf("acquire = %v, %v, %v; want refused", ok, l, err)
	}
	if e.fallback.Bytes() != 0 || c.Leases()[1].Decision.Allowed {
		t.Fatalf("the fallback took a lease (%d bytes), or k reported allowed", e.fallback.Bytes())
	}
}
