package reconciler

import (
	"flag"
	"io"
	"reflect"
	"strings"
	"testing"

	"github.com/limiterd/limiterd/internal/tracing"
)

// TestFlagDefaults: the flags parsed with no arguments are DefaultOptions,
// the one place the defaults are written; validate reports each missing
// required flag and the zero values a flag cannot take, and changes
// nothing.
func TestFlagDefaults(t *testing.T) {
	var o Options
	fs := flag.NewFlagSet("reconciler", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o.RegisterFlags(fs)
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(o, DefaultOptions()) {
		t.Fatalf("flags with no arguments:\n%+v\nDefaultOptions:\n%+v", o, DefaultOptions())
	}
	before := o
	err := o.validate()
	if !reflect.DeepEqual(o, before) {
		t.Fatalf("validate changed its input:\n%+v\nto\n%+v", before, o)
	}
	for _, f := range []string{"--region:", "--region.topology-file: required", "--rules.file: required", "--nats.url: required", "--redis.addrs: required"} {
		if err == nil || !strings.Contains(err.Error(), f) {
			t.Errorf("defaults without the required flags: %v; want it to name %s", err, f)
		}
	}
	var zero Options
	err = zero.validate()
	for _, f := range []string{"--gossip.interval:", "--gossip.ack-wait:", "--stream.max-age:", "--stream.max-bytes:", "--stream.replicas:",
		"--rules.max-rules:", "--gossip.max-message-bytes:", "--apply.partitions:", "--apply.lease-ttl:", "--http.listen-address: required"} {
		if err == nil || !strings.Contains(err.Error(), f) {
			t.Errorf("zero Options: %v; want it to name %s", err, f)
		}
	}
}

// TestTraceFlags: the reconciler has limiterd's --trace.* flags, as
// package tracing defines them, and refuses a bad one naming it.
func TestTraceFlags(t *testing.T) {
	var o Options
	fs := flag.NewFlagSet("reconciler", flag.ContinueOnError)
	o.RegisterFlags(fs)
	var want tracing.Options
	tfs := flag.NewFlagSet("tracing", flag.ContinueOnError)
	want.RegisterFlags(tfs)
	tfs.VisitAll(func(f *flag.Flag) {
		got := fs.Lookup(f.Name)
		if got == nil || got.DefValue != f.DefValue || got.Usage != f.Usage {
			t.Errorf("--%s: %+v, want %+v", f.Name, got, f)
		}
	})
	if err := fs.Parse([]string{"--trace.otlp-endpoint", "collector:4317", "--trace.insecure", "--trace.sample-ratio", "0.5"}); err != nil {
		t.Fatal(err)
	}
	if w := (tracing.Options{Endpoint: "collector:4317", Insecure: true, SampleRatio: 0.5}); o.Trace != w {
		t.Errorf("parsed %+v, want %+v", o.Trace, w)
	}
	o.Trace.SampleRatio = 2
	if err := o.validate(); err == nil || !strings.Contains(err.Error(), "--trace.sample-ratio") {
		t.Errorf("a ratio of 2: %v, want an error naming --trace.sample-ratio", err)
	}
}
