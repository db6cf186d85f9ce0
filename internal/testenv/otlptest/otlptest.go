// Package otlptest is an OpenTelemetry collector in the test's process: an
// OTLP/gRPC trace receiver on a free loopback port that keeps every span
// it is sent, with its resource's service and region.
package otlptest

import (
	"context"
	"net"
	"slices"
	"sync"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
)

// Receiver keeps the spans it is sent. Make it with Start.
type Receiver struct {
	coltracepb.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans []Span
}

// Span is one span received, with its resource's service.name and
// cloud.region.
type Span struct {
	Service, Region string
	Span            *tracepb.Span
}

// Start starts a receiver on a free loopback port, stopped with t's
// cleanup, and returns it and its address (host:port, in plaintext).
func Start(t testing.TB) (*Receiver, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &Receiver{}
	srv := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(srv, r)
	go func() { _ = srv.Serve(lis) }() // until srv.Stop
	t.Cleanup(srv.Stop)
	return r, lis.Addr().String()
}

// Export keeps the spans of req.
func (r *Receiver) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		attrs := map[string]string{}
		for _, kv := range rs.GetResource().GetAttributes() {
			attrs[kv.GetKey()] = kv.GetValue().GetStringValue()
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				r.spans = append(r.spans, Span{attrs["service.name"], attrs["cloud.region"], s})
			}
		}
	}
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

// All returns the spans received so far.
func (r *Receiver) All() []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.spans)
}
