// Package opshttp serves a daemon's operational endpoints: /metrics,
// /healthz (the process is alive) and /readyz (it should get traffic).
package opshttp

import (
	"fmt"
	"net/http"
	"net/http/pprof"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// NewMux returns a mux with /metrics from reg, /healthz, and /readyz, which
// answers 503 with notReady while ready is false. Daemons add their own
// routes to it.
func NewMux(reg *prometheus.Registry, ready *atomic.Bool, notReady string) *http.ServeMux {
	return NewMuxDetail(reg, ready, notReady, nil)
}

// NewMuxDetail is NewMux whose /readyz also writes, after its first line,
// what detail returns: the state of each dependency, one per line.
func NewMuxDetail(reg *prometheus.Registry, ready *atomic.Bool, notReady string, detail func() string) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		more := ""
		if detail != nil {
			more = detail()
		}
		if !ready.Load() {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintln(w, notReady)
		} else {
			fmt.Fprintln(w, "ready")
		}
		if more != "" {
			fmt.Fprintln(w, more)
		}
	})
	return mux
}

// Profiling adds Go's profiles (net/http/pprof) to mux under /debug/pprof/:
// go tool pprof http://ADDR/debug/pprof/profile?seconds=10 for the CPU,
// /debug/pprof/heap and /debug/pprof/allocs for memory.
func Profiling(mux *http.ServeMux) {
	mux.HandleFunc("GET /debug/pprof/", pprof.Index)
	mux.HandleFunc("GET /debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("GET /debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
}
