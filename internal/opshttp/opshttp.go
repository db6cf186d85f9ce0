// Package opshttp serves a daemon's operational endpoints: /metrics,
// /healthz (the process is alive) and /readyz (it should get traffic).
package opshttp

import (
	"fmt"
	"net/http"
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
