package loadgen

import (
	"errors"
	"flag"
	"io"
	"slices"
	"strings"
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

func TestValidateFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string // the one flag named invalid; "" for valid
	}{
		{name: "defaults", args: nil},
		{name: "health without rule", args: []string{"--mode=health", "--rule="}},
		{name: "open loop zipf with accuracy", args: []string{"--rate=500", "--key-dist=zipf", "--zipf-s=1.5", "--expect-rate=10", "--expect-burst=20", "--requests=100", "--warmup=0s"}},
		{name: "one key one conn", args: []string{"--keys=1", "--concurrency=1", "--conns=1"}},
		{name: "max duration", args: []string{"--duration=10m"}},

		{name: "empty target", args: []string{"--target="}, want: "target"},
		{name: "unknown mode", args: []string{"--mode=ping"}, want: "mode"},
		{name: "empty rule", args: []string{"--rule="}, want: "rule"},
		{name: "zero concurrency", args: []string{"--concurrency=0", "--conns=1"}, want: "concurrency"},
		{name: "huge concurrency", args: []string{"--concurrency=1000000"}, want: "concurrency"},
		{name: "negative rate", args: []string{"--rate=-1"}, want: "rate"},
		{name: "NaN rate", args: []string{"--rate=NaN"}, want: "rate"},
		{name: "infinite rate", args: []string{"--rate=+Inf"}, want: "rate"},
		{name: "zero duration", args: []string{"--duration=0s"}, want: "duration"},
		{name: "negative duration", args: []string{"--duration=-1s"}, want: "duration"},
		{name: "endless duration", args: []string{"--duration=11m"}, want: "duration"},
		{name: "negative requests", args: []string{"--requests=-5"}, want: "requests"},
		{name: "zero keys", args: []string{"--keys=0"}, want: "keys"},
		{name: "too many keys", args: []string{"--keys=1000001"}, want: "keys"},
		{name: "unknown key dist", args: []string{"--key-dist=normal"}, want: "key-dist"},
		{name: "zipf s of 1", args: []string{"--zipf-s=1"}, want: "zipf-s"},
		{name: "zipf s below 1", args: []string{"--key-dist=zipf", "--zipf-s=0.5"}, want: "zipf-s"},
		{name: "key prefix too long", args: []string{"--key-prefix=" + strings.Repeat("k", 510)}, want: "key-prefix"},
		{name: "zero cost", args: []string{"--cost=0"}, want: "cost"},
		{name: "negative cost", args: []string{"--cost=-1"}, want: "cost"},
		{name: "infinite cost", args: []string{"--cost=Inf"}, want: "cost"},
		{name: "zero conns", args: []string{"--conns=0"}, want: "conns"},
		{name: "more conns than workers", args: []string{"--concurrency=2", "--conns=3"}, want: "conns"},
		{name: "negative warmup", args: []string{"--warmup=-1s"}, want: "warmup"},
		{name: "long warmup", args: []string{"--warmup=2m"}, want: "warmup"},
		{name: "zero timeout", args: []string{"--timeout=0s"}, want: "timeout"},
		{name: "negative expect rate", args: []string{"--expect-rate=-1", "--expect-burst=5"}, want: "expect-rate"},
		{name: "expect rate in health mode", args: []string{"--mode=health", "--expect-rate=1", "--expect-burst=5"}, want: "expect-rate"},
		{name: "expect rate without burst", args: []string{"--expect-rate=10"}, want: "expect-burst"},
		{name: "expect burst without rate", args: []string{"--expect-burst=10"}, want: "expect-burst"},
		{name: "NaN expect burst", args: []string{"--expect-rate=10", "--expect-burst=NaN"}, want: "expect-burst"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := DefaultOptions()
			fs := flag.NewFlagSet("test", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			o.RegisterFlags(fs)
			if err := fs.Parse(tt.args); err != nil {
				t.Fatalf("parse %q: %v", tt.args, err)
			}
			err := o.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if !errors.Is(err, ErrInvalidOption) {
				t.Fatalf("Validate() = %v, want an error matching ErrInvalidOption", err)
			}
			if got := invalidFlags(t, err); !slices.Equal(got, []string{tt.want}) {
				t.Fatalf("Validate() named flags %q, want [%q] (error: %v)", got, tt.want, err)
			}
			if fs.Lookup(tt.want) == nil {
				t.Fatalf("the error names --%s, which is not a registered flag", tt.want)
			}
		})
	}
}

func TestValidateJoinsEveryInvalidOption(t *testing.T) {
	o := DefaultOptions()
	o.Concurrency, o.Conns, o.Duration = 0, 0, 0
	got := invalidFlags(t, o.Validate())
	want := []string{"concurrency", "duration", "conns"}
	if !slices.Equal(got, want) {
		t.Fatalf("Validate() named flags %q, want %q", got, want)
	}
}

func TestRunRejectsInvalidOptions(t *testing.T) {
	o := DefaultOptions()
	o.Duration = 0
	res, err := Run(t.Context(), o)
	if !errors.Is(err, ErrInvalidOption) || res != nil {
		t.Fatalf("Run() = %v, %v; want nil and an error matching ErrInvalidOption", res, err)
	}
}
