package limiterd

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/frontdoor/forwardauth"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/bucket"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

const concurrencyRules = `rules:
  - id: reports
    algorithm: concurrency
    limit: 10
    lease_ttl: 30s
    on_failure: closed
    key_by: user
    match: {path: /reports/**}
  - id: short
    algorithm: concurrency
    limit: 3
    lease_ttl: 2s
    on_failure: closed
  - id: per-ip
    capacity: 2
    refill_per_second: 0.001
    key_by: ip
    match: {path: /reports/**}
`

// interval is one caller's hold of a lease: from the moment Acquire
// answered to the moment Release was sent. The store held the lease for at
// least that long, so the overlap of intervals is at most the store's.
type interval struct{ from, to int64 } // Unix ns

// maxOverlap is the most intervals that overlap at one instant.
func maxOverlap(ivs []interval) int {
	type ev struct {
		at    int64
		delta int
	}
	var evs []ev
	for _, iv := range ivs {
		evs = append(evs, ev{iv.from, 1}, ev{iv.to, -1})
	}
	// At one instant, an end before a start: the intervals are closed at
	// their start and open at their end.
	slices.SortFunc(evs, func(a, b ev) int {
		if a.at != b.at {
			return int(a.at - b.at)
		}
		return a.delta - b.delta
	})
	n, most := 0, 0
	for _, e := range evs {
		n += e.delta
		most = max(most, n)
	}
	return most
}

// holdLeases acquires rule's lease for key rounds times, holding each a few
// ms and releasing it; a refused caller retries after a short random wait.
func holdLeases(ctx context.Context, c limiterv1.LimiterClient, rule, key string, rounds int) ([]interval, int, error) {
	var out []interval
	refused := 0
	for len(out) < rounds {
		resp, err := c.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: rule, Key: key})
		if err != nil {
			return out, refused, err
		}
		if !resp.GetAllowed() {
			refused++
			time.Sleep(time.Duration(1+rand.IntN(10)) * time.Millisecond)
			continue
		}
		from := time.Now().UnixNano()
		time.Sleep(time.Duration(2+rand.IntN(8)) * time.Millisecond)
		to := time.Now().UnixNano()
		r, err := c.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: resp.GetLeaseId()})
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

func startConcurrency(t *testing.T, addrs []string) *Daemon {
	rules := writeRules(t, concurrencyRules)
	return startDaemon(t, addrs, func(o *Options) { o.Rules.File = rules })
}

func leaseEvents(t *testing.T, d *Daemon, event string) float64 {
	t.Helper()
	sum := 0.0
	for _, mf := range mustGather(t, d) {
		if mf.GetName() != "limiter_concurrency_leases_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "event" && l.GetValue() == event {
					sum += m.GetCounter().GetValue()
				}
			}
		}
	}
	return sum
}

// TestConcurrencyRace: 50 callers hold leases of one key under a limit of
// 10, through two limiterd on a 3-primary Redis Cluster: at no instant
// more than 10 held, and every caller served.
func TestConcurrencyRace(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	ds := []*Daemon{startConcurrency(t, c.Addrs()), startConcurrency(t, c.Addrs())}
	clients := []limiterv1.LimiterClient{limiterv1.NewLimiterClient(dial(t, ds[0].GRPCAddr())), limiterv1.NewLimiterClient(dial(t, ds[1].GRPCAddr()))}
	const callers, rounds = 50, 5
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var mu sync.Mutex
	var all []interval
	refused := 0
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() {
			ivs, r, err := holdLeases(ctx, clients[i%2], "reports", "user:race", rounds)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				t.Errorf("caller %d: %v", i, err)
			}
			all, refused = append(all, ivs...), refused+r
		})
	}
	wg.Wait()
	most := maxOverlap(all)
	t.Logf("%d callers, %d holds, %d refusals, at most %d held at once", callers, len(all), refused, most)
	if len(all) != callers*rounds || most > 10 || refused == 0 {
		t.Fatalf("%d holds of %d; at most %d held at once (limit 10); %d refusals", len(all), callers*rounds, most, refused)
	}
	if most < 10 {
		t.Logf("the callers never filled the limit (at most %d)", most)
	}
	if fb := leaseEvents(t, ds[0], "fallback_acquired") + leaseEvents(t, ds[1], "fallback_acquired"); fb != 0 {
		t.Fatalf("%v leases from the fallback: the store failed", fb)
	}
}

// TestConcurrencyRaceProcesses: the same with the callers in 5 separate
// processes of 10 callers each.
func TestConcurrencyRaceProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	c := redistest.NewCluster(t, 3, 0)
	ds := []*Daemon{startConcurrency(t, c.Addrs()), startConcurrency(t, c.Addrs())}
	const procs, callers, rounds = 5, 10, 5
	outs := make([]*bufio.Reader, procs)
	for i := range outs {
		_, outs[i] = helper(t, "leases", "LIMITERD_ADDR="+ds[i%2].GRPCAddr(), "LIMITERD_KEY=user:procs",
			"LIMITERD_CALLERS="+strconv.Itoa(callers), "LIMITERD_ROUNDS="+strconv.Itoa(rounds))
	}
	var all []interval
	for i, out := range outs {
		for {
			line, err := out.ReadString('\n')
			if err != nil {
				t.Fatalf("process %d: %v", i, err)
			}
			f := strings.Fields(line)
			if len(f) == 1 && f[0] == "done" {
				break
			}
			if len(f) != 3 || f[0] != "hold" {
				t.Fatalf("process %d: %q", i, line)
			}
			from, _ := strconv.ParseInt(f[1], 10, 64)
			to, _ := strconv.ParseInt(f[2], 10, 64)
			all = append(all, interval{from, to})
		}
	}
	most := maxOverlap(all)
	t.Logf("%d processes of %d callers, %d holds, at most %d held at once", procs, callers, len(all), most)
	if len(all) != procs*callers*rounds || most > 10 {
		t.Fatalf("%d holds of %d; at most %d held at once (limit 10)", len(all), procs*callers*rounds, most)
	}
}

// leaseHelper is TestHelperProcess's "leases" and "hold" kinds.
func leaseHelper(kind string) {
	client := limiterv1.NewLimiterClient(dialAddr(os.Getenv("LIMITERD_ADDR")))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	switch kind {
	case "leases":
		callers, _ := strconv.Atoi(os.Getenv("LIMITERD_CALLERS"))
		rounds, _ := strconv.Atoi(os.Getenv("LIMITERD_ROUNDS"))
		var mu sync.Mutex
		var wg sync.WaitGroup
		for range callers {
			wg.Go(func() {
				ivs, _, err := holdLeases(ctx, client, "reports", os.Getenv("LIMITERD_KEY"), rounds)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					fmt.Println("error:", strings.ReplaceAll(err.Error(), "\n", " "))
				}
				for _, iv := range ivs {
					fmt.Println("hold", iv.from, iv.to)
				}
			})
		}
		wg.Wait()
		fmt.Println("done")
	case "hold":
		// Take every slot of "short" and never release: wait to be killed.
		var expires []string
		for range 3 {
			resp, err := client.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: "short", Key: os.Getenv("LIMITERD_KEY")})
			if err != nil || !resp.GetAllowed() {
				fmt.Println("error:", err, resp.GetAllowed())
				os.Exit(0)
			}
			expires = append(expires, strconv.FormatInt(resp.GetExpiresAtUnixMs(), 10))
		}
		fmt.Println("held", strings.Join(expires, " "))
		<-ctx.Done()
	}
	os.Exit(0)
}

// TestKilledCallerSlotsComeBack: a caller process that holds every slot of
// a rule with 2 s leases is killed (SIGKILL): its slots stay taken until
// the leases expire, and come back then.
func TestKilledCallerSlotsComeBack(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	d := startConcurrency(t, c.Addrs())
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnv+"=hold", "LIMITERD_ADDR="+d.GRPCAddr(), "LIMITERD_KEY=killed")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	f := strings.Fields(line)
	if err != nil || len(f) != 4 || f[0] != "held" {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("helper: %q, %v", line, err)
	}
	first, _ := strconv.ParseInt(f[1], 10, 64)
	expiry := time.UnixMilli(first)
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	killed := time.Now()
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	ctx := context.Background()
	var lastRefused, back time.Time
	for time.Since(killed) < 10*time.Second {
		resp, err := client.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: "short", Key: "killed"})
		if err != nil {
			t.Fatal(err)
		}
		now := time.Now()
		if resp.GetAllowed() {
			back = now
			break
		}
		if ra := time.Duration(resp.GetRetryAfterMs()) * time.Millisecond; ra <= 0 || ra > 2*time.Second {
			t.Fatalf("retry_after %v, want in (0, 2s]", ra)
		}
		lastRefused = now
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("killed %v before the first lease's expiry; last refused %v before it; a slot back %v after it",
		expiry.Sub(killed).Round(time.Millisecond), expiry.Sub(lastRefused).Round(time.Millisecond), back.Sub(expiry).Round(time.Millisecond))
	if back.IsZero() {
		t.Fatal("the killed caller's slots never came back")
	}
	// Not before: refused until (about) the expiry, the Redis clock and
	// this one being the same machine's, to within a few ms.
	if lastRefused.IsZero() || expiry.Sub(lastRefused) > 100*time.Millisecond {
		t.Fatalf("the slots came back %v before the leases' expiry", expiry.Sub(back))
	}
	if back.Before(expiry.Add(-10*time.Millisecond)) || back.After(expiry.Add(time.Second)) {
		t.Fatalf("a slot came back %v after the expiry, want within [0, 1s]", back.Sub(expiry))
	}
}

// TestAcquireMixedAttributes: an Acquire by attributes holds the
// concurrency rule (key user, one slot) and spends the rate rule (key ip,
// another slot), all or nothing.
func TestAcquireMixedAttributes(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	d := startConcurrency(t, c.Addrs())
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	ctx := context.Background()
	a := &limiterv1.Attributes{User: "mia", Ip: "198.51.100.7", Path: "/reports/q"}
	acquire := func() *limiterv1.AcquireResponse {
		resp, err := client.Acquire(ctx, &limiterv1.AcquireRequest{Attributes: a})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	r1, r2 := acquire(), acquire()
	if !r1.GetAllowed() || !r2.GetAllowed() || r1.GetLeaseId() == "" || len(r1.GetStatuses()) != 2 {
		t.Fatalf("two acquires: %v / %v", r1, r2)
	}
	// per-ip (2 tokens) refuses the third: no lease is held for it.
	r3 := acquire()
	if r3.GetAllowed() || r3.GetRuleId() != "per-ip" || r3.GetLeaseId() != "" {
		t.Fatalf("third acquire: %v, want refused by per-ip", r3)
	}
	inflight := func() float64 {
		for _, mf := range mustGather(t, d) {
			if mf.GetName() == "limiter_concurrency_leases_in_flight" {
				for _, m := range mf.GetMetric() {
					if m.GetLabel()[0].GetValue() == "reports" {
						return m.GetGauge().GetValue()
					}
				}
			}
		}
		return -1
	}
	if n := inflight(); n != 2 {
		t.Fatalf("in flight after a refusal by the rate rule: %v, want 2", n)
	}
	// Fill the concurrency rule for mia by rule id: 8 more.
	for i := range 8 {
		if resp, err := client.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: "reports", Key: "user:mia"}); err != nil || !resp.GetAllowed() {
			t.Fatalf("acquire %d by rule id: %v, %v", i, resp, err)
		}
	}
	// Now the concurrency rule refuses, and a fresh ip's token is not spent.
	a.Ip = "198.51.100.8"
	if r := acquire(); r.GetAllowed() || r.GetRuleId() != "reports" {
		t.Fatalf("acquire at the concurrency limit: %v", r)
	}
	_, _ = client.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: r1.GetLeaseId()})
	for i := range 2 {
		r := acquire()
		if !r.GetAllowed() {
			t.Fatalf("acquire %d with the new ip: %v: the refusal spent its tokens", i, r)
		}
		_, _ = client.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: r.GetLeaseId()})
	}
}

// TestLeaseValidation: bad lease ids and plain checks of concurrency rules
// are INVALID_ARGUMENT naming the field or the rule; the daemon serves on.
func TestLeaseValidation(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	d := startConcurrency(t, c.Addrs())
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	ctx := context.Background()
	held, err := client.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: "short", Key: "val"})
	if err != nil || !held.GetAllowed() {
		t.Fatal(held, err)
	}
	for _, tt := range []struct{ name, id, want string }{
		{"empty", "", "lease_id"},
		{"malformed", "not a lease", "lease_id"},
		{"truncated", held.GetLeaseId()[:20], "lease_id"},
	} {
		for _, op := range []string{"release", "renew"} {
			var err error
			if op == "release" {
				_, err = client.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: tt.id})
			} else {
				_, err = client.Renew(ctx, &limiterv1.RenewRequest{LeaseId: tt.id})
			}
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("%s of a %s lease id: %v, want INVALID_ARGUMENT naming %s", op, tt.name, err, tt.want)
			}
		}
	}
	for _, ms := range []int64{-1, bucket.MaxSampleDuration.Milliseconds() + 1, math.MaxInt64} {
		_, err := client.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: held.GetLeaseId(), DurationMs: &ms})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "duration_ms") {
			t.Errorf("release reporting %d ms: %v, want INVALID_ARGUMENT naming duration_ms", ms, err)
		}
	}
	_, err = client.Check(ctx, &limiterv1.CheckRequest{RuleId: "short", Key: "val"})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), `"short"`) || !strings.Contains(err.Error(), "Acquire") {
		t.Errorf("Check of a concurrency rule: %v", err)
	}
	_, err = client.Acquire(ctx, &limiterv1.AcquireRequest{RuleId: "per-ip", Key: "val"})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "not a concurrency rule") {
		t.Errorf("Acquire of a rate rule: %v", err)
	}
	// Still serving, and the real lease is still held.
	if r, err := client.Renew(ctx, &limiterv1.RenewRequest{LeaseId: held.GetLeaseId()}); err != nil || !r.GetRenewed() {
		t.Fatalf("renew of the real lease after the bad calls: %v, %v", r, err)
	}
	if r, err := client.Release(ctx, &limiterv1.ReleaseRequest{LeaseId: held.GetLeaseId()}); err != nil || !r.GetReleased() {
		t.Fatalf("release: %v, %v", r, err)
	}
	if r, err := client.Renew(ctx, &limiterv1.RenewRequest{LeaseId: held.GetLeaseId()}); err != nil || r.GetRenewed() {
		t.Fatalf("renew of a released lease: %v, %v; want renewed false", r, err)
	}
}

// TestForwardAuthRefusesConcurrencyRules: the rules load, and the
// forward-auth answer for a request a concurrency rule matches says why it
// cannot be served there.
func TestForwardAuthRefusesConcurrencyRules(t *testing.T) {
	rules := writeRules(t, concurrencyRules)
	d := startDaemon(t, nil, func(o *Options) { o.Rules.File = rules; o.ForwardAuth.Enabled = true })
	req, _ := http.NewRequest("GET", "http://"+d.HTTPAddr()+forwardauth.Path, nil)
	for k, v := range proxyHeaders("ann", "/reports/x", "GET", "203.0.113.1") {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body := make([]byte, 2048)
	n, _ := resp.Body.Read(body)
	if resp.StatusCode != 500 || !strings.Contains(string(body[:n]), "forward-auth cannot enforce concurrency rules") || !strings.Contains(string(body[:n]), `"reports"`) {
		t.Fatalf("forward-auth of a concurrency rule's path: %d %s", resp.StatusCode, body[:n])
	}
}

// dialAddr is dial for a helper process, without a test.
func dialAddr(addr string) *grpc.ClientConn {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(0)
	}
	return cc
}
