package demo

import (
	"errors"
	"flag"
	"io"
	"slices"
	"testing"
)

// invalidFlags returns the flags named by the *OptionErrors in err.
func invalidFlags(t *testing.T, err error) []string {
	t.Helper()
	var flags []string
	var walk func(error)
	walk = func(err error) {
		if joined, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range joined.Unwrap() {
				walk(e)
			}
			return
		}
		var oe *OptionError
		if !errors.As(err, &oe) {
			t.Errorf("error %v is not an *OptionError", err)
			return
		}
		flags = append(flags, oe.Flag)
	}
	if err != nil {
		walk(err)
	}
	return flags
}

func parse(t *testing.T, args ...string) Options {
	t.Helper()
	fs := flag.NewFlagSet("limiterdemo", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	opts := DefaultOptions()
	opts.RegisterFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatalf("parse %q: %v", args, err)
	}
	return opts
}

func TestValidateFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want []string // the flags named invalid; none for valid
	}{
		{name: "defaults"},
		{name: "other stack", args: []string{"--us-east.grpc-address=10.0.0.1:8081", "--eu-west.grpc-address=10.0.0.2:8081",
			"--ap-south.grpc-address=10.0.0.3:8081", "--rules.file=/etc/limiterd/rules.yml"}},
		{name: "shortest run", args: []string{"--duration=1s", "--rate=1"}},
		{name: "longest run", args: []string{"--duration=10m", "--rate=1000", "--gossip.interval=1m", "--timeout=1m"}},
		{name: "fastest gossip", args: []string{"--gossip.interval=100ms"}},
		{name: "slow rate", args: []string{"--rate=0.5", "--duration=2s"}},

		{name: "empty us-east", args: []string{"--us-east.grpc-address="}, want: []string{"us-east.grpc-address"}},
		{name: "empty eu-west", args: []string{"--eu-west.grpc-address="}, want: []string{"eu-west.grpc-address"}},
		{name: "empty ap-south", args: []string{"--ap-south.grpc-address="}, want: []string{"ap-south.grpc-address"}},
		{name: "one address twice", args: []string{"--eu-west.grpc-address=127.0.0.1:8081"}, want: []string{"eu-west.grpc-address"}},
		{name: "third region's address twice", args: []string{"--ap-south.grpc-address=127.0.0.1:8082"}, want: []string{"ap-south.grpc-address"}},
		{name: "empty rules file", args: []string{"--rules.file="}, want: []string{"rules.file"}},
		{name: "empty reconciled rule", args: []string{"--rule.reconciled="}, want: []string{"rule.reconciled"}},
		{name: "empty unreconciled rule", args: []string{"--rule.unreconciled="}, want: []string{"rule.unreconciled"}},
		{name: "one rule twice", args: []string{"--rule.unreconciled=global-demo"}, want: []string{"rule.unreconciled"}},
		{name: "zero rate", args: []string{"--rate=0"}, want: []string{"rate"}},
		{name: "negative rate", args: []string{"--rate=-20"}, want: []string{"rate"}},
		{name: "NaN rate", args: []string{"--rate=NaN"}, want: []string{"rate"}},
		{name: "infinite rate", args: []string{"--rate=+Inf"}, want: []string{"rate"}},
		{name: "rate too high", args: []string{"--rate=1001"}, want: []string{"rate"}},
		{name: "no check sent", args: []string{"--rate=0.5", "--duration=1s"}, want: []string{"rate"}},
		{name: "zero duration", args: []string{"--duration=0s"}, want: []string{"duration"}},
		{name: "short duration", args: []string{"--duration=999ms"}, want: []string{"duration"}},
		{name: "endless duration", args: []string{"--duration=10m1s"}, want: []string{"duration"}},
		{name: "gossip too fast", args: []string{"--gossip.interval=99ms"}, want: []string{"gossip.interval"}},
		{name: "gossip too slow", args: []string{"--gossip.interval=61s"}, want: []string{"gossip.interval"}},
		{name: "zero timeout", args: []string{"--timeout=0s"}, want: []string{"timeout"}},
		{name: "long timeout", args: []string{"--timeout=2m"}, want: []string{"timeout"}},
		{
			name: "everything wrong",
			args: []string{"--us-east.grpc-address=", "--eu-west.grpc-address=", "--rules.file=", "--rule.reconciled=",
				"--rule.unreconciled=", "--rate=0", "--duration=11m", "--gossip.interval=0s", "--timeout=-1s"},
			want: []string{"us-east.grpc-address", "eu-west.grpc-address", "rules.file", "rule.reconciled",
				"rule.unreconciled", "rate", "duration", "gossip.interval", "timeout"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := parse(t, tt.args...)
			err := opts.Validate()
			if len(tt.want) == 0 {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if !errors.Is(err, ErrInvalidOption) {
				t.Fatalf("Validate() = %v, want an error matching ErrInvalidOption", err)
			}
			if got := invalidFlags(t, err); !slices.Equal(got, tt.want) {
				t.Errorf("invalid flags = %q, want %q (error: %v)", got, tt.want, err)
			}
		})
	}
}

func TestDefaultsMatchTheStack(t *testing.T) {
	opts := parse(t)
	if opts != DefaultOptions() {
		t.Errorf("flag defaults %+v differ from DefaultOptions() %+v", opts, DefaultOptions())
	}
	if opts.USEastAddress != "127.0.0.1:8081" || opts.EUWestAddress != "127.0.0.1:8082" || opts.APSouthAddress != "127.0.0.1:8083" {
		t.Errorf("addresses %s, %s, %s: not those of scripts/stack.sh", opts.USEastAddress, opts.EUWestAddress, opts.APSouthAddress)
	}
}
