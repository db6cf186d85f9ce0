// Package demo drives one fresh key through the three regions of the local
// stack at a rate well above its limit, first on a reconciled rule and then
// on the same limits unreconciled, and reports how far each run's admissions
// went past the limit capacity + refill*T.
package demo

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// target is one region's limiterd.
type target struct {
	region, address, flag string
	client                limiterv1.LimiterClient
}

// Run validates opts, checks the rules, then runs the reconciled rule and
// the unreconciled one, one after the other, and writes the report to w
// and its chart to opts.ChartFile, from the same measurement.
func Run(ctx context.Context, opts Options, w io.Writer) error {
	// A chart that cannot be written fails now, not after the runs.
	if opts.ChartFile != "" {
		if err := os.MkdirAll(filepath.Dir(opts.ChartFile), 0o755); err != nil {
			return optErr("chart", "%w", err)
		}
	}
	rep, err := Measure(ctx, opts)
	if err != nil {
		return err
	}
	if err := rep.Write(w); err != nil {
		return err
	}
	if opts.ChartFile == "" {
		return nil
	}
	if err := writeChartFile(rep, opts.ChartFile); err != nil {
		return optErr("chart", "%w", err)
	}
	_, err = fmt.Fprintf(w, "\nchart: %s\n", opts.ChartFile)
	return err
}

// writeChartFile writes rep's chart to path.
func writeChartFile(rep *Report, path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := rep.WriteChart(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Measure is Run without the printing. When ctx is cancelled it returns
// ctx's cause.
func Measure(ctx context.Context, opts Options) (*Report, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	set, err := rules.Load(opts.RulesFile)
	if err != nil {
		return nil, optErr("rules.file", "%w", err)
	}
	rec, err := demoRule(set, "rule.reconciled", opts.ReconciledRule, true, opts.RulesFile)
	if err != nil {
		return nil, err
	}
	solo, err := demoRule(set, "rule.unreconciled", opts.UnreconciledRule, false, opts.RulesFile)
	if err != nil {
		return nil, err
	}

	targets := opts.targets()
	for _, t := range targets {
		cc, err := grpc.NewClient(t.address, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, optErr(t.flag, "%w", err)
		}
		defer cc.Close()
		t.client = limiterv1.NewLimiterClient(cc)
	}
	key, err := freshKey()
	if err != nil {
		return nil, err
	}
	// One check of each rule on a key of its own, in every region: a stack
	// that is down, or runs other rules, fails here, before any run.
	for _, t := range targets {
		for _, r := range []*rules.Rule{rec, solo} {
			cctx, cancel := context.WithTimeout(ctx, opts.Timeout)
			_, err := t.client.Check(cctx, &limiterv1.CheckRequest{RuleId: r.ID, Key: key + "-probe"})
			cancel()
			if err != nil {
				return nil, fmt.Errorf("%s at %s (--%s), rule %s: %w (is the stack up? make up)", t.region, t.address, t.flag, r.ID, err)
			}
		}
	}

	rep := &Report{Key: key, Rate: opts.Rate, Duration: opts.Duration}
	for _, r := range []*rules.Rule{rec, solo} {
		res, err := runRule(ctx, opts, targets, r, key)
		if err != nil {
			return nil, err
		}
		rep.Runs = append(rep.Runs, *res)
	}
	return rep, nil
}

// demoRule finds rule id and makes sure the report's arithmetic holds for it.
func demoRule(set *rules.Set, flag, id string, reconciled bool, file string) (*rules.Rule, error) {
	r := set.Get(id)
	switch {
	case r == nil:
		return nil, optErr(flag, "no rule %q in %s", id, file)
	case r.Algorithm != bucket.TokenBucket && r.Algorithm != bucket.GCRA:
		return nil, optErr(flag, "rule %q is a %s: the demo needs a %s or %s (capacity + refill*T)", id, r.Algorithm, bucket.TokenBucket, bucket.GCRA)
	case r.Pinned():
		return nil, optErr(flag, "rule %q is pinned to a home region", id)
	case r.Shadow:
		return nil, optErr(flag, "rule %q is a shadow rule: it refuses nothing", id)
	case r.Cost != 1:
		return nil, optErr(flag, "rule %q costs %v per request: the demo counts one token per check", id, r.Cost)
	case r.Reconciled() != reconciled:
		if reconciled {
			return nil, optErr(flag, "rule %q has reconcile: false", id)
		}
		return nil, optErr(flag, "rule %q is reconciled: give one with reconcile: false", id)
	}
	return r, nil
}

// freshKey makes a client key no earlier run used.
func freshKey() (string, error) {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return fmt.Sprintf("limiterdemo-%d-%s", time.Now().Unix(), hex.EncodeToString(b)), nil
}

// runRule sends Rate checks per second of rule for key to every target, for
// Duration. Checks are due on a fixed schedule, the targets' schedules
// offset evenly; a check that is late goes at once. The first failed check
// ends the run.
func runRule(ctx context.Context, opts Options, targets []*target, rule *rules.Rule, key string) (*Result, error) {
	lim := rule.Bucket()
	res := &Result{
		Rule: rule.ID, Reconciled: rule.Reconciled(),
		Capacity: lim.Capacity, RefillPerSecond: lim.RefillPerSecond,
		GossipInterval: opts.GossipInterval,
		Regions:        make([]RegionResult, len(targets)),
	}
	period := time.Duration(float64(time.Second) / opts.Rate)
	n := int(opts.Rate * opts.Duration.Seconds())
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	start := time.Now()
	var wg sync.WaitGroup
	for i, t := range targets {
		reg := &res.Regions[i]
		reg.Region, reg.Address = t.region, t.address
		offset := period * time.Duration(i) / time.Duration(len(targets))
		wg.Go(func() {
			timer := time.NewTimer(0)
			defer timer.Stop()
			for j := range n {
				timer.Reset(time.Until(start.Add(offset + period*time.Duration(j))))
				select {
				case <-ctx.Done():
					return
				case <-timer.C:
				}
				cctx, ccancel := context.WithTimeout(ctx, opts.Timeout)
				resp, err := t.client.Check(cctx, &limiterv1.CheckRequest{RuleId: rule.ID, Key: key})
				ccancel()
				if err != nil {
					if ctx.Err() != nil {
						return // the demo was stopped, or another region failed
					}
					cancel(fmt.Errorf("%s at %s, rule %s, check %d of %d: %w", t.region, t.address, rule.ID, j+1, n, err))
					return
				}
				reg.Sent++
				if resp.GetAllowed() {
					reg.Admitted = append(reg.Admitted, time.Since(start))
				}
			}
		})
	}
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		return nil, err
	}
	// The run lasts its whole duration even when the last check came early.
	select {
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	case <-time.After(time.Until(start.Add(opts.Duration))):
	}
	res.Elapsed = time.Since(start)
	return res, nil
}
