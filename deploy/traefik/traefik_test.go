// Package traefik tests dynamic.yml, the Traefik configuration of
// limiterd's forward-auth, against the limiterd it points at.
package traefik

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/limiterd/limiterd/internal/frontdoor/forwardauth"
	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/pkg/httplimit"
)

// dynamic is the part of Traefik's dynamic configuration schema that
// dynamic.yml uses, with Traefik's field names; unknown keys are refused.
type dynamic struct {
	HTTP struct {
		Routers     map[string]router     `yaml:"routers"`
		Middlewares map[string]middleware `yaml:"middlewares"`
		Services    map[string]service    `yaml:"services"`
	} `yaml:"http"`
}

type router struct {
	EntryPoints []string `yaml:"entryPoints"`
	Rule        string   `yaml:"rule"`
	Middlewares []string `yaml:"middlewares"`
	Service     string   `yaml:"service"`
	Priority    int      `yaml:"priority"`
}

type middleware struct {
	Chain *struct {
		Middlewares []string `yaml:"middlewares"`
	} `yaml:"chain"`
	BasicAuth *struct {
		Users        []string `yaml:"users"`
		UsersFile    string   `yaml:"usersFile"`
		Realm        string   `yaml:"realm"`
		HeaderField  string   `yaml:"headerField"`
		RemoveHeader bool     `yaml:"removeHeader"`
	} `yaml:"basicAuth"`
	ForwardAuth *forwardAuth `yaml:"forwardAuth"`
	Headers     *struct {
		CustomRequestHeaders map[string]string `yaml:"customRequestHeaders"`
	} `yaml:"headers"`
}

// exampleForwardAuthAddress is the --forward-auth.listen-address the
// examples (this file, deploy/nginx, docs/front-doors.md) give limiterd.
const exampleForwardAuthAddress = "127.0.0.1:9092"

// secretSet reports whether middleware m sets the forward-auth secret
// header to a value ("" clears it).
func secretSet(d *dynamic, m string) (value string, ok bool) {
	h := d.HTTP.Middlewares[m].Headers
	if h == nil {
		return "", false
	}
	v, ok := h.CustomRequestHeaders[forwardauth.SecretHeader]
	return v, ok
}

type forwardAuth struct {
	Address                  string   `yaml:"address"`
	TrustForwardHeader       bool     `yaml:"trustForwardHeader"`
	AuthResponseHeaders      []string `yaml:"authResponseHeaders"`
	AuthResponseHeadersRegex string   `yaml:"authResponseHeadersRegex"`
	AuthRequestHeaders       []string `yaml:"authRequestHeaders"`
	AddAuthCookiesToResponse []string `yaml:"addAuthCookiesToResponse"`
	HeaderField              string   `yaml:"headerField"`
	ForwardBody              bool     `yaml:"forwardBody"`
	MaxBodySize              int64    `yaml:"maxBodySize"`
	PreserveLocationHeader   bool     `yaml:"preserveLocationHeader"`
	PreserveRequestMethod    bool     `yaml:"preserveRequestMethod"`
}

type service struct {
	LoadBalancer struct {
		Servers []struct {
			URL string `yaml:"url"`
		} `yaml:"servers"`
	} `yaml:"loadBalancer"`
}

func decode(b []byte) (*dynamic, error) {
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	var d dynamic
	if err := dec.Decode(&d); err != nil {
		return nil, err
	}
	return &d, nil
}

func load(t *testing.T) *dynamic {
	t.Helper()
	b, err := os.ReadFile("dynamic.yml")
	if err != nil {
		t.Fatal(err)
	}
	d, err := decode(b)
	if err != nil {
		t.Fatalf("dynamic.yml: %v", err)
	}
	return d
}

func TestDecodeIsStrict(t *testing.T) {
	_, err := decode([]byte("http:\n  middlewares:\n    x:\n      forwardAuth:\n        authResponseHeader: [A]\n"))
	if err == nil {
		t.Fatal("a misspelt key decoded without error")
	}
}

// limiterdMiddleware is the forwardAuth middleware of dynamic.yml.
func limiterdMiddleware(t *testing.T, d *dynamic) *forwardAuth {
	t.Helper()
	var fa *forwardAuth
	for name, m := range d.HTTP.Middlewares {
		if m.ForwardAuth != nil {
			if fa != nil {
				t.Fatalf("more than one forwardAuth middleware (%s)", name)
			}
			fa = m.ForwardAuth
		}
	}
	if fa == nil {
		t.Fatal("no forwardAuth middleware")
	}
	return fa
}

func TestDynamicConfig(t *testing.T) {
	d := load(t)
	fa := limiterdMiddleware(t, d)

	u, err := url.Parse(fa.Address)
	if err != nil {
		t.Fatal(err)
	}
	if u.Scheme != "http" || u.Path != forwardauth.Path || u.RawQuery != "" {
		t.Errorf("address %s: want http://HOST:PORT%s (no mode=nginx: Traefik passes a 429 through as it is)", fa.Address, forwardauth.Path)
	}
	if u.Host != exampleForwardAuthAddress {
		t.Errorf("address %s: host %s is not the examples' --forward-auth.listen-address %s", fa.Address, u.Host, exampleForwardAuthAddress)
	}
	if fa.TrustForwardHeader {
		t.Error("trustForwardHeader: true lets the client choose X-Forwarded-For, the address limiterd keys ip rules by")
	}
	if !slices.Equal(sorted(fa.AuthResponseHeaders), sorted(httplimit.HeaderNames)) {
		t.Errorf("authResponseHeaders %v, want the headers limiterd sets: %v", fa.AuthResponseHeaders, httplimit.HeaderNames)
	}
	if want := []string{forwardauth.DefaultUserHeader, forwardauth.SecretHeader}; !slices.Equal(fa.AuthRequestHeaders, want) {
		t.Errorf("authRequestHeaders %v, want only %v: no other header of the client's reaches limiterd",
			fa.AuthRequestHeaders, want)
	}

	// Every router through the forwardAuth goes through authentication
	// first, and that authentication sets the header limiterd reads.
	for name, r := range d.HTTP.Routers {
		if _, ok := d.HTTP.Services[r.Service]; !ok {
			t.Errorf("router %s: unknown service %q", name, r.Service)
		}
		flat := flatten(t, d, r.Middlewares)
		at := slices.IndexFunc(flat, func(m string) bool { return d.HTTP.Middlewares[m].ForwardAuth != nil })
		if at < 0 {
			t.Errorf("router %s: does not go through limiterd", name)
			continue
		}
		auth := slices.IndexFunc(flat[:at], func(m string) bool { return d.HTTP.Middlewares[m].BasicAuth != nil })
		if auth < 0 {
			t.Errorf("router %s: no authentication before limiterd (%v)", name, flat)
			continue
		}
		if ba := d.HTTP.Middlewares[flat[auth]].BasicAuth; ba.HeaderField != forwardauth.DefaultUserHeader {
			t.Errorf("basicAuth %s: headerField %q, want %s", flat[auth], ba.HeaderField, forwardauth.DefaultUserHeader)
		}
		// The secret is set before limiterd is asked, and cleared before
		// the application sees the request.
		set := slices.IndexFunc(flat[:at], func(m string) bool { v, ok := secretSet(d, m); return ok && v != "" })
		cleared := slices.IndexFunc(flat[at:], func(m string) bool { v, ok := secretSet(d, m); return ok && v == "" })
		if set < 0 || cleared < 0 {
			t.Errorf("router %s: %s not set before limiterd and cleared after (%v)", name, forwardauth.SecretHeader, flat)
		}
	}
}

// flatten expands chains into the middlewares they run, in order.
func flatten(t *testing.T, d *dynamic, names []string) []string {
	t.Helper()
	var out []string
	for _, n := range names {
		m, ok := d.HTTP.Middlewares[n]
		if !ok {
			t.Fatalf("unknown middleware %q", n)
		}
		if m.Chain != nil {
			out = append(out, flatten(t, d, m.Chain.Middlewares)...)
			continue
		}
		out = append(out, n)
	}
	return out
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

const rulesYAML = `rules:
  - id: api
    capacity: 2
    refill_per_second: 0.01
    key_by: user
    match:
      path: /api/**
`

// askFunc asks limiterd's forward-auth as Traefik would about a client's
// request to requestURI (as on its request line), with or without the
// secret.
type askFunc func(requestURI string, withSecret bool) *http.Response

// startLimiterd runs a limiterd with rulesYAML behind the forward-auth
// secret, at the address of dynamic.yml's forwardAuth with its port.
func startLimiterd(t *testing.T, fa *forwardAuth) askFunc {
	t.Helper()
	rules := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(rules, []byte(rulesYAML), 0o600); err != nil {
		t.Fatal(err)
	}
	secretFile := testenv.SecretFile(t)
	b, err := os.ReadFile(secretFile)
	if err != nil {
		t.Fatal(err)
	}
	secret := strings.TrimSpace(string(b))
	o := limiterd.DefaultOptions()
	o.Server.GRPCAddress, o.Server.HTTPAddress, o.Rules.File = "127.0.0.1:0", "127.0.0.1:0", rules
	o.ForwardAuth.Address, o.ForwardAuth.SecretFile = "127.0.0.1:0", secretFile
	o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	d, err := limiterd.New(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop(context.Background()) })
	u, _ := url.Parse(fa.Address)
	_, port, _ := net.SplitHostPort(d.ForwardAuthAddr())
	u.Host = net.JoinHostPort(u.Hostname(), port)

	return func(requestURI string, withSecret bool) *http.Response {
		t.Helper()
		// Traefik sends the request's URL.RequestURI(): the path as the
		// client escaped it (Go keeps RawPath) and the query.
		cu, err := url.ParseRequestURI(requestURI)
		if err != nil {
			t.Fatalf("%q: %v", requestURI, err)
		}
		req, _ := http.NewRequest(http.MethodGet, u.String(), nil)
		req.Header.Set("X-Forwarded-Method", "POST")
		req.Header.Set("X-Forwarded-Proto", "https")
		req.Header.Set("X-Forwarded-Host", "api.example.com")
		req.Header.Set("X-Forwarded-Uri", cu.RequestURI())
		req.Header.Set("X-Forwarded-For", "203.0.113.9")
		req.Header.Set(forwardauth.DefaultUserHeader, "alice")
		if withSecret {
			req.Header.Set(forwardauth.SecretHeader, secret)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(b))
		return resp
	}
}

// TestForwardAuthAsTraefikAsks sends limiterd the request Traefik's
// forwardAuth makes (a GET to the address with X-Forwarded-* set by
// Traefik and the authRequestHeaders), and checks the answers carry the
// authResponseHeaders.
func TestForwardAuthAsTraefikAsks(t *testing.T) {
	fa := limiterdMiddleware(t, load(t))
	askURI := startLimiterd(t, fa)
	ask := func(withSecret bool) *http.Response { return askURI("/api/orders?page=2", withSecret) }
	if resp := ask(false); resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("without the secret: %d, want 401", resp.StatusCode)
	}
	for i := range 2 {
		resp := ask(true)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("check %d: %d", i, resp.StatusCode)
		}
		for _, h := range fa.AuthResponseHeaders {
			if got := resp.Header.Get(h); (got == "") != (h == httplimit.HeaderRetryAfter) {
				t.Errorf("check %d: %s = %q", i, h, got)
			}
		}
	}
	resp := ask(true)
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("3rd check: %d, want 429", resp.StatusCode)
	}
	for _, h := range fa.AuthResponseHeaders {
		if v := resp.Header.Get(h); v == "" || (h == httplimit.HeaderRetryAfter && strings.TrimLeft(v, "0") == "") {
			t.Errorf("429: %s = %q", h, v)
		}
	}
}

// TestForwardAuthPathsAsTraefikSends: with the /api/** rule spent, a URI
// Traefik passes on that the application could read as another path (an
// encoded '/', '.' or '%', a dot-segment, a ';' parameter, an empty
// segment) is refused 400 naming X-Forwarded-Uri, and one naming the same
// path in another case or escape is counted (429): never allowed as a path
// no rule matches.
func TestForwardAuthPathsAsTraefikSends(t *testing.T) {
	ask := startLimiterd(t, limiterdMiddleware(t, load(t)))
	for i := range 2 {
		if resp := ask("/api/orders", true); resp.StatusCode != http.StatusOK {
			t.Fatalf("check %d: %d", i, resp.StatusCode)
		}
	}
	for _, tt := range []struct {
		uri  string
		code int
	}{
		{"/api/%2e%2e/x", http.StatusBadRequest},
		{"/api/..%2Fx", http.StatusBadRequest},
		{"/api/%252e%252e/x", http.StatusBadRequest},
		{"/api;a=b/1", http.StatusBadRequest},
		{"/api/../x", http.StatusBadRequest},
		{"/api//1", http.StatusBadRequest},
		{"/API/orders", http.StatusTooManyRequests},
		{"/%61pi/orders", http.StatusTooManyRequests},
	} {
		resp := ask(tt.uri, true)
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != tt.code || (tt.code == http.StatusBadRequest && !strings.Contains(string(body), forwardauth.DefaultURIHeader)) {
			t.Errorf("%s with /api/** spent: %d %q, want %d", tt.uri, resp.StatusCode, body, tt.code)
		}
	}
}
