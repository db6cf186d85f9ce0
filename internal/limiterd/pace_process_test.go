package limiterd

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// The pacing proof: the rule of testdata/pace.yml, and how long to send.
const (
	paceRate    = 100 // calls per second
	paceBurst   = 2   // the rule's capacity
	paceSending = 12 * time.Second
	// A call the partner receives later than this after it was sent was
	// delivered late: loopback takes well under it on an idle machine.
	lateDelivery = time.Millisecond
)

// pacerBinary builds testdata/pacer once per test binary, without the race
// detector (as limiterdBinary): a pacing process as users run one, whose
// sleeps the race detector's slowdown does not stretch.
func pacerBinary(t *testing.T) string {
	t.Helper()
	return builtBinary(t, "pacer", "./testdata/pacer")
}

// pacerProcess starts a pacing process (testdata/pacer), ended when the
// test ends (by its own pid, with its stdin closed first).
func pacerProcess(t *testing.T, env ...string) (stdin io.WriteCloser, stdout *bufio.Reader) {
	t.Helper()
	cmd := exec.Command(pacerBinary(t))
	cmd.Env = append(os.Environ(), env...)
	return testenv.StartPiped(t, cmd)
}

// paceFigures are the figures of one series of instants (ns), sorted.
type paceFigures struct {
	n                int
	rate             float64 // calls per second, first to last
	worstSecond      int     // most calls in any window [t, t+1s)
	worst10ms        int     // most calls in any window [t, t+10ms)
	worstSecondStart time.Duration
	worst10msStart   time.Duration
}

func figures(ts []int64) paceFigures {
	slices.Sort(ts)
	f := paceFigures{n: len(ts)}
	if len(ts) > 1 {
		f.rate = float64(len(ts)-1) / (float64(ts[len(ts)-1]-ts[0]) / 1e9)
	}
	// The most in a half-open window of width w starting at some call.
	most := func(w int64) (int, int) {
		best, at, j := 0, 0, 0
		for i := range ts {
			for j < len(ts) && ts[j] < ts[i]+w {
				j++
			}
			if j-i > best {
				best, at = j-i, i
			}
		}
		return best, at
	}
	var at int
	f.worstSecond, at = most(int64(time.Second))
	f.worstSecondStart = time.Duration(ts[at] - ts[0])
	f.worst10ms, at = most(int64(10 * time.Millisecond))
	f.worst10msStart = time.Duration(ts[at] - ts[0])
	return f
}

// TestPacerProof is the proof: three separate processes share one
// 100/s pacer (rule partner, burst 2) through a real limiterd process on a
// 3-primary Redis Cluster, toward a fake partner on loopback that records
// when each call arrives. In every 1 s window the partner sees at most 100
// (+1 for a boundary: the burst), the long-run rate of the slots granted
// is within 1% of 100/s (the calls' own at most 1% above it), and no 10 ms
// window holds more than the burst.
func TestPacerProof(t *testing.T) {
	if testing.Short() {
		t.Skip("sends for 12 s from 3 processes")
	}
	c := redistest.NewCluster(t, 3, 0)
	var mu sync.Mutex
	var arrived, delivery []int64
	partner := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		at := time.Now().UnixNano()
		if r.URL.Path == "/warm" {
			return
		}
		sent, _ := strconv.ParseInt(r.URL.Query().Get("sent"), 10, 64)
		mu.Lock()
		arrived = append(arrived, at)
		delivery = append(delivery, at-sent)
		mu.Unlock()
	}))
	t.Cleanup(partner.Close)
	addr, httpAddr := limiterdProcess(t, "--rules.file", "testdata/pace.yml", "--redis.addrs", strings.Join(c.Addrs(), ","))

	key := fmt.Sprintf("acme-%d", time.Now().UnixNano())
	type proc struct {
		in  interface{ Write([]byte) (int, error) }
		out *bufio.Reader
	}
	var procs []proc
	for range 3 {
		in, out := pacerProcess(t, "LIMITERD_ADDR="+addr, "LIMITERD_KEY="+key, "LIMITERD_PARTNER="+partner.URL)
		procs = append(procs, proc{in, out})
	}
	for i, p := range procs {
		if line, _ := p.out.ReadString('\n'); strings.TrimSpace(line) != "ready" {
			t.Fatalf("process %d: %q, want ready", i, line)
		}
	}
	// The fleet has been sending: the burst is spent, so the first second
	// holds no burst on top of the rate (from an idle bucket it would hold
	// paceBurst-1 more: the slots of any 1 s window are at most
	// rate + burst - 1). What the +1 of the bound then allows is one call
	// pushed across a boundary by a late wake-up or delivery.
	cc := dial(t, addr)
	if resp, err := limiterv1.NewLimiterClient(cc).Check(context.Background(), &limiterv1.CheckRequest{RuleId: "partner", Key: key, Cost: paceBurst}); err != nil || !resp.GetAllowed() {
		t.Fatalf("spending the burst: %v, %v", resp, err)
	}
	end := time.Now().Add(paceSending).UnixNano()
	for _, p := range procs {
		fmt.Fprintf(p.in, "go %d\n", end)
	}
	var sent []int64
	missed := 0
	for i, p := range procs {
		for {
			line, err := p.out.ReadString('\n')
			if err != nil {
				t.Fatalf("process %d: %v", i, err)
			}
			line = strings.TrimSpace(line)
			if line == "done" {
				break
			}
			if n, ok := strings.CutPrefix(line, "missed "); ok {
				m, _ := strconv.Atoi(n)
				missed += m
				continue
			}
			if strings.HasPrefix(line, "error:") {
				t.Errorf("process %d: %s", i, line)
				continue
			}
			at, err := strconv.ParseInt(strings.TrimPrefix(line, "sent "), 10, 64)
			if err != nil {
				t.Fatalf("process %d: %q", i, line)
			}
			sent = append(sent, at)
		}
	}
	mu.Lock()
	got := slices.Clone(arrived)
	delays := slices.Clone(delivery)
	mu.Unlock()
	// A call the test's loaded process took long to deliver may join the
	// next at the partner: the pacer's bound is on the calls it sent, and
	// the partner's on those plus the calls delivered late.
	slices.Sort(delays)
	onTime, _ := slices.BinarySearch(delays, int64(lateDelivery)+1)
	late := len(delays) - onTime
	s, a := figures(sent), figures(got)
	t.Logf("sent: %d calls at %.3f/s; worst 1 s window %d (at +%v); largest 10 ms burst %d (at +%v)", s.n, s.rate, s.worstSecond, s.worstSecondStart, s.worst10ms, s.worst10msStart)
	t.Logf("partner: %d calls at %.3f/s; worst 1 s window %d (at +%v); largest 10 ms burst %d (at +%v)", a.n, a.rate, a.worstSecond, a.worstSecondStart, a.worst10ms, a.worst10msStart)
	t.Logf("slots given up, too late to keep within 9 ms: %d", missed)
	if len(delays) > 0 {
		t.Logf("delivery to the partner: p50 %v, p99 %v, max %v; %d calls later than %v", time.Duration(delays[len(delays)/2]), time.Duration(delays[len(delays)*99/100]), time.Duration(delays[len(delays)-1]), late, lateDelivery)
	}
	t.Logf("limiterd: %s", strings.Join(metricLines(t, httpAddr, "limiter_paced_checks_total", "limiter_paced_wait_seconds_count", "limiter_paced_wait_seconds_sum"), "; "))
	if os.Getenv("PACE_DEBUG") != "" {
		slices.Sort(sent)
		for i := 1; i < len(sent); i++ {
			if g := sent[i] - sent[i-1]; g < 5e6 || g > 15e6 {
				t.Logf("gap before call %d at +%v: %v", i, time.Duration(sent[i]-sent[0]), time.Duration(g))
			}
		}
	}
	if a.n != s.n {
		t.Errorf("the partner saw %d calls, the pacers sent %d", a.n, s.n)
	}
	if want := int(paceSending.Seconds()*paceRate) * 9 / 10; a.n < want {
		t.Errorf("the partner saw %d calls in %v, want at least %d: the pacers did not keep the rule busy", a.n, paceSending, want)
	}
	if s.worstSecond > paceRate+1 {
		t.Errorf("a 1 s window of the calls sent holds %d, want at most %d", s.worstSecond, paceRate+1)
	}
	if a.worstSecond > paceRate+1+late {
		t.Errorf("a 1 s window at the partner holds %d calls, want at most %d (+%d delivered late)", a.worstSecond, paceRate+1, late)
	}
	// The rule's rate is the slots it granted: the calls the partner saw
	// and the slots a pacer gave up because its timer woke too late to
	// keep them (a loaded machine). The calls alone may fall a few
	// slots short then, never run above.
	granted := a.rate * float64(a.n+missed) / float64(a.n)
	t.Logf("slots granted: %.3f/s (calls and slots given up)", granted)
	if granted < paceRate*0.99 || granted > paceRate*1.01 {
		t.Errorf("long-run rate of the slots granted %.3f/s, want within 1%% of %d/s", granted, paceRate)
	}
	if a.rate > paceRate*1.01 || a.rate < paceRate*0.95 {
		t.Errorf("long-run rate at the partner %.3f/s, want at most 1%% above %d/s and at most 5%% below", a.rate, paceRate)
	}
	if s.worst10ms > paceBurst {
		t.Errorf("a 10 ms window of the calls sent holds %d, want at most the burst, %d", s.worst10ms, paceBurst)
	}
	if a.worst10ms > paceBurst+late {
		t.Errorf("a 10 ms window at the partner holds %d calls, want at most the burst, %d (+%d delivered late)", a.worst10ms, paceBurst, late)
	}
}
