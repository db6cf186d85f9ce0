package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// sample is what one ghz run measured.
type sample struct {
	// failed says why the run does not count; "" when it does.
	failed string
	count  uint64
	rps    float64
	p99    time.Duration
	// serverUs and redisUs are CPU µs per call (/proc), redisUs summed
	// over the system's Redis servers; NaN without Redis.
	serverUs, redisUs float64
	// clientUs is the load tool's own CPU µs per call (its user and
	// system time): on a machine it shares with the servers, what it
	// spends is not there for them.
	clientUs float64
	// commands are Redis's own time and calls per call, by command
	// (INFO commandstats summed over the nodes).
	commands map[string]cmdCost
}

// cmdCost is one Redis command's usec and calls, per call of the API.
type cmdCost struct{ usec, calls float64 }

// ghzReport is the part of ghz's JSON report (--format json) read here.
type ghzReport struct {
	// cpu is ghz's user and system time, from its process.
	cpu                 time.Duration
	Count               uint64         `json:"count"`
	Rps                 float64        `json:"rps"`
	ErrorDist           map[string]int `json:"errorDistribution"`
	StatusCodeDist      map[string]int `json:"statusCodeDistribution"`
	LatencyDistribution []struct {
		Percentage int           `json:"percentage"`
		Latency    time.Duration `json:"latency"`
	} `json:"latencyDistribution"`
}

// ghz runs ghz against sys for d at concurrency c on one connection, with
// the requests of the run labelled run, and returns its report.
func (e *env) ghz(ctx context.Context, r row, sys *system, dir, run string, c int, d time.Duration) (*ghzReport, error) {
	src, err := os.ReadFile(filepath.Join(e.config, r.api.template))
	if err != nil {
		return nil, err
	}
	data := filepath.Join(dir, "request-"+run+".json")
	if err := os.WriteFile(data, forRun(src, run), 0o600); err != nil {
		return nil, err
	}
	defer os.Remove(data)
	out := filepath.Join(dir, fmt.Sprintf("ghz-%s.json", run))
	args := []string{"--insecure", "--protoset", e.protoset, "--call", r.api.method,
		"--data-file", data,
		"-c", strconv.Itoa(c), "--connections", "1", "-z", d.String(),
		// The calls in flight at the end complete and count: "close" (the
		// default) cuts them with UNAVAILABLE.
		"--duration-stop", "wait",
		"--format", "json", "--output", out, sys.grpc}
	ctx, cancel := context.WithTimeout(ctx, d+time.Minute)
	defer cancel()
	bin := e.ghzBin
	if e.pin {
		bin, args = "taskset", append([]string{"-c", "0", e.ghzBin}, args...)
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	if b, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("ghz: %w\n%s", err, b)
	}
	cpu := cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	b, err := os.ReadFile(out)
	if err != nil {
		return nil, err
	}
	defer os.Remove(out)
	var rep ghzReport
	if err := json.Unmarshal(b, &rep); err != nil {
		return nil, fmt.Errorf("ghz report: %w", err)
	}
	rep.cpu = cpu
	return &rep, nil
}

// notOK describes the calls of rep that were not OK; "" when all were.
func (rep *ghzReport) notOK() string {
	if rep.Count == 0 {
		return "ghz made no calls"
	}
	if ok := rep.StatusCodeDist["OK"]; uint64(ok) == rep.Count && len(rep.StatusCodeDist) == 1 {
		return ""
	}
	var codes []string
	for _, k := range slices.Sorted(maps.Keys(rep.StatusCodeDist)) {
		codes = append(codes, fmt.Sprintf("%s %d", k, rep.StatusCodeDist[k]))
	}
	msg := fmt.Sprintf("%d calls, codes: %s", rep.Count, strings.Join(codes, ", "))
	for _, k := range slices.Sorted(maps.Keys(rep.ErrorDist)) {
		msg += fmt.Sprintf("; %d× %q", rep.ErrorDist[k], k)
		break // the first error says enough
	}
	return msg
}

func (rep *ghzReport) p99() time.Duration {
	for _, l := range rep.LatencyDistribution {
		if l.Percentage == 99 {
			return l.Latency
		}
	}
	return 0
}

// snapshot is what is read of a system before and after a run.
type snapshot struct {
	server uint64
	redis  uint64
	// decisions are limiterd's limiter_decisions_total by rule and result.
	decisions map[[2]string]float64
}

func (e *env) snap(ctx context.Context, sys *system) (snapshot, error) {
	var s snapshot
	var err error
	if sys.metrics != "" {
		if s.decisions, err = decisions(ctx, sys.metrics); err != nil {
			return s, err
		}
	}
	if s.server, err = cpuTicks(sys.server); err != nil {
		return s, err
	}
	for _, n := range sys.redis {
		t, err := cpuTicks(n.pid)
		if err != nil {
			return s, fmt.Errorf("redis %s: %w", n.addr, err)
		}
		s.redis += t
	}
	return s, nil
}

// measure runs ghz once at concurrency c and reads what the run cost.
func (e *env) measure(ctx context.Context, r row, sys *system, dir string, c int, d time.Duration) (sample, error) {
	for _, n := range sys.redis {
		if err := n.c.ConfigResetStat(ctx).Err(); err != nil {
			return sample{}, fmt.Errorf("redis %s config resetstat: %w", n.addr, err)
		}
	}
	before, err := e.snap(ctx, sys)
	if err != nil {
		return sample{}, err
	}
	rep, err := e.ghz(ctx, r, sys, dir, fmt.Sprintf("c%d", c), c, d)
	if err != nil {
		return sample{}, err
	}
	after, err := e.snap(ctx, sys)
	if err != nil {
		return sample{}, err
	}
	s := sample{count: rep.Count, rps: rep.Rps, p99: rep.p99(), redisUs: math.NaN(), commands: make(map[string]cmdCost)}
	perCall := func(ticks uint64) float64 {
		return float64(ticks) / ticksPerSecond * 1e6 / float64(max(rep.Count, 1))
	}
	s.serverUs = perCall(after.server - before.server)
	s.clientUs = float64(rep.cpu.Microseconds()) / float64(max(rep.Count, 1))
	if len(sys.redis) > 0 {
		s.redisUs = perCall(after.redis - before.redis)
		for _, n := range sys.redis {
			info, err := n.c.Info(ctx, "commandstats").Result()
			if err != nil {
				return sample{}, fmt.Errorf("redis %s info commandstats: %w", n.addr, err)
			}
			for cmd, st := range commandStats(info) {
				c := s.commands[cmd]
				c.usec += st.usec / float64(max(rep.Count, 1))
				c.calls += st.calls / float64(max(rep.Count, 1))
				s.commands[cmd] = c
			}
		}
	}
	if msg := rep.notOK(); msg != "" {
		s.failed = msg
		return s, nil
	}
	if sys.metrics != "" {
		if msg := decisionsMoved(before.decisions, after.decisions, r.decides(), rep.Count); msg != "" {
			s.failed = msg
			return s, nil
		}
	}
	if r.decides() && len(sys.redis) > 0 && len(s.commands) == 0 {
		s.failed = "no Redis command ran: the answers did not come from Redis"
		return s, nil
	}
	// A few more calls with a Go client, whose answers are read: each
	// under the limit, decided by the config.
	if err := e.verify(ctx, r.api, sys.conn, 3); err != nil {
		s.failed = "after the run: " + err.Error()
	}
	return s, nil
}

// commandStats parses INFO commandstats: calls and usec by command, the
// commands ghz's calls cause and those of the tool and the clients
// themselves (INFO, CLUSTER SLOTS, PING) alike.
func commandStats(info string) map[string]cmdCost {
	out := make(map[string]cmdCost)
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		name, rest, ok := strings.Cut(strings.TrimSpace(sc.Text()), ":")
		cmd, isCmd := strings.CutPrefix(name, "cmdstat_")
		if !ok || !isCmd {
			continue
		}
		var c cmdCost
		for kv := range strings.SplitSeq(rest, ",") {
			k, v, _ := strings.Cut(kv, "=")
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				continue
			}
			switch k {
			case "calls":
				c.calls = f
			case "usec":
				c.usec = f
			}
		}
		out[cmd] = c
	}
	return out
}

// decisions reads limiterd's limiter_decisions_total from its /metrics.
func decisions(ctx context.Context, url string) (map[[2]string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", url, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", url, err)
	}
	out := make(map[[2]string]float64)
	for _, m := range mfs["limiter_decisions_total"].GetMetric() {
		out[[2]string{label(m, "rule"), label(m, "result")}] = m.GetCounter().GetValue()
	}
	return out, nil
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// decisionsMoved checks limiterd's decisions over a run of calls calls:
// every decision allowed (no fallback, no refusal, no error, no uncertain
// answer), and at least calls of them when the calls decide (a call cut
// at the end of the run may have been decided and not counted by ghz).
// It returns what is wrong, "" when nothing is.
func decisionsMoved(before, after map[[2]string]float64, decides bool, calls uint64) string {
	var allowed float64
	var wrong []string
	for _, k := range slices.SortedFunc(maps.Keys(after), func(a, b [2]string) int { return strings.Compare(a[0]+a[1], b[0]+b[1]) }) {
		d := after[k] - before[k]
		if d == 0 {
			continue
		}
		if k[1] == "allowed" {
			allowed += d
			continue
		}
		wrong = append(wrong, fmt.Sprintf("%s %s +%.0f", k[0], k[1], d))
	}
	switch {
	case len(wrong) > 0:
		return "limiterd decided otherwise than allowed by the store: " + strings.Join(wrong, ", ")
	case decides && allowed < float64(calls):
		return fmt.Sprintf("limiterd counted %.0f allowed decisions for %d OK calls", allowed, calls)
	case !decides && allowed > 0:
		return fmt.Sprintf("limiterd counted %.0f decisions for calls that decide nothing", allowed)
	}
	return ""
}
