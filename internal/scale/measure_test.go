package scale

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/prometheus/common/expfmt"
	promodel "github.com/prometheus/common/model"
	"github.com/redis/go-redis/v9"
)

// clockTicks is the unit of utime and stime in /proc/PID/stat (USER_HZ,
// 100 on Linux).
const clockTicks = 100

// procCPU is the CPU time, user and system, that process pid has used,
// in seconds.
func procCPU(pid int) (float64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The fields after the command, which is in parentheses and may hold
	// spaces: state is field 3, utime 14 and stime 15.
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: %q", pid, s)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields after the command", pid, len(f))
	}
	ut, err1 := strconv.ParseFloat(f[11], 64)
	st, err2 := strconv.ParseFloat(f[12], 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: utime %q, stime %q", pid, f[11], f[12])
	}
	return (ut + st) / clockTicks, nil
}

// redisStats is what INFO says of one node: its CPU (used_cpu_sys +
// used_cpu_user, seconds) and its script calls (EVALSHA, EVAL, FCALL).
type redisStats struct {
	cpu     float64
	scripts float64
	// scriptSecs is the time Redis spent running scripts (commandstats
	// usec): the rest of cpu is reading, parsing and answering commands,
	// and Redis's own housekeeping.
	scriptSecs float64
}

func (a redisStats) minus(b redisStats) redisStats {
	return redisStats{a.cpu - b.cpu, a.scripts - b.scripts, a.scriptSecs - b.scriptSecs}
}

func readRedis(ctx context.Context, c *redis.Client) (redisStats, error) {
	info, err := c.Info(ctx, "cpu", "commandstats").Result()
	if err != nil {
		return redisStats{}, err
	}
	var st redisStats
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		name, val, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch name {
		case "used_cpu_sys", "used_cpu_user":
			v, err := strconv.ParseFloat(val, 64)
			if err != nil {
				return redisStats{}, fmt.Errorf("INFO cpu: %s: %w", name, err)
			}
			st.cpu += v
		case "cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall":
			for f := range strings.SplitSeq(val, ",") {
				if n, ok := strings.CutPrefix(f, "calls="); ok {
					v, err := strconv.ParseFloat(n, 64)
					if err != nil {
						return redisStats{}, fmt.Errorf("INFO commandstats: %s: %w", name, err)
					}
					st.scripts += v
				}
				if n, ok := strings.CutPrefix(f, "usec="); ok {
					v, err := strconv.ParseFloat(n, 64)
					if err != nil {
						return redisStats{}, fmt.Errorf("INFO commandstats: %s: %w", name, err)
					}
					st.scriptSecs += v / 1e6
				}
			}
		}
	}
	return st, nil
}

// recMetrics is what a reconciler's /metrics says: clients debited, and
// the reconcile lag histogram (cumulative counts by upper bound).
type recMetrics struct {
	applied float64
	// refilled are the clients whose spends had refilled when they
	// arrived: handled with a read, nothing written.
	refilled float64
	// from is applied and refilled by source region.
	from map[string]float64
	lag  map[float64]float64
	// relayed are this region's spend entries relayed, relayClients the
	// clients in the messages they were merged into: what every other
	// region debits or finds refilled.
	relayed, relayClients float64
}

func scrape(ctx context.Context, addr string) (recMetrics, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return recMetrics{}, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return recMetrics{}, err
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(promodel.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return recMetrics{}, err
	}
	m := recMetrics{lag: map[float64]float64{}, from: map[string]float64{}}
	// A client debited from the retry stream (its node slow or down when
	// its message came) is counted here too.
	for name, sum := range map[string]*float64{"limiter_spends_applied_total": &m.applied, "limiter_spends_refilled_total": &m.refilled} {
		mf := mfs[name]
		if mf == nil {
			continue
		}
		for _, s := range mf.GetMetric() {
			*sum += s.GetCounter().GetValue()
			for _, l := range s.GetLabel() {
				if l.GetName() == "source_region" {
					m.from[l.GetValue()] += s.GetCounter().GetValue()
				}
			}
		}
	}
	for name, v := range map[string]*float64{"limiter_spends_published_total": &m.relayed, "limiter_relay_clients_total": &m.relayClients} {
		if mf := mfs[name]; mf != nil {
			for _, s := range mf.GetMetric() {
				*v += s.GetCounter().GetValue()
			}
		}
	}
	if mf := mfs["limiter_reconcile_lag_seconds"]; mf != nil {
		for _, s := range mf.GetMetric() {
			// The text format lists the +Inf bucket; the count is the same.
			for _, b := range s.GetHistogram().GetBucket() {
				if !math.IsInf(b.GetUpperBound(), 1) {
					m.lag[b.GetUpperBound()] += float64(b.GetCumulativeCount())
				}
			}
			m.lag[math.Inf(1)] += float64(s.GetHistogram().GetSampleCount())
		}
	}
	return m, nil
}

// lagDelta is the histogram of the observations between two scrapes.
func lagDelta(a, b map[float64]float64) map[float64]float64 {
	out := map[float64]float64{}
	for k, v := range b {
		out[k] = v - a[k]
	}
	return out
}

// quantile is the q-quantile of a cumulative histogram, interpolated
// within its bucket as Prometheus's histogram_quantile does; NaN when it
// has no observation.
func quantile(q float64, h map[float64]float64) float64 {
	bounds := slices.Sorted(func(yield func(float64) bool) {
		for k := range h {
			if !yield(k) {
				return
			}
		}
	})
	if len(bounds) == 0 || h[math.Inf(1)] == 0 {
		return math.NaN()
	}
	rank := q * h[math.Inf(1)]
	lo, below := 0.0, 0.0
	for _, ub := range bounds {
		if h[ub] >= rank {
			if math.IsInf(ub, 1) {
				return lo
			}
			return lo + (ub-lo)*(rank-below)/(h[ub]-below)
		}
		lo, below = ub, h[ub]
	}
	return lo
}
