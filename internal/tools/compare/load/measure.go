package load

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
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/limiterd/limiterd/internal/tools/compare/systems"
)

// Runner runs ghz against the systems and checks their answers.
type Runner struct {
	bin      string // ghz
	config   string // the folder of the config files
	protoset string // the file of the protoset
	// gub holds the descriptors of gubernator's API, for the checks of
	// its answers; nil without it.
	gub *protoregistry.Files
	// pin runs ghz on CPU 0 (taskset), the servers being on the others.
	pin bool
}

// New writes the config files into the folder config, compiles
// gubernator.proto there when gubernator (for a row of Gubernator's API),
// and writes the protoset ghz reads into the file protosetPath: a Runner
// of the ghz at bin, on CPU 0 when pin.
func New(ctx context.Context, bin, config, protosetPath string, gubernator, pin bool) (*Runner, error) {
	ru := &Runner{bin: bin, config: config, protoset: protosetPath, pin: pin}
	if err := writeConfig(config); err != nil {
		return nil, err
	}
	var gubSet *descriptorpb.FileDescriptorSet
	if gubernator {
		var err error
		if gubSet, ru.gub, err = compileGubernator(ctx, config); err != nil {
			return nil, err
		}
	}
	set, err := protoset(gubSet)
	if err != nil {
		return nil, err
	}
	b, err := proto.Marshal(set)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(protosetPath, b, 0o644); err != nil {
		return nil, err
	}
	return ru, nil
}

// Sample is what one ghz run measured.
type Sample struct {
	// Failed says why the run does not count; "" when it does.
	Failed string
	count  uint64
	RPS    float64
	P99    time.Duration
	// ServerUs and RedisUs are CPU µs per call (/proc), RedisUs summed
	// over the system's Redis servers; NaN without Redis.
	ServerUs, RedisUs float64
	// ClientUs is the load tool's own CPU µs per call (its user and
	// system time): on a machine it shares with the servers, what it
	// spends is not there for them.
	ClientUs float64
	// Commands are Redis's own time and calls per call, by command
	// (INFO commandstats summed over the nodes).
	Commands map[string]CmdCost
}

// CmdCost is one Redis command's usec and calls, per call of the API.
type CmdCost struct{ Usec, Calls float64 }

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
// the requests of a of the run labelled run, and returns its report.
func (ru *Runner) ghz(ctx context.Context, a API, sys *systems.System, dir, run string, c int, d time.Duration) (*ghzReport, error) {
	src, err := os.ReadFile(filepath.Join(ru.config, a.template))
	if err != nil {
		return nil, err
	}
	data := filepath.Join(dir, "request-"+run+".json")
	if err := os.WriteFile(data, forRun(src, run), 0o600); err != nil {
		return nil, err
	}
	defer os.Remove(data)
	out := filepath.Join(dir, fmt.Sprintf("ghz-%s.json", run))
	args := []string{"--insecure", "--protoset", ru.protoset, "--call", a.method,
		"--data-file", data,
		"-c", strconv.Itoa(c), "--connections", "1", "-z", d.String(),
		// The calls in flight at the end complete and count: "close" (the
		// default) cuts them with UNAVAILABLE.
		"--duration-stop", "wait",
		"--format", "json", "--output", out, sys.GRPC}
	ctx, cancel := context.WithTimeout(ctx, d+time.Minute)
	defer cancel()
	bin := ru.bin
	if ru.pin {
		bin, args = "taskset", append([]string{"-c", "0", ru.bin}, args...)
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

// Warmup runs ghz against sys for d at concurrency c, unmeasured, and
// fails unless every call was OK.
func (ru *Runner) Warmup(ctx context.Context, a API, sys *systems.System, dir string, c int, d time.Duration) error {
	rep, err := ru.ghz(ctx, a, sys, dir, "warmup", c, d)
	if err != nil {
		return err
	}
	if msg := rep.notOK(); msg != "" {
		return fmt.Errorf("warm-up: %s", msg)
	}
	return nil
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

func snap(ctx context.Context, sys *systems.System) (snapshot, error) {
	var s snapshot
	var err error
	if sys.Metrics != "" {
		if s.decisions, err = decisions(ctx, sys.Metrics); err != nil {
			return s, err
		}
	}
	s.server, s.redis, err = sys.CPUTicks()
	return s, err
}

// Measure runs ghz against sys once at concurrency c for d, with the
// requests of a, and reads what the run cost.
func (ru *Runner) Measure(ctx context.Context, a API, sys *systems.System, dir string, c int, d time.Duration) (Sample, error) {
	if err := sys.ResetStats(ctx); err != nil {
		return Sample{}, err
	}
	before, err := snap(ctx, sys)
	if err != nil {
		return Sample{}, err
	}
	rep, err := ru.ghz(ctx, a, sys, dir, fmt.Sprintf("c%d", c), c, d)
	if err != nil {
		return Sample{}, err
	}
	after, err := snap(ctx, sys)
	if err != nil {
		return Sample{}, err
	}
	s := Sample{count: rep.Count, RPS: rep.Rps, P99: rep.p99(), RedisUs: math.NaN(), Commands: make(map[string]CmdCost)}
	perCall := func(ticks uint64) float64 {
		return float64(ticks) / systems.TicksPerSecond * 1e6 / float64(max(rep.Count, 1))
	}
	s.ServerUs = perCall(after.server - before.server)
	s.ClientUs = float64(rep.cpu.Microseconds()) / float64(max(rep.Count, 1))
	if sys.HasRedis() {
		s.RedisUs = perCall(after.redis - before.redis)
		infos, err := sys.CommandStats(ctx)
		if err != nil {
			return Sample{}, err
		}
		for _, info := range infos {
			for cmd, st := range commandStats(info) {
				c := s.Commands[cmd]
				c.Usec += st.Usec / float64(max(rep.Count, 1))
				c.Calls += st.Calls / float64(max(rep.Count, 1))
				s.Commands[cmd] = c
			}
		}
	}
	if msg := rep.notOK(); msg != "" {
		s.Failed = msg
		return s, nil
	}
	if sys.Metrics != "" {
		if msg := decisionsMoved(before.decisions, after.decisions, a.decides(), rep.Count); msg != "" {
			s.Failed = msg
			return s, nil
		}
	}
	if a.decides() && sys.HasRedis() && len(s.Commands) == 0 {
		s.Failed = "no Redis command ran: the answers did not come from Redis"
		return s, nil
	}
	// A few more calls with a Go client, whose answers are read: each
	// under the limit, decided by the config.
	if err := ru.Verify(ctx, a, sys.Conn, 3); err != nil {
		s.Failed = "after the run: " + err.Error()
	}
	return s, nil
}

// commandStats parses INFO commandstats: calls and usec by command, the
// commands ghz's calls cause and those of the tool and the clients
// themselves (INFO, CLUSTER SLOTS, PING) alike.
func commandStats(info string) map[string]CmdCost {
	out := make(map[string]CmdCost)
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		name, rest, ok := strings.Cut(strings.TrimSpace(sc.Text()), ":")
		cmd, isCmd := strings.CutPrefix(name, "cmdstat_")
		if !ok || !isCmd {
			continue
		}
		var c CmdCost
		for kv := range strings.SplitSeq(rest, ",") {
			k, v, _ := strings.Cut(kv, "=")
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				continue
			}
			switch k {
			case "calls":
				c.Calls = f
			case "usec":
				c.Usec = f
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
