package limiterd

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// loadResult is what a load loop saw.
type loadResult struct {
	mu        sync.Mutex
	latencies []time.Duration
	codes     map[string]map[codes.Code]int
	allowed   map[string]int
}

// load checks the open and closed rules from workers goroutines until stop
// is closed, each check on a fresh key so decisions need the store.
func load(t *testing.T, client limiterv1.LimiterClient, workers int, stop <-chan struct{}) *loadResult {
	r := &loadResult{codes: map[string]map[codes.Code]int{"open": {}, "closed": {}}, allowed: map[string]int{}}
	var wg sync.WaitGroup
	var n atomic.Int64
	for w := range workers {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				rule := []string{"open", "closed"}[i%2]
				key := fmt.Sprintf("w%d-%d", w, n.Add(1))
				start := time.Now()
				resp, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: rule, Key: key})
				lat := time.Since(start)
				r.mu.Lock()
				r.latencies = append(r.latencies, lat)
				r.codes[rule][status.Code(err)]++
				if err == nil && resp.Allowed {
					r.allowed[rule]++
				}
				r.mu.Unlock()
				time.Sleep(time.Millisecond)
			}
		})
	}
	t.Cleanup(wg.Wait)
	return r
}

func (r *loadResult) snapshot() (lat []time.Duration, c map[string]map[codes.Code]int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	c = map[string]map[codes.Code]int{}
	for rule, m := range r.codes {
		c[rule] = map[codes.Code]int{}
		for k, v := range m {
			c[rule][k] = v
		}
	}
	return slices.Clone(r.latencies), c
}

func quantile(l []time.Duration, q float64) time.Duration {
	if len(l) == 0 {
		return 0
	}
	s := slices.Clone(l)
	slices.Sort(s)
	return s[int(float64(len(s)-1)*q)]
}

// TestRedisOutageUnderLoad: with every Redis node stopped under load, each
// check is answered promptly: fail-open rules locally, fail-closed rules
// UNAVAILABLE, nothing else; when Redis returns, decisions come from it
// again within seconds, without a restart.
func TestRedisOutageUnderLoad(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	const timeout = 5 * time.Millisecond
	d := startDaemon(t, c.Addrs(), func(o *Options) { o.RedisTuning.Timeout = timeout })
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	stop := make(chan struct{})
	r := load(t, client, 8, stop)
	time.Sleep(500 * time.Millisecond)
	before, _ := r.snapshot()

	c.StopAll()
	time.Sleep(3 * time.Second)
	during, codesDuring := r.snapshot()
	outage := during[len(before):]

	c.StartAll()
	c.WaitHealthy(t)
	recovered := time.Now()
	for {
		if _, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "closed", Key: fmt.Sprint("probe-", time.Now().UnixNano())}); err == nil {
			break
		}
		if time.Since(recovered) > 10*time.Second {
			t.Fatal("fail-closed checks still refused 10s after Redis came back")
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("store decisions again %v after the cluster was healthy", time.Since(recovered).Round(time.Millisecond))
	close(stop)

	p99, worst := quantile(outage, 0.99), quantile(outage, 1)
	t.Logf("during the outage: %d checks, p50 %v, p99 %v, max %v (store timeout %v); codes %v",
		len(outage), quantile(outage, 0.5), p99, worst, timeout, codesDuring)
	// The bound is timeout + 2ms; the test allows more for the race
	// detector and a shared machine, and fails on a hang.
	if worst > timeout+100*time.Millisecond {
		t.Errorf("slowest check during the outage took %v, store timeout %v", worst, timeout)
	}
	for rule, want := range map[string]codes.Code{"open": codes.OK, "closed": codes.Unavailable} {
		for code, n := range codesDuring[rule] {
			if code != want && code != codes.OK {
				t.Errorf("%s rule: %d checks answered %v", rule, n, code)
			}
		}
		if codesDuring[rule][want] == 0 {
			t.Errorf("%s rule: no check answered %v", rule, want)
		}
	}
	body := scrape(t, d)
	for _, want := range []string{`limiter_decisions_total{result="fallback_allowed",rule="open"}`, `limiter_store_breaker_transitions_total{state="open"}`} {
		if !containsNonZero(body, want) {
			t.Errorf("metrics: %s is zero or missing", want)
		}
	}
}

// TestFailoverUnderLoad: in a cluster with a replica per primary, killing a
// primary under load causes no errors beyond fail-closed refusals while the
// replica takes over; fail-open rules keep answering throughout.
func TestFailoverUnderLoad(t *testing.T) {
	c := redistest.NewCluster(t, 3, 1)
	d := startDaemon(t, c.Addrs(), func(o *Options) { o.RedisTuning.Timeout = 50 * time.Millisecond })
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	stop := make(chan struct{})
	r := load(t, client, 8, stop)
	time.Sleep(500 * time.Millisecond)
	victim := c.PrimaryAddrs()[0]
	for _, n := range c.Nodes() {
		if n.Addr() == victim {
			n.Stop()
		}
	}
	c.WaitHealthy(t)
	// Give limiterd a moment to see the new primary, then require clean
	// store decisions for both rules.
	deadline := time.Now().Add(15 * time.Second)
	for {
		ok := true
		for i := range 30 {
			if _, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "closed", Key: fmt.Sprint("after-", i)}); err != nil {
				ok = false
			}
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("fail-closed checks still refused 15s after the failover")
		}
		time.Sleep(100 * time.Millisecond)
	}
	close(stop)
	_, got := r.snapshot()
	t.Logf("codes through the failover: %v", got)
	for code, n := range got["open"] {
		if code != codes.OK {
			t.Errorf("fail-open rule: %d checks answered %v", n, code)
		}
	}
	for code, n := range got["closed"] {
		if code != codes.OK && code != codes.Unavailable {
			t.Errorf("fail-closed rule: %d checks answered %v", n, code)
		}
	}
}

// TestPausedNodeUnderLoad: a Redis primary under CLIENT PAUSE (a stalled
// node: it takes connections and answers nothing) is a store failure, as
// a stopped one is: under load, fail-open rules keep answering (the
// fallback decides the paused node's keys), fail-closed rules answer
// UNAVAILABLE, and no check is answered RESOURCE_EXHAUSTED, which would
// blame limiterd's own queue for the node's silence.
func TestPausedNodeUnderLoad(t *testing.T) {
	c := redistest.NewCluster(t, 3, 0)
	d := startDaemon(t, c.Addrs(), func(o *Options) { o.RedisTuning.Timeout = 50 * time.Millisecond })
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	stop := make(chan struct{})
	r := load(t, client, 8, stop)
	time.Sleep(500 * time.Millisecond)
	_, before := r.snapshot()

	p := redis.NewClient(&redis.Options{Addr: c.PrimaryAddrs()[0]})
	defer p.Close()
	if err := p.Do(context.Background(), "CLIENT", "PAUSE", 3000, "WRITE").Err(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3500 * time.Millisecond)
	close(stop)
	_, after := r.snapshot()
	during := map[string]map[codes.Code]int{}
	for rule, m := range after {
		during[rule] = map[codes.Code]int{}
		for code, n := range m {
			if n -= before[rule][code]; n > 0 {
				during[rule][code] = n
			}
		}
	}
	t.Logf("codes during the pause: %v", during)
	for rule, want := range map[string]codes.Code{"open": codes.OK, "closed": codes.Unavailable} {
		for code, n := range during[rule] {
			if code != want && code != codes.OK {
				t.Errorf("%s rule: %d checks answered %v", rule, n, code)
			}
		}
	}
	if during["closed"][codes.Unavailable] == 0 {
		t.Error("closed rule: no check answered UNAVAILABLE: the pause was not felt")
	}
	if body := scrape(t, d); !containsNonZero(body, `limiter_decisions_total{result="fallback_allowed",rule="open"}`) {
		t.Error("metrics: no fallback decision of the open rule during the pause")
	}
}
