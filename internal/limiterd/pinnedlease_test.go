package limiterd

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/redisstore"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// pinnedLeaseRules home the key "hot" (and the user hot) in region b.
const pinnedLeaseRules = `rules:
  - id: global
    algorithm: concurrency
    limit: 10
    lease_ttl: 30s
    home: pinned
    home_keys: {hot: b}
    on_failure: closed
  - id: global-open
    algorithm: concurrency
    limit: 9
    lease_ttl: 30s
    home: pinned
    home_keys: {hot: b}
    on_failure: open
  - id: short
    algorithm: concurrency
    limit: 5
    lease_ttl: 2s
    home: pinned
    home_keys: {hot: b}
    on_failure: closed
  - id: mixed-global
    algorithm: concurrency
    limit: 2
    lease_ttl: 30s
    home: pinned
    home_keys: {"user:hot": b}
    key_by: user
    on_failure: closed
    match: {path: /mixed/**}
  - id: mixed-local
    algorithm: concurrency
    limit: 5
    lease_ttl: 30s
    key_by: user
    on_failure: closed
    match: {path: /mixed/**}
  - id: mixed-rate
    capacity: 3
    refill_per_second: 0.0001
    reconcile: false
    key_by: user
    on_failure: closed
    match: {path: /mixed/**}
`

// newLeaseRegions starts regions a, b and c on one topology (generation 1),
// each on its own Redis Cluster, with pinnedLeaseRules.
func newLeaseRegions(t *testing.T) *topoStack {
	t.Helper()
	return newRegionStack(t, time.Second, pinnedLeaseRules, func(addrs map[string]string) map[string]string {
		f := topoYAML(1, time.Time{}, addrs, "a", "b", "c")
		return map[string]string{"a": f, "b": f, "c": f}
	})
}

// held is the leases of rule and key in region's Redis.
func (s *topoStack) held(region, rule, key string) int64 {
	s.t.Helper()
	n, err := s.regions[region].redis.ZCard(context.Background(), redisstore.LeaseKey(rule, key)).Result()
	if err != nil {
		s.t.Fatal(err)
	}
	return n
}

// TestPinnedConcurrencyAcrossRegions: callers in all three regions hold
// leases of one pinned key (home b) under a limit of 10, half of them
// releasing through another region than the one they acquired in: at no
// instant more than 10 held across the regions, every release finds its
// lease, and nothing is left held.
func TestPinnedConcurrencyAcrossRegions(t *testing.T) {
	s := newLeaseRegions(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	names := []string{"a", "b", "c"}
	const perRegion, rounds = 8, 12
	var mu sync.Mutex
	var all []interval
	refused, crossed := 0, 0
	var wg sync.WaitGroup
	errs := make(chan error, perRegion*len(names))
	for ri, n := range names {
		for w := range perRegion {
			acq := s.regions[n].client
			rel := acq
			if w%2 == 1 {
				rel = s.regions[names[(ri+1)%len(names)]].client
			}
			wg.Go(func() {
				ivs, r, err := holdLeasesVia(ctx, acq, rel, "global", "hot", rounds)
				mu.Lock()
				defer mu.Unlock()
				all = append(all, ivs...)
				refused += r
				if w%2 == 1 {
					crossed += len(ivs)
				}
				if err != nil {
					errs <- err
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if want := len(names) * perRegion * rounds; len(all) != want {
		t.Fatalf("%d leases held, want %d", len(all), want)
	}
	most := maxOverlap(all)
	if most > 10 {
		t.Fatalf("%d leases held at one instant across the regions, limit 10", most)
	}
	if most < 5 {
		t.Errorf("at most %d leases held at once: the callers did not contend", most)
	}
	for _, n := range names {
		if got := s.held(n, "global", "hot"); got != 0 {
			t.Errorf("%s's Redis holds %d leases after every release", n, got)
		}
	}
	for _, n := range []string{"a", "c"} {
		if v := metricValue(t, s.regions[n].d, "limiter_forwarded_lease_calls_total", map[string]string{"rule": "global", "call": "acquire", "result": "allowed"}); v == 0 {
			t.Errorf("%s: no forwarded acquire counted allowed", n)
		}
	}
	t.Logf("%d leases through 3 regions (%d released through another region), %d acquires refused; at most %d held at once (limit 10)",
		len(all), crossed, refused, most)
}

// holdLeasesVia is holdLeases acquiring through acq and releasing through
// rel.
func holdLeasesVia(ctx context.Context, acq, rel limiterv1.LimiterClient, rule, key string, rounds int) ([]interval, int, error) {
	var out []interval
	refused := 0
	for len(out) < rounds {
		resp, err := acq.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: rule, Key: key})
		if err != nil {
			return out, refused, err
		}
		if !resp.GetAllowed() {
			refused++
			time.Sleep(time.Duration(1+refused%10) * time.Millisecond)
			continue
		}
		from := time.Now().UnixNano()
		time.Sleep(time.Duration(2+len(out)%8) * time.Millisecond)
		to := time.Now().UnixNano()
		r, err := rel.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: resp.GetLeaseId()})
		if err != nil {
			return out, refused, err
		}
		if !r.GetReleased() {
			return out, refused, fmt.Errorf("lease %d not held at its release", len(out))
		}
		out = append(out, interval{from, to})
	}
	return out, refused, nil
}

// forgeRegion edits a lease id's first part to say it is held in region.
// The version 2 layout: version, region, generation, nonce, parts (each:
// held region, flags, rule, key).
func forgeRegion(t *testing.T, id, region string) string {
	t.Helper()
	b, err := base64.RawURLEncoding.DecodeString(id)
	if err != nil || b[0] != 2 {
		t.Fatalf("lease id %q: %v", id, err)
	}
	off := 2 + int(b[1])
	_, n := binary.Uvarint(b[off:])
	off += n + 16 + 1 // generation, nonce, number of parts
	held := int(b[off])
	out := append([]byte{}, b[:off]...)
	out = append(out, byte(len(region)))
	out = append(out, region...)
	out = append(out, b[off+1+held:]...)
	return base64.RawURLEncoding.EncodeToString(out)
}

// TestPinnedLeasesThroughAnyRegion: a pinned lease is held at the key's
// home whatever region took it, and released or renewed through any region;
// an Acquire that also holds a local lease and spends a rate rule is all
// or nothing across the regions; a forged lease id naming another region
// is refused as invalid and releases nothing.
func TestPinnedLeasesThroughAnyRegion(t *testing.T) {
	s := newLeaseRegions(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a, b, c := s.regions["a"].client, s.regions["b"].client, s.regions["c"].client

	t.Run("forged region", func(t *testing.T) {
		resp, err := a.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: "global", Key: "hot"})
		if err != nil || !resp.GetAllowed() {
			t.Fatalf("Acquire = %v, %v", resp, err)
		}
		if got := s.held("b", "global", "hot"); got != 1 {
			t.Fatalf("home b holds %d leases, want 1", got)
		}
		if got := s.held("a", "global", "hot") + s.held("c", "global", "hot"); got != 0 {
			t.Fatalf("a and c hold %d leases of a key homed in b", got)
		}
		for _, forged := range []string{"a", "c"} {
			id := forgeRegion(t, resp.GetLeaseId(), forged)
			for _, via := range []string{"a", "b", "c"} {
				_, err := s.regions[via].client.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: id})
				if status.Code(err) != codes.InvalidArgument {
					t.Errorf("Release through %s of an id edited to say %s: %v, want InvalidArgument", via, forged, err)
				}
				_, err = s.regions[via].client.Renew(ctx, &limiterv1.RenewRequest{LeaseId: id})
				if status.Code(err) != codes.InvalidArgument {
					t.Errorf("Renew through %s of an id edited to say %s: %v, want InvalidArgument", via, forged, err)
				}
			}
		}
		_, err = a.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: forgeRegion(t, resp.GetLeaseId(), "mars")})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("Release of an id naming a region outside the topology: %v, want InvalidArgument", err)
		}
		if got := s.held("b", "global", "hot"); got != 1 {
			t.Fatalf("after the forgeries home b holds %d leases, want 1", got)
		}
		r, err := c.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: resp.GetLeaseId()})
		if err != nil || !r.GetReleased() {
			t.Fatalf("Release through c of a lease taken through a: %v, %v", r, err)
		}
		if got := s.held("b", "global", "hot"); got != 0 {
			t.Fatalf("after its release home b holds %d leases", got)
		}
		r, err = b.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: resp.GetLeaseId()})
		if err != nil || r.GetReleased() {
			t.Fatalf("a second Release through b: %v, %v; want released false", r, err)
		}
	})

	t.Run("renew through a non-home region", func(t *testing.T) {
		resp, err := a.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: "short", Key: "hot"})
		if err != nil || !resp.GetAllowed() {
			t.Fatalf("Acquire = %v, %v", resp, err)
		}
		score := func() float64 {
			zs, err := s.regions["b"].redis.ZRangeWithScores(ctx, redisstore.LeaseKey("short", "hot"), 0, -1).Result()
			if err != nil || len(zs) != 1 {
				t.Fatalf("home b's leases of short: %v, %v", zs, err)
			}
			return zs[0].Score
		}
		first := score()
		time.Sleep(time.Second)
		rn, err := c.Renew(ctx, &limiterv1.RenewRequest{LeaseId: resp.GetLeaseId()})
		if err != nil || !rn.GetRenewed() || rn.GetLeaseTtlMs() != 2000 {
			t.Fatalf("Renew through c = %v, %v", rn, err)
		}
		if rn.GetExpiresAtUnixMs() <= resp.GetExpiresAtUnixMs() {
			t.Errorf("renewed expiry %d not after the first %d", rn.GetExpiresAtUnixMs(), resp.GetExpiresAtUnixMs())
		}
		if moved := (score() - first) / 1e6; moved < 0.8 {
			t.Errorf("the home's expiry moved by %.3fs after a renewal 1s in, want about 1s", moved)
		}
		time.Sleep(1500 * time.Millisecond) // past the first expiry
		r, err := a.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: resp.GetLeaseId()})
		if err != nil || !r.GetReleased() {
			t.Fatalf("Release after the first expiry of a lease renewed through c: %v, %v; want released", r, err)
		}
	})

	t.Run("all or nothing across regions", func(t *testing.T) {
		acquire := func(via limiterv1.LimiterClient) *limiterv1.AcquireResponse {
			t.Helper()
			resp, err := via.Acquire(ctx, &limiterv1.AcquireRequest{Attributes: &limiterv1.Attributes{User: "hot", Path: "/mixed/x"}})
			if err != nil {
				t.Fatal(err)
			}
			return resp
		}
		expect := func(step string, home, local int64) {
			t.Helper()
			if got := s.held("b", "mixed-global", "user:hot"); got != home {
				t.Errorf("%s: home b holds %d pinned leases, want %d", step, got, home)
			}
			if got := s.held("a", "mixed-local", "user:hot"); got != local {
				t.Errorf("%s: a holds %d local leases, want %d", step, got, local)
			}
		}
		first, second := acquire(a), acquire(a)
		if !first.GetAllowed() || !second.GetAllowed() {
			t.Fatalf("the first two acquires: %v, %v", first, second)
		}
		expect("two held", 2, 2)
		if third := acquire(a); third.GetAllowed() || third.GetRuleId() != "mixed-global" {
			t.Fatalf("a third acquire over the pinned limit of 2: %v, want refused by mixed-global", third)
		}
		expect("the home refused", 2, 2)
		if r, err := c.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: first.GetLeaseId()}); err != nil || !r.GetReleased() {
			t.Fatalf("Release through c of a lease held in b and a: %v, %v", r, err)
		}
		expect("one released through c", 1, 1)
		fourth := acquire(a) // the rate rule's third and last token
		if !fourth.GetAllowed() {
			t.Fatalf("a fourth acquire after a release: %v", fourth)
		}
		if r, err := b.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: second.GetLeaseId()}); err != nil || !r.GetReleased() {
			t.Fatalf("Release through b: %v, %v", r, err)
		}
		expect("one released through b", 1, 1)
		if fifth := acquire(a); fifth.GetAllowed() || fifth.GetRuleId() != "mixed-rate" {
			t.Fatalf("an acquire past the rate rule's capacity: %v, want refused by mixed-rate", fifth)
		}
		expect("the rate rule refused after the home granted", 1, 1)
		if v := metricValue(t, s.regions["a"].d, "limiter_forwarded_lease_calls_total", map[string]string{"rule": "mixed-global", "call": "release", "result": "released"}); v != 1 {
			t.Errorf("a: forwarded releases of mixed-global given back = %v, want 1 (the fifth acquire's)", v)
		}
	})
}

// TestPinnedConcurrencyHomeDown: with the key's home region down, a
// fail-closed pinned rule refuses (UNAVAILABLE), a fail-open one holds
// leases in the region of the acquire with its share (9 / 3 regions = 3);
// a Release of a lease held at the home is UNAVAILABLE (the lease expires
// there on its own), and a fallback lease is released through another
// region.
func TestPinnedConcurrencyHomeDown(t *testing.T) {
	s := newLeaseRegions(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a, c := s.regions["a"].client, s.regions["c"].client
	atHome, err := a.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: "global", Key: "hot"})
	if err != nil || !atHome.GetAllowed() {
		t.Fatalf("Acquire before the home went down: %v, %v", atHome, err)
	}
	if err := s.regions["b"].d.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	_, err = a.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: "global", Key: "hot"})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("Acquire of a fail-closed pinned rule with its home down: %v, want Unavailable", err)
	}
	var fallback []string
	for _, via := range []string{"a", "c"} {
		for i := range 4 {
			resp, err := s.regions[via].client.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: "global-open", Key: "hot"})
			if err != nil {
				t.Fatalf("Acquire %d of a fail-open pinned rule through %s: %v", i, via, err)
			}
			if resp.GetAllowed() != (i < 3) {
				t.Fatalf("Acquire %d through %s: allowed %v; want the region's share of 3", i, via, resp.GetAllowed())
			}
			if resp.GetAllowed() {
				fallback = append(fallback, resp.GetLeaseId())
			}
		}
		if got := s.held(via, "global-open", "hot"); got != 3 {
			t.Errorf("%s's Redis holds %d fallback leases, want 3", via, got)
		}
	}
	if v := metricValue(t, s.regions["a"].d, "limiter_forwarded_lease_calls_total", map[string]string{"rule": "global-open", "call": "acquire", "result": "error"}); v != 4 {
		t.Errorf("a: forwarded acquires without an answer = %v, want 4", v)
	}

	_, err = c.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: atHome.GetLeaseId()})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("Release of a lease held at the home that is down: %v, want Unavailable", err)
	}
	_, err = a.Renew(ctx, &limiterv1.RenewRequest{LeaseId: atHome.GetLeaseId()})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("Renew of a lease held at the home that is down: %v, want Unavailable", err)
	}
	// a's first fallback lease, released through c.
	r, err := c.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: fallback[0]})
	if err != nil || !r.GetReleased() {
		t.Fatalf("Release through c of a fallback lease held in a: %v, %v", r, err)
	}
	if got := s.held("a", "global-open", "hot"); got != 2 {
		t.Errorf("a holds %d fallback leases after one release, want 2", got)
	}
}

// TestPinnedLeaseTopologySwitch: region c joins (generation 2) and a key
// moves to it. The leases taken at its old home stay there until released
// (through any region) or expired, and are not renewed; new leases are
// taken at the new home, so for up to one lease_ttl after the switch the
// key can hold 2 × limit in flight, 10 at each home.
func TestPinnedLeaseTopologySwitch(t *testing.T) {
	const poll = 200 * time.Millisecond
	s := newRegionStack(t, poll, pinnedLeaseRules, func(addrs map[string]string) map[string]string {
		return map[string]string{
			"a": topoYAML(1, time.Time{}, addrs, "a", "b"),
			"b": topoYAML(1, time.Time{}, addrs, "a", "b"),
			"c": topoYAML(2, time.Time{}, addrs, "a", "b", "c"),
		}
	})
	gen1 := mustParse(t, topoYAML(1, time.Time{}, s.addrs, "a", "b"))
	gen2 := mustParse(t, topoYAML(2, time.Time{}, s.addrs, "a", "b", "c"))
	key := ""
	for i := 0; key == ""; i++ {
		if k := fmt.Sprintf("user-%d", i); gen2.Home(k, nil) == "c" {
			key = k
		}
	}
	old := gen1.Home(key, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a, b := s.regions["a"].client, s.regions["b"].client
	acquireAll := func(step string) []string {
		t.Helper()
		var ids []string
		for i := range 11 {
			resp, err := a.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: "global", Key: key})
			if err != nil {
				t.Fatalf("%s: Acquire %d: %v", step, i, err)
			}
			if resp.GetAllowed() != (i < 10) {
				t.Fatalf("%s: Acquire %d allowed %v, want the limit of 10", step, i, resp.GetAllowed())
			}
			if resp.GetAllowed() {
				ids = append(ids, resp.GetLeaseId())
			}
		}
		return ids
	}
	before := acquireAll("generation 1")
	if got := s.held(old, "global", key); got != 10 {
		t.Fatalf("the old home %s holds %d leases, want 10", old, got)
	}
	for _, n := range []string{"a", "b"} {
		replaceFile(t, s.regions[n].file, topoYAML(2, time.Time{}, s.addrs, "a", "b", "c"))
	}
	for _, n := range []string{"a", "b"} {
		waitGauge(t, s.regions[n].d, "limiter_topology_generation", map[string]string{"state": "active"}, 2, 5*poll+time.Second)
	}
	after := acquireAll("generation 2")
	if got := s.held("c", "global", key); got != 10 {
		t.Fatalf("the new home c holds %d leases, want 10", got)
	}
	if got := s.held(old, "global", key); got != 10 {
		t.Fatalf("the old home %s holds %d leases after the switch, want its 10 kept", old, got)
	}
	// An old lease released through b, wherever it is held.
	if r, err := b.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: before[0]}); err != nil || !r.GetReleased() {
		t.Fatalf("Release of a lease held at the old home: %v, %v", r, err)
	}
	// An old lease is not renewed: the caller acquires again, at c.
	if rn, err := a.Renew(ctx, &limiterv1.RenewRequest{LeaseId: before[1]}); err != nil || rn.GetRenewed() {
		t.Fatalf("Renew of a lease whose key moved: %v, %v; want renewed false", rn, err)
	}
	if got := s.held(old, "global", key); got != 8 {
		t.Errorf("the old home %s holds %d leases after a release and a refused renewal, want 8", old, got)
	}
	// A new lease renews.
	if rn, err := b.Renew(ctx, &limiterv1.RenewRequest{LeaseId: after[0]}); err != nil || !rn.GetRenewed() {
		t.Fatalf("Renew through b of a lease held at the new home: %v, %v", rn, err)
	}
	t.Logf("key %s moved from %s to c: 10 leases kept at %s, 10 new ones at c", key, old, old)
}
