package demo

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"time"

	"github.com/limiterd/limiterd/pkg/gossip"
)

// Defaults of the options and of their flags: the stack `make up` starts.
const (
	DefaultUSEastAddress    = "127.0.0.1:8081"
	DefaultEUWestAddress    = "127.0.0.1:8082"
	DefaultAPSouthAddress   = "127.0.0.1:8083"
	DefaultRulesFile        = "examples/rules.yml"
	DefaultReconciledRule   = "global-demo"
	DefaultUnreconciledRule = "global-demo-unreconciled"
	// DefaultRate is 20 checks/s per region: 60/s on one key over the
	// three regions, well above the demo rules' refill of 1/s.
	DefaultRate     = 20
	DefaultDuration = 20 * time.Second
	// DefaultGossipInterval is the stack's --gossip.interval.
	DefaultGossipInterval = gossip.DefaultInterval
	DefaultTimeout        = 2 * time.Second
	// DefaultChartFile is where the chart goes, beside the binaries
	// `make demo` builds.
	DefaultChartFile = "bin/demo.svg"
)

// Bounds of the options: a demo always ends by itself, soon.
const (
	MinDuration = time.Second
	MaxDuration = 10 * time.Minute
	MaxRate     = 1000
	MaxTimeout  = time.Minute
)

// ErrInvalidOption is matched (with errors.Is) by every *OptionError.
var ErrInvalidOption = errors.New("invalid option")

// OptionError reports an invalid option value, naming its flag.
type OptionError struct {
	// Flag is the flag name without dashes, such as "duration".
	Flag string
	// Err says what is wrong with the value.
	Err error
}

func (e *OptionError) Error() string { return "--" + e.Flag + ": " + e.Err.Error() }

// Unwrap returns e.Err.
func (e *OptionError) Unwrap() error { return e.Err }

// Is reports whether target is ErrInvalidOption.
func (e *OptionError) Is(target error) bool { return target == ErrInvalidOption }

func optErr(flag, format string, args ...any) error {
	return &OptionError{Flag: flag, Err: fmt.Errorf(format, args...)}
}

// Options configure a demo. The zero Options is not valid: start from
// DefaultOptions. Each field is set by the flag named in its comment.
type Options struct {
	// USEastAddress, EUWestAddress and APSouthAddress are the gRPC
	// addresses of the three regions' limiterd (--us-east.grpc-address,
	// --eu-west.grpc-address, --ap-south.grpc-address).
	USEastAddress, EUWestAddress, APSouthAddress string
	// RulesFile is the rules file the stack runs with (--rules.file): the
	// limit over a run comes from the rules' capacity and refill.
	RulesFile string
	// ReconciledRule must be a reconciled token bucket or GCRA rule
	// (--rule.reconciled); UnreconciledRule one with reconcile: false
	// (--rule.unreconciled).
	ReconciledRule, UnreconciledRule string
	// Rate is the checks per second sent to each region (--rate).
	Rate float64
	// Duration is the length of each of the two runs (--duration).
	Duration time.Duration
	// GossipInterval is the stack's --gossip.interval (--gossip.interval):
	// the window in which one region's spending is not yet seen by the other.
	GossipInterval time.Duration
	// Timeout is the deadline of each check (--timeout).
	Timeout time.Duration
	// ChartFile is the SVG chart of the report (--chart); "" writes none.
	ChartFile string
}

// DefaultOptions returns the options with every flag at its default.
func DefaultOptions() Options {
	return Options{
		USEastAddress:    DefaultUSEastAddress,
		EUWestAddress:    DefaultEUWestAddress,
		APSouthAddress:   DefaultAPSouthAddress,
		RulesFile:        DefaultRulesFile,
		ReconciledRule:   DefaultReconciledRule,
		UnreconciledRule: DefaultUnreconciledRule,
		Rate:             DefaultRate,
		Duration:         DefaultDuration,
		GossipInterval:   DefaultGossipInterval,
		Timeout:          DefaultTimeout,
		ChartFile:        DefaultChartFile,
	}
}

// RegisterFlags defines a flag on fs for every field of o, with the current
// value of the field as the flag's default.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.USEastAddress, "us-east.grpc-address", o.USEastAddress, "gRPC address of us-east's limiterd")
	fs.StringVar(&o.EUWestAddress, "eu-west.grpc-address", o.EUWestAddress, "gRPC address of eu-west's limiterd")
	fs.StringVar(&o.APSouthAddress, "ap-south.grpc-address", o.APSouthAddress, "gRPC address of ap-south's limiterd")
	fs.StringVar(&o.RulesFile, "rules.file", o.RulesFile, "rules file the stack runs with (for the rules' capacity and refill)")
	fs.StringVar(&o.ReconciledRule, "rule.reconciled", o.ReconciledRule, "token bucket rule reconciled across the regions")
	fs.StringVar(&o.UnreconciledRule, "rule.unreconciled", o.UnreconciledRule, "token bucket rule with reconcile: false, for contrast")
	fs.Float64Var(&o.Rate, "rate", o.Rate, "checks per second sent to each region, evenly spaced")
	fs.DurationVar(&o.Duration, "duration", o.Duration, fmt.Sprintf("length of each run, %v to %v", MinDuration, MaxDuration))
	fs.DurationVar(&o.GossipInterval, "gossip.interval", o.GossipInterval, "the stack's --gossip.interval")
	fs.DurationVar(&o.Timeout, "timeout", o.Timeout, "deadline of each check")
	fs.StringVar(&o.ChartFile, "chart", o.ChartFile, `SVG chart of the report to write ("" for none)`)
}

// Validate checks every option on its own; the rules are checked when the
// rules file is read. The error joins an *OptionError for each invalid one.
func (o *Options) Validate() error {
	var errs []error
	add := func(err error) { errs = append(errs, err) }
	seen := map[string]string{} // address -> region
	for _, t := range o.targets() {
		switch {
		case t.address == "":
			add(optErr(t.flag, "must not be empty"))
		case seen[t.address] != "":
			add(optErr(t.flag, "%q is %s's address too: the demo needs every region", t.address, seen[t.address]))
		default:
			seen[t.address] = t.region
		}
	}
	if o.RulesFile == "" {
		add(optErr("rules.file", "must not be empty"))
	}
	if o.ReconciledRule == "" {
		add(optErr("rule.reconciled", "must not be empty"))
	}
	if o.UnreconciledRule == "" {
		add(optErr("rule.unreconciled", "must not be empty"))
	}
	if o.ReconciledRule != "" && o.ReconciledRule == o.UnreconciledRule {
		add(optErr("rule.unreconciled", "%q is --rule.reconciled too", o.UnreconciledRule))
	}
	if math.IsNaN(o.Rate) || o.Rate <= 0 || o.Rate > MaxRate {
		add(optErr("rate", "must be in (0, %d], got %v", MaxRate, o.Rate))
	}
	if o.Duration < MinDuration || o.Duration > MaxDuration {
		add(optErr("duration", "must be in [%v, %v], got %v", MinDuration, MaxDuration, o.Duration))
	}
	if o.Rate > 0 && o.Rate <= MaxRate && o.Duration >= MinDuration && o.Rate*o.Duration.Seconds() < 1 {
		add(optErr("rate", "%v/s for %v sends no check", o.Rate, o.Duration))
	}
	if o.GossipInterval < gossip.MinInterval || o.GossipInterval > time.Minute {
		add(optErr("gossip.interval", "must be in [%v, 1m], got %v", gossip.MinInterval, o.GossipInterval))
	}
	if o.Timeout <= 0 || o.Timeout > MaxTimeout {
		add(optErr("timeout", "must be in (0, %v], got %v", MaxTimeout, o.Timeout))
	}
	return errors.Join(errs...)
}

// targets are the regions the demo drives, in the order of the report.
func (o *Options) targets() []*target {
	return []*target{
		{region: "us-east", address: o.USEastAddress, flag: "us-east.grpc-address"},
		{region: "eu-west", address: o.EUWestAddress, flag: "eu-west.grpc-address"},
		{region: "ap-south", address: o.APSouthAddress, flag: "ap-south.grpc-address"},
	}
}
