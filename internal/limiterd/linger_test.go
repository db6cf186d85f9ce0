package limiterd

import (
	"flag"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/redisstore/pipeline"
)

// TestRedisLingerFlag: --redis.linger defaults to the store's default
// linger, 0 turns it off, and a value that is negative, not a duration, or
// not less than --redis.max-queue-wait is refused naming the flag.
func TestRedisLingerFlag(t *testing.T) {
	parse := func(args ...string) (Options, error) {
		var o Options
		fs := flag.NewFlagSet("limiterd", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		o.RegisterFlags(fs)
		err := fs.Parse(append([]string{"--rules.file", "testdata/rules.yml", "--redis.addrs", "127.0.0.1:1"}, args...))
		return o, err
	}
	for _, c := range []struct {
		args []string
		want time.Duration // the store's linger
	}{
		{nil, pipeline.DefaultLinger},
		{[]string{"--redis.linger=0"}, 0},
		{[]string{"--redis.linger=1ms"}, time.Millisecond},
	} {
		o, err := parse(c.args...)
		if err != nil {
			t.Fatalf("%v: %v", c.args, err)
		}
		o = o.derived()
		if err := o.validate(); err != nil {
			t.Fatalf("%v: %v", c.args, err)
		}
		if got := o.RedisTuning.Linger; got != c.want {
			t.Errorf("%v: the store's linger is %v, want %v", c.args, got, c.want)
		}
	}
	if _, err := parse("--redis.linger=soon"); err == nil || !strings.Contains(err.Error(), "redis.linger") {
		t.Errorf("--redis.linger=soon: %v, want an error naming the flag", err)
	}
	for _, args := range [][]string{{"--redis.linger=-5ms"}, {"--redis.linger=50ms"}, {"--redis.linger=20ms", "--redis.max-queue-wait=10ms"}} {
		o, err := parse(args...)
		if err != nil {
			t.Fatalf("%v: %v", args, err)
		}
		o.Logger = quietLogger()
		if _, err := New(o); err == nil || !strings.Contains(err.Error(), "--redis.linger: must be") {
			t.Errorf("%v: New = %v, want an error naming --redis.linger", args, err)
		}
	}
}

// TestHandoffMaxWindowFlag: --region.handoff-max-window is off (0) by
// default, takes 1s to 720h, and anything else is refused naming the flag.
func TestHandoffMaxWindowFlag(t *testing.T) {
	parse := func(args ...string) Options {
		var o Options
		fs := flag.NewFlagSet("limiterd", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		o.RegisterFlags(fs)
		if err := fs.Parse(append([]string{"--rules.file", "testdata/rules.yml"}, args...)); err != nil {
			t.Fatal(err)
		}
		o.Logger = quietLogger()
		o = o.derived()
		return o
	}
	for _, c := range []struct {
		arg  string
		want time.Duration
	}{{"", 0}, {"--region.handoff-max-window=1s", time.Second}, {"--region.handoff-max-window=720h", 720 * time.Hour}} {
		var args []string
		if c.arg != "" {
			args = append(args, c.arg)
		}
		o := parse(args...)
		if err := o.validate(); err != nil || o.Region.HandoffMaxWindow != c.want {
			t.Errorf("%q: %v, %v; want %v", c.arg, o.Region.HandoffMaxWindow, err, c.want)
		}
	}
	for _, bad := range []string{"-1s", "500ms", "721h"} {
		o := parse("--region.handoff-max-window=" + bad)
		if err := o.validate(); err == nil || !strings.Contains(err.Error(), "--region.handoff-max-window: must be") {
			t.Errorf("%s: %v, want an error naming --region.handoff-max-window", bad, err)
		}
	}
}
