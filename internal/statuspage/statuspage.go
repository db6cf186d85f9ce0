// Package statuspage owns limiterd's status page: one server-rendered HTML
// page on the HTTP port (/) that says, for an SRE during an incident, which
// rules are in force, which regions are reachable, how far behind
// reconciliation is, how the store's nodes are, and who is being limited,
// with a form to try a check. It needs no external asset: its style and
// its one script (a refresh of the live part every half second) are inline,
// allowed by a per-response nonce.
package statuspage

import (
	"bytes"
	"context"
	"crypto/rand"
	"embed"
	"encoding/base64"
	"fmt"
	"html/template"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Status is what the page shows, gathered afresh at each request.
type Status struct {
	// Region is this limiterd's region; Store names its store.
	Region, Store string
	// Version is the rule set's version; Rules the rules in force.
	Version string
	Rules   []Rule
	// Regions are the topology's regions, this one included; none without
	// a topology.
	Regions []Region
	// Lag is reconciliation's backlog per source region; LagNote says why
	// there is none to show (no NATS, no reconciler yet, an error).
	Lag     []Lag
	LagNote string
	// Nodes are the store's primaries; none on the embedded store.
	Nodes []Node
	// Top are the keys refused most, per rule that refused any.
	Top []Top
	// Dependencies is the readiness detail (/readyz), one line each.
	Dependencies string
	// At is when the status was gathered.
	At time.Time
}

// Rule is one rule in force.
type Rule struct {
	ID, Algorithm, Limit, Home, Source string
	Shadow                             bool
	Overrides                          int
}

// Region is one region of the topology and how this limiterd reaches it.
type Region struct {
	Name, Address string
	// Self: this limiterd's region. State is the connection's to the
	// region's limiterd (READY, CONNECTING, TRANSIENT_FAILURE, IDLE).
	Self  bool
	State string
}

// Lag is the reconciler's backlog of one source region's spends here.
type Lag struct {
	Source string
	// Pending are the messages its partitions' readers have not read yet.
	Pending uint64
	// LastApplied is when its readers last read a message; zero: none yet.
	LastApplied time.Time
	Err         string
}

// Node is one primary of the store as its probe last found it.
type Node struct {
	Addr string
	// Err is why it did not answer; "" when it did.
	Err string
}

// Top is the keys a rule refused most, over the region.
type Top struct {
	Rule string
	Keys []TopKey
	Err  string
}

// TopKey is one refused key and its (over-)estimated refusals.
type TopKey struct {
	Key   string
	Count uint64
}

// TryRequest is the form's check. Spend false asks what a check would see
// (GetUsage), spending nothing.
type TryRequest struct {
	Rule, Key string
	Cost      float64
	Spend     bool
}

// TryResult is the answer to a TryRequest.
type TryResult struct {
	Allowed          bool
	Remaining, Limit float64
	RetryAfter       time.Duration
}

// Options configure Handler.
type Options struct {
	// Status gathers what the page shows; it is called at each request
	// and should bound its own I/O by ctx.
	Status func(ctx context.Context) Status
	// Try answers the form; nil: no form.
	Try func(ctx context.Context, req TryRequest) (TryResult, error)
	// Logger gets the template's errors (nil: slog.Default()).
	Logger *slog.Logger
}

// The form's bounds: a body over maxFormBytes is refused, as is a rule id or
// key longer than maxField bytes.
const (
	maxFormBytes = 4 << 10
	maxField     = 512
)

// statusTimeout bounds gathering one status.
const statusTimeout = 2 * time.Second

//go:embed page.html
var files embed.FS

var page = template.Must(template.New("page.html").Funcs(template.FuncMap{
	"ago": func(t, now time.Time) string {
		if t.IsZero() {
			return "never"
		}
		return now.Sub(t).Round(100*time.Millisecond).String() + " ago"
	},
	// num shows at most two decimals: a bucket refills between two reads.
	"num":   func(f float64) string { return strconv.FormatFloat(math.Round(f*100)/100, 'f', -1, 64) },
	"lines": func(s string) []string { return strings.Split(strings.TrimSpace(s), "\n") },
}).ParseFS(files, "page.html"))

// view is the template's data.
type view struct {
	Status
	Nonce   string
	CanTry  bool
	Tried   *TryRequest
	Result  *TryResult
	TryErr  string
	Form    formValues
	Refresh bool
}

// formValues are the form's fields as the user typed them.
type formValues struct{ Rule, Key, Cost string }

// Handler serves the page at "/" (GET: the page, or with ?part=live the
// live part alone, which the page's script fetches every half second; POST: the
// form's check). Cross-origin POSTs are refused.
func Handler(o Options) http.Handler {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Method {
		case http.MethodGet, http.MethodHead, http.MethodPost:
		default:
			w.Header().Set("Allow", "GET, HEAD, POST")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), statusTimeout)
		defer cancel()
		v := view{Nonce: nonce(), CanTry: o.Try != nil, Form: formValues{Cost: "1"}}
		code := http.StatusOK
		if r.Method == http.MethodPost {
			code = v.try(ctx, w, r, o)
		}
		v.Status = o.Status(ctx)
		if v.At.IsZero() {
			v.At = time.Now()
		}
		name := "page"
		if r.Method != http.MethodPost && r.URL.Query().Get("part") == "live" {
			name = "live"
		}
		var buf bytes.Buffer
		if err := page.ExecuteTemplate(&buf, name, v); err != nil {
			o.Logger.Error("status page", "err", err)
			http.Error(w, "status page: "+err.Error(), http.StatusInternalServerError)
			return
		}
		hd := w.Header()
		hd.Set("Content-Type", "text/html; charset=utf-8")
		hd.Set("Cache-Control", "no-store")
		hd.Set("X-Content-Type-Options", "nosniff")
		hd.Set("Content-Security-Policy", fmt.Sprintf("default-src 'none'; style-src 'nonce-%[1]s'; script-src 'nonce-%[1]s'; "+
			"img-src data:; connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'", v.Nonce))
		w.WriteHeader(code)
		_, _ = w.Write(buf.Bytes())
	})
	return http.NewCrossOriginProtection().Handler(h)
}

// try reads, validates and answers the form; it returns the status code
// of the page.
func (v *view) try(ctx context.Context, w http.ResponseWriter, r *http.Request, o Options) int {
	if o.Try == nil {
		v.TryErr = "checks are not served here"
		return http.StatusNotFound
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	if err := r.ParseForm(); err != nil {
		v.TryErr = fmt.Sprintf("form: at most %d bytes: %v", maxFormBytes, err)
		return http.StatusBadRequest
	}
	v.Form = formValues{Rule: r.PostFormValue("rule"), Key: r.PostFormValue("key"), Cost: r.PostFormValue("cost")}
	req, err := parseTry(v.Form, r.PostFormValue("spend") == "on")
	if err != nil {
		v.TryErr = err.Error()
		return http.StatusBadRequest
	}
	v.Tried = &req
	res, err := o.Try(ctx, req)
	if err != nil {
		v.TryErr = err.Error()
		return http.StatusOK
	}
	v.Result = &res
	return http.StatusOK
}

// parseTry validates the form's fields, naming the one at fault.
func parseTry(f formValues, spend bool) (TryRequest, error) {
	req := TryRequest{Rule: strings.TrimSpace(f.Rule), Key: f.Key, Spend: spend, Cost: 1}
	switch {
	case req.Rule == "":
		return req, fmt.Errorf("rule: required")
	case len(req.Rule) > maxField:
		return req, fmt.Errorf("rule: at most %d bytes", maxField)
	case req.Key == "":
		return req, fmt.Errorf("key: required")
	case len(req.Key) > maxField:
		return req, fmt.Errorf("key: at most %d bytes", maxField)
	}
	if c := strings.TrimSpace(f.Cost); c != "" {
		cost, err := strconv.ParseFloat(c, 64)
		if err != nil || math.IsNaN(cost) || math.IsInf(cost, 0) || cost <= 0 {
			return req, fmt.Errorf("cost: a number above 0, got %q", c)
		}
		req.Cost = cost
	}
	return req, nil
}

// nonce is a fresh value for the page's Content-Security-Policy.
func nonce() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)
}
