package soak

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/limiterd/limiterd/internal/redisstore"
)

// eps absorbs float sums of whole tokens.
const eps = 1e-6

// steadyLag is the reconcile lag the bound allows beyond one interval
// without a fault: a destination that the probes show further behind a
// source than interval + steadyLag is blind to it, and the spends it did
// not see count in full.
const steadyLag = 500 * time.Millisecond

// auditInput is what the audit reads: the answers, the faults, the
// probes, and the regions' own records at the end.
type auditInput struct {
	interval time.Duration
	// maxDefer is the limiterds' --gossip.max-defer: how long a key under
	// its budget may wait unpublished.
	maxDefer time.Duration
	answers  []answer
	faults   []*fault
	probes   *probes // may be nil: no blind windows then
	// home is the home region of a pinned key.
	home func(key string) string

	// published[src][key]: tokens of the ledger rule in the distinct
	// flushes (instance, flush, part) of src's spends stream.
	published map[string]map[string]float64
	// flushes[src]: distinct flush parts in src's spends stream; replays:
	// messages naming a flush already seen.
	flushes, replays map[string]int
	// counts[dst][key]: the ledger rule's count of key in dst's Redis, for
	// every region's keys (dst's own included).
	counts map[string]map[string]float64
	// closedCounts[region][key]: the fail-closed rule's count in region's
	// Redis.
	closedCounts map[string]map[string]float64
	// closedUnstored: checks of the fail-closed rule decided without the
	// store (limiter_decisions_total fallback_allowed and
	// uncertain_allowed, every limiterd, every run).
	closedUnstored float64
}

// auditResult is what the audit found: broken invariants in failures, and
// the figures of the report.
type auditResult struct {
	failures []string

	ledgerKeys, ledgerChecks int     // (dst, key) pairs compared
	ledgerTokens             float64 // tokens published, summed over the destinations
	ledgerFlushes            int
	ledgerReplays            int
	lostFailover             float64 // tokens short in a destination whose primary was killed, within what it may have lost
	lostFailoverKeys         int
	unpublished              float64 // admitted by a limiterd killed before its flush
	unpublishedBound         float64
	fallbackPublished        float64 // published but not in the source's own count

	worst          map[int]overshoot // by rule, slow and fast
	boundKeys      int
	pinnedKeys     int
	pinnedOver     int // keys over the exact bound
	pinnedFailover []string
	closedKeys     int
	closedExcused  int
}

type overshoot struct {
	key                   string
	admitted, base, bound float64
	over                  float64 // admitted - base
	remoteInterval        float64 // one interval of remote spending
	// The slack's parts: the others' spending within one interval and
	// the steady lag before the last admission; what a region blind to
	// another (after interval + steadyLag, by the probes) did not see;
	// admissions around a fault of the key's Redis primary; what a
	// killed limiterd admitted in two intervals plus 1 s before its death.
	lag, blind, store, killed float64
}

// ev is one admission of a key.
type ev struct {
	sent, done int64
	region     int
	cost       float64
}

type ruleKey struct {
	rule int
	key  string
}

// interval is [lo, hi] in ns since the soak began.
type span struct{ lo, hi int64 }

func (x span) overlaps(e ev) bool { return e.done >= x.lo && e.sent <= x.hi }

// audit checks the four invariants.
func audit(in auditInput) auditResult {
	res := auditResult{worst: map[int]overshoot{}}
	fail := func(format string, args ...any) { res.failures = append(res.failures, fmt.Sprintf(format, args...)) }

	// Redis faults, by region and third of the slots.
	storeFaults := func(region string, third int) []span {
		var out []span
		for _, f := range in.faults {
			if (f.kind == faultPrimary || f.kind == faultPause) && f.region == region && slices.Contains(f.thirds, third) {
				out = append(out, span{f.start - int64(time.Second), f.end + 2*int64(time.Second)})
			}
		}
		return out
	}
	// failoverLoss is what a failover of region's primary of key may have
	// lost of evs (of one region, or all for -1): the spends of the 10 s
	// before the kill. Its last writes may not have reached the replica
	// (asynchronous replication): local admissions, and debits of remote
	// spends admitted up to a reconcile lag earlier.
	failoverLoss := func(region, key string, evs []ev, only int) float64 {
		th := thirdOf(redisstore.Slot(key))
		sum := 0.0
		for _, f := range in.faults {
			if f.kind != faultPrimary || f.region != region || !slices.Contains(f.thirds, th) {
				continue
			}
			w := span{f.start - 10*int64(time.Second), f.start + int64(time.Second)}
			for _, e := range evs {
				if (only < 0 || e.region == only) && w.overlaps(e) {
					sum += e.cost
				}
			}
		}
		return sum
	}
	kills := map[string][]int64{}
	for _, f := range in.faults {
		if f.kind == faultLimiterd {
			kills[f.region] = append(kills[f.region], f.killedAt)
		}
	}

	// byKey: the admissions of each key; tried: the admissions and the
	// checks without an answer (the store or a limiterd may have counted
	// them), probes included.
	byKey := map[ruleKey][]ev{}
	tried := map[ruleKey][]ev{}
	first := map[ruleKey]int64{}
	for _, a := range in.answers {
		k := ruleKey{int(a.rule), keyName(int(a.rule), regions[a.region], int(a.key))}
		if f, ok := first[k]; !ok || a.sent < f {
			first[k] = a.sent
		}
		e := ev{a.sent, a.done, int(a.region), float64(a.cost)}
		if a.allowed {
			byKey[k] = append(byKey[k], e)
		}
		if a.allowed || a.code != 0 {
			tried[k] = append(tried[k], e)
		}
	}
	if in.probes != nil {
		for si := range regions {
			for th := range 3 {
				for _, tk := range in.probes.admitted[si][th] {
					tried[ruleKey{ruleLedger, tk.key}] = append(tried[ruleKey{ruleLedger, tk.key}], ev{tk.sent, tk.done, si, 1})
				}
			}
			for _, tk := range in.probes.errored[si] {
				tried[ruleKey{ruleLedger, tk.key}] = append(tried[ruleKey{ruleLedger, tk.key}], ev{tk.sent, tk.done, si, 1})
			}
		}
	}
	for _, m := range []map[ruleKey][]ev{byKey, tried} {
		for _, evs := range m {
			sort.Slice(evs, func(i, j int) bool { return evs[i].done < evs[j].done })
		}
	}
	// What a killed limiterd never published: what it admitted since its
	// last flush that NATS acknowledged, at most one interval plus a
	// publish in flight (its timeout: max(interval, 1 s)), and its held
	// keys' (under their budget, up to max-defer old), counted over two
	// intervals plus 1 s plus max-defer before the kill.
	killWindow := 2*int64(in.interval) + int64(time.Second) + int64(in.maxDefer)
	killedSum := func(evs []ev, region int) float64 {
		sum := 0.0
		for _, at := range kills[regions[region]] {
			w := span{at - killWindow, at}
			for _, e := range evs {
				if e.region == region && w.overlaps(e) {
					sum += e.cost
				}
			}
		}
		return sum
	}

	// (1) The ledger: every region's count of another region's key is
	// exactly what that region published of it.
	for _, src := range regions {
		res.ledgerFlushes += in.flushes[src]
		res.ledgerReplays += in.replays[src]
		keys := map[string]bool{}
		for k := range in.published[src] {
			keys[k] = true
		}
		for _, dst := range regions {
			for k := range in.counts[dst] {
				if ledgerKeyOf(k) == src {
					keys[k] = true
				}
			}
		}
		srcIdx := slices.Index(regions, src)
		for k := range keys {
			pub := in.published[src][k]
			rk := redisstore.Key(ruleIDs[ruleLedger], k)
			for _, dst := range regions {
				got := in.counts[dst][k]
				if dst == src {
					// Its own count: what it admitted. Spends of a
					// limiterd killed before its flush are in it and
					// were never published.
					evs := tried[ruleKey{ruleLedger, k}]
					switch d := got - pub; {
					case d > eps:
						res.unpublished += d
						res.unpublishedBound += killedSum(evs, srcIdx)
						if d > killedSum(evs, srcIdx)+eps {
							fail("ledger: %s counts %v of its key %s but published %v: %v never published, more than its limiterd admitted in the %v before a kill (%v)",
								src, got, k, pub, d, time.Duration(killWindow), killedSum(evs, srcIdx))
						}
					case d < -eps:
						// Admitted by the fallback (store down), or lost
						// in a failover: published, not counted here.
						res.fallbackPublished += -d
					}
					continue
				}
				res.ledgerChecks++
				res.ledgerTokens += pub
				switch d := got - pub; {
				case d > eps:
					fail("ledger: %s counts %v of %s's key %s, more than the %v %s published: applied twice", dst, got, src, k, pub, src)
				case d < -eps:
					if loss := failoverLoss(dst, rk, tried[ruleKey{ruleLedger, k}], -1); -d <= loss+eps {
						res.lostFailover += -d
						res.lostFailoverKeys++
						continue
					}
					fail("ledger: %s counts %v of %s's key %s, less than the %v %s published: a spend lost", dst, got, src, k, pub, src)
				}
			}
		}
		res.ledgerKeys += len(keys)
	}

	// (2) The slow and fast shapes: each key's total across the regions
	// within capacity + rate*T + what the regions could not see in time.
	lagWin := int64(in.interval + steadyLag)
	blind := in.blindSpans(lagWin)
	for k, evs := range byKey {
		if k.rule != ruleSlow && k.rule != ruleFast {
			continue
		}
		res.boundKeys++
		lim := bucketLimits[k.rule]
		total := 0.0
		for _, e := range evs {
			total += e.cost
		}
		last := evs[len(evs)-1].done
		base := lim.capacity + lim.rate*time.Duration(last-first[k]).Seconds()
		o := overshoot{key: ruleIDs[k.rule] + "/" + k.key, admitted: total, base: base, over: total - base}
		o.lag = unseenAtLast(evs, lagWin)
		o.remoteInterval = remoteWithin(evs, int64(in.interval))
		th := thirdOf(redisstore.Slot(redisstore.Key(ruleIDs[k.rule], k.key)))
		for di, dst := range regions {
			for si := range regions {
				if si == di {
					continue
				}
				spans := blind[di][si][th]
				for _, e := range evs {
					if e.region != si {
						continue
					}
					for _, sp := range spans {
						if sp.overlaps(e) {
							o.blind += e.cost
							break
						}
					}
				}
			}
			for _, sp := range storeFaults(dst, th) {
				for _, e := range evs {
					if sp.overlaps(e) {
						o.store += e.cost
					}
				}
			}
			o.killed += killedSum(evs, di)
		}
		o.bound = base + o.lag + o.blind + o.store + o.killed
		if total > o.bound+eps {
			fail("bound: %s admitted %v over the soak, above its bound %.1f (capacity + rate*T %.1f, lag %v, blind %v, store faults %v, killed limiterds %v)",
				o.key, total, o.bound, base, o.lag, o.blind, o.store, o.killed)
		}
		if w, ok := res.worst[k.rule]; !ok || o.over > w.over {
			res.worst[k.rule] = o
		}
	}

	// (3) The pinned rule: exact, but for keys whose home primary failed
	// over (its last writes may not have reached its replica).
	lim := bucketLimits[rulePinned]
	for k, evs := range byKey {
		if k.rule != rulePinned {
			continue
		}
		res.pinnedKeys++
		total := 0.0
		for _, e := range evs {
			total += e.cost
		}
		base := lim.capacity + lim.rate*time.Duration(evs[len(evs)-1].done-first[k]).Seconds()
		if total <= base+eps {
			continue
		}
		res.pinnedOver++
		home := in.home(k.key)
		if total-base <= failoverLoss(home, redisstore.Key(ruleIDs[rulePinned], k.key), evs, -1)+eps {
			res.pinnedFailover = append(res.pinnedFailover, fmt.Sprintf("%s (home %s): %v > %.2f", k.key, home, total, base))
			continue
		}
		fail("pinned: %s (home %s) admitted %v across the regions, above capacity + rate*T = %.2f", k.key, home, total, base)
	}

	// (4) The fail-closed rule: never admitted without its store.
	if in.closedUnstored > 0 {
		fail("fail-closed: %v checks decided without the store (fallback_allowed, uncertain_allowed)", in.closedUnstored)
	}
	for k, evs := range byKey {
		if k.rule != ruleClosed {
			continue
		}
		for ri, r := range regions {
			admitted := 0.0
			for _, e := range evs {
				if e.region == ri {
					admitted += e.cost
				}
			}
			if admitted == 0 {
				continue
			}
			res.closedKeys++
			stored := in.closedCounts[r][k.key]
			if admitted <= stored+eps {
				continue
			}
			if admitted-stored <= failoverLoss(r, redisstore.Key(ruleIDs[ruleClosed], k.key), evs, ri)+eps {
				res.closedExcused++
				continue
			}
			fail("fail-closed: %s admitted %v of %s, its store counts %v: admitted without a store decision", r, admitted, k.key, stored)
		}
	}
	slices.Sort(res.failures)
	return res
}

// ledgerKeyOf is the region a ledger key belongs to ("" if none).
func ledgerKeyOf(key string) string {
	for _, r := range regions {
		if strings.HasPrefix(key, r+"-") || strings.HasPrefix(key, "probe-"+r+"-") {
			return r
		}
	}
	return ""
}

// unseenAtLast is what the other regions admitted within w before the
// last admission of a key: what the region that admitted it may not have
// heard of yet. Its bucket held its own spends and the others' it had
// heard of to capacity + rate*T, so the total is over that by at most
// this (plus what the blind, store and kill terms count).
func unseenAtLast(evs []ev, w int64) float64 {
	last := evs[len(evs)-1]
	sum := 0.0
	for _, e := range evs {
		if e.region != last.region && e.done > last.sent-w {
			sum += e.cost
		}
	}
	return sum
}

// remoteWithin is the most that all regions but one admitted within w,
// for the region it is largest for: what a region cannot have heard of.
func remoteWithin(evs []ev, w int64) float64 {
	best := 0.0
	for dst := range regions {
		sum, lo := 0.0, 0
		for _, e := range evs {
			if e.region == dst {
				continue
			}
			sum += e.cost
			for evs[lo].done < e.done-w {
				if evs[lo].region != dst {
					sum -= evs[lo].cost
				}
				lo++
			}
			best = max(best, sum)
		}
	}
	return best
}

// blindSpans are, per destination, source and third of the slots, the
// times whose spends the destination had not heard of after lagWin: from
// the probes, [oldest admitted tick not applied, sample] for every sample
// later than lagWin after that tick.
func (in auditInput) blindSpans(lagWin int64) [][][3][]span {
	out := make([][][3][]span, len(regions))
	for d := range out {
		out[d] = make([][3][]span, len(regions))
	}
	if in.probes == nil {
		return out
	}
	for d := range regions {
		for s := range regions {
			for th := range 3 {
				var spans []span
				for _, sm := range in.probes.seen[d][s][th] {
					if sm.next < 0 || sm.at-sm.next <= lagWin {
						continue
					}
					sp := span{sm.next, sm.at}
					if n := len(spans); n > 0 && spans[n-1].hi >= sp.lo {
						spans[n-1].hi = max(spans[n-1].hi, sp.hi)
						spans[n-1].lo = min(spans[n-1].lo, sp.lo)
						continue
					}
					spans = append(spans, sp)
				}
				out[d][s][th] = spans
			}
		}
	}
	return out
}

// report is the one-screen summary.
func report(b *strings.Builder, dur time.Duration, seed uint64, in auditInput, res auditResult, lag50, lag99 string, lagN uint64) {
	fmt.Fprintf(b, "soak: %v, seed %d, gossip interval %v, %d regions\n", dur.Round(time.Second), seed, in.interval, len(regions))
	sent := make([]int, len(regions))
	allowed := make([]int, len(regions))
	errs := make([]int, len(regions))
	for _, a := range in.answers {
		sent[a.region]++
		if a.allowed {
			allowed[a.region]++
		}
		if a.code != 0 {
			errs[a.region]++
		}
	}
	b.WriteString("checks      ")
	for i, r := range regions {
		fmt.Fprintf(b, " %s %d sent, %d admitted, %d errors;", r, sent[i], allowed[i], errs[i])
	}
	byCode := map[codes.Code]int{}
	for _, a := range in.answers {
		if a.code != 0 {
			byCode[codes.Code(a.code)]++
		}
	}
	var cs []string
	for c, n := range byCode {
		cs = append(cs, fmt.Sprintf("%v %d", c, n))
	}
	slices.Sort(cs)
	fmt.Fprintf(b, "\n             errors by code: %s\n", strings.Join(cs, ", "))
	byKind := map[string][]*fault{}
	for _, f := range in.faults {
		byKind[f.kind] = append(byKind[f.kind], f)
	}
	fmt.Fprintf(b, "faults       %d, each from its start to its target's return (the list is in the test log)\n", len(in.faults))
	for _, k := range faultKinds {
		var total, lo, hi time.Duration
		errs := 0
		for i, f := range byKind[k] {
			d := time.Duration(f.end - f.start)
			total += d
			if i == 0 || d < lo {
				lo = d
			}
			hi = max(hi, d)
			if f.err != "" {
				errs++
			}
		}
		fmt.Fprintf(b, "  %-18s %2d, %4.1f-%4.1fs each, %5.1fs in all", k, len(byKind[k]), lo.Seconds(), hi.Seconds(), total.Seconds())
		if errs > 0 {
			fmt.Fprintf(b, ", %d FAILED to inject or heal", errs)
		}
		b.WriteString("\n")
	}
	fmt.Fprintf(b, "ledger       %d flushes (%d replays), %d keys, %.0f tokens applied in %d (region, key) pairs: exact",
		res.ledgerFlushes, res.ledgerReplays, res.ledgerKeys, res.ledgerTokens, res.ledgerChecks)
	if res.lostFailover > 0 {
		fmt.Fprintf(b, " but %.0f tokens of %d keys lost in failovers", res.lostFailover, res.lostFailoverKeys)
	}
	fmt.Fprintf(b, "\n             never published (limiterd killed before its flush): %.0f tokens (bound %.0f); published, not in own count (fallback): %.0f\n",
		res.unpublished, res.unpublishedBound, res.fallbackPublished)
	fmt.Fprintf(b, "bound        %d keys of slow and fast\n", res.boundKeys)
	for _, rule := range []int{ruleSlow, ruleFast} {
		o, ok := res.worst[rule]
		if !ok {
			continue
		}
		mult := math.NaN()
		if o.remoteInterval > 0 {
			mult = o.over / o.remoteInterval
		}
		fmt.Fprintf(b, "  worst %-4s %s: admitted %.0f, capacity+rate*T %.1f, overshoot %+.1f = %+.2f x one interval of remote spending (%.0f); bound %.1f (lag %.0f, blind %.0f, store %.0f, killed %.0f)\n",
			ruleIDs[rule], o.key, o.admitted, o.base, o.over, mult, o.remoteInterval, o.bound, o.lag, o.blind, o.store, o.killed)
	}
	fmt.Fprintf(b, "pinned       %d keys, %d over capacity+rate*T", res.pinnedKeys, res.pinnedOver)
	if len(res.pinnedFailover) > 0 {
		fmt.Fprintf(b, " (%d within a failover of their home primary: %s)", len(res.pinnedFailover), strings.Join(res.pinnedFailover, "; "))
	}
	b.WriteString("\n")
	fmt.Fprintf(b, "fail-closed  %d (region, key) pairs, admitted <= store everywhere but %d after a failover; decided without the store: %.0f\n",
		res.closedKeys, res.closedExcused, in.closedUnstored)
	fmt.Fprintf(b, "lag          limiter_reconcile_lag_seconds p50 <= %s, p99 <= %s (%d debits, every reconciler and run)\n", lag50, lag99, lagN)
	if len(res.failures) == 0 {
		b.WriteString("result       every invariant held\n")
	} else {
		fmt.Fprintf(b, "result       %d BROKEN (seed %d):\n", len(res.failures), seed)
		for i, f := range res.failures {
			if i == 20 {
				fmt.Fprintf(b, "  ... %d more\n", len(res.failures)-20)
				break
			}
			fmt.Fprintf(b, "  %s\n", f)
		}
	}
}
