package limiterd

import (
	"errors"
	"flag"
	"time"
)

// ServerOptions are the listeners: the gRPC check API and the HTTP one,
// their TLS, their bounds and how they shut down.
type ServerOptions struct {
	// GRPCAddress is the check API's listen address; port 0 picks one.
	GRPCAddress string
	// HTTPAddress serves /metrics, /healthz and /readyz.
	HTTPAddress string
	// Profiling serves Go's profiles (net/http/pprof) under /debug/pprof/
	// on the HTTP listener.
	Profiling bool
	// TLSCertFile and TLSKeyFile enable TLS on the gRPC listener;
	// TLSClientCAFile also requires client certificates signed by it (mTLS).
	TLSCertFile, TLSKeyFile, TLSClientCAFile string
	// HTTPTLSCertFile and HTTPTLSKeyFile enable TLS on the HTTP listener
	// (and the forward-auth one); HTTPTLSClientCAFile also requires client
	// certificates signed by it.
	HTTPTLSCertFile, HTTPTLSKeyFile, HTTPTLSClientCAFile string

	// GRPCMaxStreams bounds the concurrent streams of one gRPC connection
	// (0: DefaultGRPCMaxStreams).
	GRPCMaxStreams int
	// MaxConnections bounds the open connections of each listener, gRPC
	// and HTTP (0: DefaultMaxConnections).
	MaxConnections int

	// ShutdownDelay is how long the daemon stays up, not ready, before it
	// stops accepting checks, so load balancers see it leave.
	ShutdownDelay time.Duration
	// GracePeriod bounds how long in-flight checks may take to finish.
	GracePeriod time.Duration

	// EnvoyQuotaHeaders adds the quota headers of pkg/httplimit to the
	// answers of Envoy's rate limit service (response_headers_to_add). Off
	// by default, as in Envoy's reference service: Envoy's filter can make
	// its own from the statuses (enable_x_ratelimit_headers).
	EnvoyQuotaHeaders bool
}

// RegisterFlags defines s's flags on fs, with DefaultOptions' defaults.
func (s *ServerOptions) RegisterFlags(fs *flag.FlagSet) {
	d := DefaultOptions().Server
	fs.StringVar(&s.GRPCAddress, "grpc.listen-address", d.GRPCAddress, "address of the gRPC check API")
	fs.StringVar(&s.HTTPAddress, "http.listen-address", d.HTTPAddress, "address serving /metrics, /healthz and /readyz")
	fs.BoolVar(&s.Profiling, "http.pprof", d.Profiling, "serve Go's CPU, heap and goroutine profiles under /debug/pprof/ on the HTTP listener")
	fs.StringVar(&s.TLSCertFile, "grpc.tls-cert-file", d.TLSCertFile, "TLS certificate of the gRPC listener (PEM)")
	fs.StringVar(&s.TLSKeyFile, "grpc.tls-key-file", d.TLSKeyFile, "TLS private key of the gRPC listener (PEM)")
	fs.IntVar(&s.GRPCMaxStreams, "grpc.max-concurrent-streams", d.GRPCMaxStreams, "most checks in flight on one gRPC connection (more wait for a free stream)")
	fs.IntVar(&s.MaxConnections, "server.max-connections", d.MaxConnections, "most open connections of each listener, gRPC and HTTP (more wait to be accepted)")
	fs.StringVar(&s.TLSClientCAFile, "grpc.tls-client-ca-file", d.TLSClientCAFile, "CA bundle that client certificates must chain to (enables mTLS)")
	fs.StringVar(&s.HTTPTLSCertFile, "http.tls-cert-file", d.HTTPTLSCertFile, "TLS certificate of the HTTP listener, and of the forward-auth one (PEM)")
	fs.StringVar(&s.HTTPTLSKeyFile, "http.tls-key-file", d.HTTPTLSKeyFile, "TLS private key of the HTTP listener (PEM)")
	fs.StringVar(&s.HTTPTLSClientCAFile, "http.tls-client-ca-file", d.HTTPTLSClientCAFile, "CA bundle that HTTP clients' certificates must chain to (enables mTLS on the HTTP and forward-auth listeners)")
	fs.DurationVar(&s.ShutdownDelay, "shutdown.delay", d.ShutdownDelay, "time not ready before the listeners close, on SIGTERM")
	fs.DurationVar(&s.GracePeriod, "shutdown.grace-period", d.GracePeriod, "longest wait for in-flight checks on shutdown")
	fs.BoolVar(&s.EnvoyQuotaHeaders, "envoy.quota-headers", d.EnvoyQuotaHeaders, "add the quota headers (RateLimit-*, X-RateLimit-*, Retry-After) to Envoy rate limit answers; off: Envoy's filter can make its own from the statuses (enable_x_ratelimit_headers)")
}

// Validate reports every bad field, each naming its flag.
func (s ServerOptions) Validate() error {
	var e flagErrs
	e.add((s.TLSCertFile == "") != (s.TLSKeyFile == ""), "--grpc.tls-cert-file and --grpc.tls-key-file: give both or neither")
	e.add(s.TLSClientCAFile != "" && s.TLSCertFile == "", "--grpc.tls-client-ca-file: needs --grpc.tls-cert-file and --grpc.tls-key-file")
	e.add((s.HTTPTLSCertFile == "") != (s.HTTPTLSKeyFile == ""), "--http.tls-cert-file and --http.tls-key-file: give both or neither")
	e.add(s.HTTPTLSClientCAFile != "" && s.HTTPTLSCertFile == "", "--http.tls-client-ca-file: needs --http.tls-cert-file and --http.tls-key-file")
	e.add(s.GRPCMaxStreams < 1 || s.GRPCMaxStreams > 1<<20, "--grpc.max-concurrent-streams: must be 1 to %d, got %d", 1<<20, s.GRPCMaxStreams)
	e.add(s.MaxConnections < 1 || s.MaxConnections > 1<<20, "--server.max-connections: must be 1 to %d, got %d", 1<<20, s.MaxConnections)
	e.add(s.GracePeriod < 0, "--shutdown.grace-period: must be >= 0, got %v", s.GracePeriod)
	e.add(s.ShutdownDelay < 0, "--shutdown.delay: must be >= 0, got %v", s.ShutdownDelay)
	return errors.Join(e...)
}
