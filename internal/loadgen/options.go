package loadgen

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"strconv"
	"time"
)

// Mode selects the RPC a load run sends.
type Mode string

// The modes of a load run.
const (
	// ModeCheck sends limiter.v1.Limiter/Check, the call being measured.
	ModeCheck Mode = "check"
	// ModeHealth sends grpc.health.v1.Health/Check: the same transport
	// without the limiter, the ceiling to compare ModeCheck against.
	ModeHealth Mode = "health"
)

// KeyDist names how a load run spreads its requests over the keys.
type KeyDist string

// The key distributions.
const (
	// Uniform picks every key with the same probability.
	Uniform KeyDist = "uniform"
	// Zipf picks key i (from 0) with probability proportional to
	// (i+1)^-s: a few hot keys take most of the traffic.
	Zipf KeyDist = "zipf"
)

// Defaults of the options and of their flags.
const (
	DefaultTarget      = "127.0.0.1:8081"
	DefaultMode        = ModeCheck
	DefaultRule        = "api"
	DefaultConcurrency = 16
	DefaultDuration    = 10 * time.Second
	DefaultKeys        = 1000
	DefaultKeyDist     = Uniform
	DefaultZipfS       = 1.1
	DefaultKeyPrefix   = "bench:"
	DefaultCost        = 1
	DefaultConns       = 4
	DefaultWarmup      = time.Second
	DefaultTimeout     = 5 * time.Second
)

// Bounds of the options: a load run always stops by itself and its memory
// stays small.
const (
	MaxConcurrency = 10000
	MaxConns       = 256
	MaxDuration    = 10 * time.Minute
	MaxWarmup      = time.Minute
	MaxTimeout     = time.Minute
	MaxKeys        = 1_000_000
	MaxRate        = 10_000_000
	// MaxKeyLen is the longest key limiterd accepts, in bytes.
	MaxKeyLen = 512
)

// ErrInvalidOption is matched (with errors.Is) by every *OptionError.
var ErrInvalidOption = errors.New("invalid option")

// OptionError reports an invalid option value, naming its flag.
type OptionError struct {
	// Flag is the flag name without dashes, such as "concurrency".
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

// Options configures a load run. The zero Options is not valid: start from
// DefaultOptions. Each field is set by the flag named in its comment.
type Options struct {
	// Target is the gRPC address of limiterd (--target).
	Target string
	// Mode is the RPC to send (--mode).
	Mode Mode
	// Rule is the rule id of every check (--rule); unused in ModeHealth.
	Rule string
	// Concurrency is the number of workers, each with one request in flight
	// at a time (--concurrency).
	Concurrency int
	// Rate is the target of checks per second over all workers (--rate).
	// 0 runs a closed loop: each worker sends as soon as its previous
	// answer arrives. Above 0 the run is open-loop: requests are due on a
	// fixed schedule and latency counts from the time a request was due.
	Rate float64
	// Duration is how long the measured part of the run lasts (--duration).
	Duration time.Duration
	// Requests caps the measured requests; 0 means no cap (--requests).
	Requests int64
	// Keys is the number of distinct keys (--keys).
	Keys int
	// KeyDist spreads the requests over the keys (--key-dist).
	KeyDist KeyDist
	// ZipfS is the exponent of the Zipf distribution, > 1 (--zipf-s).
	ZipfS float64
	// KeyPrefix starts every key; key i is KeyPrefix followed by i
	// (--key-prefix). Buckets are only fresh under a prefix not used before.
	KeyPrefix string
	// Cost is the tokens every check spends (--cost).
	Cost float64
	// Conns is the number of gRPC connections; worker w uses connection
	// w mod Conns (--conns).
	Conns int
	// Warmup runs before the measured part and is not counted in the
	// headline results (--warmup).
	Warmup time.Duration
	// Timeout is the deadline of each request and of connecting (--timeout).
	Timeout time.Duration
	// Seed seeds the key choice; 0 picks a random seed (--seed).
	Seed uint64
	// ExpectRate is the rule's refill rate per key per second; above 0 the
	// result carries an accuracy report (--expect-rate).
	ExpectRate float64
	// ExpectBurst is the rule's capacity per key, in tokens (--expect-burst).
	ExpectBurst float64
}

// DefaultOptions returns the options of a run with every flag at its default.
func DefaultOptions() Options {
	return Options{
		Target:      DefaultTarget,
		Mode:        DefaultMode,
		Rule:        DefaultRule,
		Concurrency: DefaultConcurrency,
		Duration:    DefaultDuration,
		Keys:        DefaultKeys,
		KeyDist:     DefaultKeyDist,
		ZipfS:       DefaultZipfS,
		KeyPrefix:   DefaultKeyPrefix,
		Cost:        DefaultCost,
		Conns:       DefaultConns,
		Warmup:      DefaultWarmup,
		Timeout:     DefaultTimeout,
	}
}

// RegisterFlags defines a flag on fs for every field of o, with the current
// value of the field as the flag's default.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.Target, "target", o.Target, "gRPC address of limiterd")
	fs.StringVar((*string)(&o.Mode), "mode", string(o.Mode),
		`RPC to send: "check" (limiter.v1.Limiter/Check) or "health" (grpc.health.v1.Health/Check, the transport ceiling)`)
	fs.StringVar(&o.Rule, "rule", o.Rule, "rule id of every check")
	fs.IntVar(&o.Concurrency, "concurrency", o.Concurrency, "number of workers, each with one request in flight")
	fs.Float64Var(&o.Rate, "rate", o.Rate,
		"target checks per second over all workers, open loop with latency from the due time; 0 = closed loop, as fast as possible")
	fs.DurationVar(&o.Duration, "duration", o.Duration, "length of the measured run, at most "+MaxDuration.String())
	fs.Int64Var(&o.Requests, "requests", o.Requests, "stop after this many measured requests; 0 = no cap")
	fs.IntVar(&o.Keys, "keys", o.Keys, "number of distinct keys")
	fs.StringVar((*string)(&o.KeyDist), "key-dist", string(o.KeyDist), `key distribution: "uniform" or "zipf"`)
	fs.Float64Var(&o.ZipfS, "zipf-s", o.ZipfS, "exponent of the zipf key distribution, > 1")
	fs.StringVar(&o.KeyPrefix, "key-prefix", o.KeyPrefix, "prefix of every key; use a new one for fresh buckets")
	fs.Float64Var(&o.Cost, "cost", o.Cost, "tokens every check spends")
	fs.IntVar(&o.Conns, "conns", o.Conns, "gRPC connections shared round-robin by the workers")
	fs.DurationVar(&o.Warmup, "warmup", o.Warmup, "load sent before the measured run and not counted")
	fs.DurationVar(&o.Timeout, "timeout", o.Timeout, "deadline of each request and of connecting")
	fs.Uint64Var(&o.Seed, "seed", o.Seed, "seed of the key choice; 0 = random")
	fs.Float64Var(&o.ExpectRate, "expect-rate", o.ExpectRate,
		"refill rate of the rule per key per second, for the accuracy report; 0 = no report")
	fs.Float64Var(&o.ExpectBurst, "expect-burst", o.ExpectBurst, "capacity of the rule per key in tokens, for the accuracy report")
}

// Validate checks every option. The error joins an *OptionError for each
// invalid one.
func (o *Options) Validate() error {
	var errs []error
	add := func(err error) { errs = append(errs, err) }
	finite := func(f float64) bool { return !math.IsNaN(f) && !math.IsInf(f, 0) }

	if o.Target == "" {
		add(optErr("target", "must not be empty"))
	}
	switch o.Mode {
	case ModeCheck:
		if o.Rule == "" {
			add(optErr("rule", "must not be empty in %s mode", ModeCheck))
		}
	case ModeHealth:
	default:
		add(optErr("mode", "must be %q or %q, got %q", ModeCheck, ModeHealth, o.Mode))
	}
	if o.Concurrency < 1 || o.Concurrency > MaxConcurrency {
		add(optErr("concurrency", "must be between 1 and %d, got %d", MaxConcurrency, o.Concurrency))
	}
	if !finite(o.Rate) || o.Rate < 0 || o.Rate > MaxRate {
		add(optErr("rate", "must be between 0 and %d, got %v", MaxRate, o.Rate))
	}
	if o.Duration <= 0 || o.Duration > MaxDuration {
		add(optErr("duration", "must be > 0 and at most %s, got %s", MaxDuration, o.Duration))
	}
	if o.Requests < 0 {
		add(optErr("requests", "must be >= 0, got %d", o.Requests))
	}
	if o.Keys < 1 || o.Keys > MaxKeys {
		add(optErr("keys", "must be between 1 and %d, got %d", MaxKeys, o.Keys))
	}
	switch o.KeyDist {
	case Uniform, Zipf:
	default:
		add(optErr("key-dist", "must be %q or %q, got %q", Uniform, Zipf, o.KeyDist))
	}
	if !finite(o.ZipfS) || o.ZipfS <= 1 {
		add(optErr("zipf-s", "must be a finite number > 1, got %v", o.ZipfS))
	}
	if o.Keys >= 1 {
		if n := len(o.KeyPrefix) + len(strconv.Itoa(o.Keys-1)); n > MaxKeyLen {
			add(optErr("key-prefix", "makes keys of %d bytes, more than %d", n, MaxKeyLen))
		}
	}
	if !finite(o.Cost) || o.Cost <= 0 {
		add(optErr("cost", "must be a finite number > 0, got %v", o.Cost))
	}
	if o.Conns < 1 || o.Conns > MaxConns {
		add(optErr("conns", "must be between 1 and %d, got %d", MaxConns, o.Conns))
	} else if o.Concurrency >= 1 && o.Conns > o.Concurrency {
		add(optErr("conns", "must not exceed --concurrency (%d), got %d", o.Concurrency, o.Conns))
	}
	if o.Warmup < 0 || o.Warmup > MaxWarmup {
		add(optErr("warmup", "must be between 0 and %s, got %s", MaxWarmup, o.Warmup))
	}
	if o.Timeout <= 0 || o.Timeout > MaxTimeout {
		add(optErr("timeout", "must be > 0 and at most %s, got %s", MaxTimeout, o.Timeout))
	}
	switch {
	case !finite(o.ExpectRate) || o.ExpectRate < 0:
		add(optErr("expect-rate", "must be a finite number >= 0, got %v", o.ExpectRate))
	case o.ExpectRate > 0 && o.Mode == ModeHealth:
		add(optErr("expect-rate", "has no meaning in %s mode", ModeHealth))
	}
	switch {
	case !finite(o.ExpectBurst) || o.ExpectBurst < 0:
		add(optErr("expect-burst", "must be a finite number >= 0, got %v", o.ExpectBurst))
	case o.ExpectRate > 0 && o.ExpectBurst == 0:
		add(optErr("expect-burst", "must be > 0 when --expect-rate is set"))
	case o.ExpectRate == 0 && o.ExpectBurst > 0:
		add(optErr("expect-burst", "needs --expect-rate"))
	}
	return errors.Join(errs...)
}

// accuracy reports whether the run computes an accuracy report.
func (o *Options) accuracy() bool { return o.Mode == ModeCheck && o.ExpectRate > 0 }
