package tracing

import (
	"strings"
	"testing"
)

// TestValidate: a bad endpoint or ratio is refused, naming its flag; off
// is a nil Tracer that installs nothing.
func TestValidate(t *testing.T) {
	for _, c := range []struct {
		o    Options
		want string
	}{
		{Options{Endpoint: "collector", SampleRatio: 0.5}, "--trace.otlp-endpoint"},
		{Options{Endpoint: "collector:", SampleRatio: 0.5}, "--trace.otlp-endpoint"},
		{Options{SampleRatio: 1.5}, "--trace.sample-ratio"},
		{Options{SampleRatio: -0.1}, "--trace.sample-ratio"},
	} {
		if err := c.o.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error naming %s", c.o, err, c.want)
		}
	}
	if err := (Options{Endpoint: "collector:4317", SampleRatio: 1}).Validate(); err != nil {
		t.Errorf("a good endpoint: %v", err)
	}
	tr, err := Start(Default(), "limiterd", "a", "i")
	if err != nil || tr != nil || tr.ServerHandler() != nil || tr.DialOptions() != nil || tr.Shutdown(0) != nil {
		t.Errorf("off: %v, %v", tr, err)
	}
}
