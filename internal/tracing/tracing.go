// Package tracing sends the daemons' spans to an OpenTelemetry collector
// over OTLP/gRPC: off unless an endpoint is named, sampled at a ratio,
// and following the caller's decision when the caller sent a trace
// context (a check forwarded from another region keeps its trace). A
// message carries a span context in its headers (InjectHeader,
// SpanContextFromHeader), and a new root span linked to a sampled span is
// sampled (the reconciler's apply of a sampled check's spends).
//
// With tracing off nothing is installed: no stats handler on the gRPC
// server or clients, and the engine's SpanFromContext finds no span.
package tracing

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	sdkresource "go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"
)

// DefaultSampleRatio is the share of traces sampled where no caller
// decided: one check in a hundred.
const DefaultSampleRatio = 0.01

// Options say where spans go.
type Options struct {
	// Endpoint is the collector's OTLP/gRPC address, host:port; empty:
	// tracing off.
	Endpoint string
	// Insecure sends spans in plaintext (a collector on the same host or
	// pod); otherwise over TLS with the system's roots.
	Insecure bool
	// SampleRatio is the share of new traces sampled, in [0, 1].
	SampleRatio float64
}

// Default returns the defaults: off, one in a hundred when on.
func Default() Options { return Options{SampleRatio: DefaultSampleRatio} }

// RegisterFlags defines o's flags on fs, with Default's defaults.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	d := Default()
	fs.StringVar(&o.Endpoint, "trace.otlp-endpoint", d.Endpoint, "OpenTelemetry collector to send spans to over OTLP/gRPC, host:port (empty: tracing off)")
	fs.BoolVar(&o.Insecure, "trace.insecure", d.Insecure, "send spans to --trace.otlp-endpoint in plaintext instead of TLS")
	fs.Float64Var(&o.SampleRatio, "trace.sample-ratio", d.SampleRatio, "share of new traces sampled, 0 to 1; a call that carries a trace context follows its caller's decision")
}

// On says whether tracing is on.
func (o Options) On() bool { return o.Endpoint != "" }

// Validate reports bad options, naming the flag.
func (o Options) Validate() error {
	var errs []error
	if o.Endpoint != "" {
		if _, port, err := net.SplitHostPort(o.Endpoint); err != nil || port == "" {
			errs = append(errs, fmt.Errorf("--trace.otlp-endpoint: want host:port, got %q", o.Endpoint))
		}
	}
	if !(o.SampleRatio >= 0 && o.SampleRatio <= 1) {
		errs = append(errs, fmt.Errorf("--trace.sample-ratio: must be 0 to 1, got %v", o.SampleRatio))
	}
	return errors.Join(errs...)
}

// Tracer is the tracing of one daemon: its provider and the gRPC options
// that put a span on every call served and sent. Its zero value (and nil)
// is tracing off.
type Tracer struct {
	provider *sdktrace.TracerProvider
	prop     propagation.TextMapPropagator
}

// Start starts the tracing of service (limiterd, reconciler) in region,
// as instance; with o off it returns nil. No connection is made until
// the first spans are sent.
func Start(o Options, service, region, instance string) (*Tracer, error) {
	if !o.On() {
		return nil, nil
	}
	if err := o.Validate(); err != nil {
		return nil, err
	}
	opts := []otlptracegrpc.Option{otlptracegrpc.WithEndpoint(o.Endpoint)}
	if o.Insecure {
		opts = append(opts, otlptracegrpc.WithInsecure())
	}
	exp, err := otlptracegrpc.New(context.Background(), opts...)
	if err != nil {
		return nil, fmt.Errorf("--trace.otlp-endpoint: %w", err)
	}
	res := sdkresource.NewSchemaless(
		attribute.String("service.name", service),
		attribute.String("service.instance.id", instance),
		attribute.String("cloud.region", region),
	)
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp),
		sdktrace.WithResource(res),
		sdktrace.WithSampler(sampler(o.SampleRatio)),
	)
	return &Tracer{provider: tp, prop: propagation.TraceContext{}}, nil
}

// sampler follows the parent's decision; a new root is sampled at ratio,
// or always when it links to a sampled span (the apply of a sampled
// check's spends: its own trace, found from the check's by the link).
func sampler(ratio float64) sdktrace.Sampler {
	return sdktrace.ParentBased(linkSampler{sdktrace.TraceIDRatioBased(ratio)})
}

// linkSampler samples a span linked to a sampled span, and the others as
// its Sampler does.
type linkSampler struct{ sdktrace.Sampler }

func (s linkSampler) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	for _, l := range p.Links {
		if l.SpanContext.IsSampled() {
			return sdktrace.SamplingResult{Decision: sdktrace.RecordAndSample,
				Tracestate: trace.SpanContextFromContext(p.ParentContext).TraceState()}
		}
	}
	return s.Sampler.ShouldSample(p)
}

func (s linkSampler) Description() string {
	return "LinkedOr{" + s.Sampler.Description() + "}"
}

// ServerHandler is the stats handler for a gRPC server, nil when off.
func (t *Tracer) ServerHandler() stats.Handler {
	if t == nil {
		return nil
	}
	return otelgrpc.NewServerHandler(otelgrpc.WithTracerProvider(t.provider), otelgrpc.WithPropagators(t.prop))
}

// DialOptions are a gRPC client's options that trace its calls and send
// their trace context; none when off.
func (t *Tracer) DialOptions() []grpc.DialOption {
	if t == nil {
		return nil
	}
	return []grpc.DialOption{grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(t.provider), otelgrpc.WithPropagators(t.prop)))}
}

// Provider is the tracer provider; a no-op one when off.
func (t *Tracer) Provider() trace.TracerProvider {
	if t == nil {
		return noop.NewTracerProvider()
	}
	return t.provider
}

// Shutdown sends the spans still buffered, waiting at most timeout.
func (t *Tracer) Shutdown(timeout time.Duration) error {
	if t == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return t.provider.Shutdown(ctx)
}
