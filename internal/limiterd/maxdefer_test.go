package limiterd

import (
	"flag"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/spendpub"
)

// TestGossipMaxDeferFlag: --gossip.max-defer defaults to
// spendpub.DefaultMaxDefer, and is 0 or between the interval and a
// minute; a bad value's error names the flag.
func TestGossipMaxDeferFlag(t *testing.T) {
	var o Options
	fs := flag.NewFlagSet("limiterd", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o.RegisterFlags(fs)
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	if o.NATS.GossipMaxDefer != spendpub.DefaultMaxDefer {
		t.Fatalf("--gossip.max-defer default %v, want %v", o.NATS.GossipMaxDefer, spendpub.DefaultMaxDefer)
	}
	for _, tt := range []struct {
		name     string
		maxDefer time.Duration
		bad      bool
	}{
		{"off", 0, false},
		{"one interval", time.Second, false},
		{"default", spendpub.DefaultMaxDefer, false},
		{"a minute", time.Minute, false},
		{"under the interval", 500 * time.Millisecond, true},
		{"negative", -time.Second, true},
		{"over a minute", time.Minute + time.Second, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			o := DefaultOptions()
			o.Rules.File, o.Logger, o.NATS.GossipInterval, o.NATS.GossipMaxDefer = "testdata/rules.yml", quietLogger(), time.Second, tt.maxDefer
			_, err := New(o)
			if got := err != nil && strings.Contains(err.Error(), "--gossip.max-defer"); got != tt.bad {
				t.Fatalf("--gossip.max-defer %v: err = %v, want an error naming the flag: %v", tt.maxDefer, err, tt.bad)
			}
		})
	}
}
