// Package forwardauth is the HTTP front door for nginx auth_request and
// Traefik forwardAuth: the proxy describes the request in headers, and the
// engine decides every rule it matches.
package forwardauth

import (
	"context"
	"crypto/subtle"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"time"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/frontdoor/checkapi"
	"github.com/limiterd/limiterd/pkg/httplimit"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// Defaults of the forward-auth request headers: the names Traefik's
// forwardAuth sends, which the nginx configuration of deploy/nginx sends too,
// and the header an authentication layer in front sets to the user it
// authenticated.
const (
	DefaultUserHeader   = "X-Auth-User"
	DefaultURIHeader    = "X-Forwarded-Uri"
	DefaultMethodHeader = "X-Forwarded-Method"
	DefaultIPHeader     = "X-Forwarded-For"
	// DefaultPriorityHeader carries the request's priority class, which
	// the proxy sets (overwriting the client's).
	DefaultPriorityHeader = "X-Ratelimit-Priority"
	// NoHeader turns a forward-auth header off.
	NoHeader = "none"
	// Path is the forward-auth route on the HTTP listener.
	Path = "/forward-auth"
	// StatusHeader carries the real status of a refusal in nginx mode,
	// where it is always 403.
	StatusHeader = "X-Limiterd-Status"
	// ErrorHeader carries the reason of a 400 in nginx mode, where the
	// answer's body does not reach the client.
	ErrorHeader = "X-Limiterd-Error"
	// SecretHeader carries the secret the proxy shares with limiterd
	// (--forward-auth.secret-file).
	SecretHeader = "X-Limiter-Forward-Auth-Secret"
	// MinSecretLen is the shortest shared secret accepted.
	MinSecretLen = 16
)

// RequireSecret admits to h only the requests that carry secret in
// SecretHeader; the others are answered 401 (in nginx mode too: nginx
// passes a 401 on, so a proxy without the secret shows at once) and
// counted by refused. The header is removed before h reads the request.
func RequireSecret(secret []byte, refused func(), h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ok := false
		for _, v := range r.Header.Values(SecretHeader) {
			ok = ok || subtle.ConstantTimeCompare([]byte(v), secret) == 1
		}
		if !ok {
			refused()
			w.Header().Set("Cache-Control", "no-store")
			http.Error(w, SecretHeader+": missing or wrong: only the proxy may ask", http.StatusUnauthorized)
			return
		}
		r.Header.Del(SecretHeader)
		h.ServeHTTP(w, r)
	})
}

var headerNamePattern = regexp.MustCompile("^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")

// Headers name the request headers forward-auth reads the attributes
// from; the proxy must set each itself. "" is off (NoHeader on the
// command line).
type Headers struct {
	User, APIKey, Plan, URI, Method, IP, Priority string
}

// DefaultHeaders are the headers Traefik's forwardAuth sends and the user
// header an authentication layer in front sets; no API key, no plan.
func DefaultHeaders() Headers {
	return Headers{User: DefaultUserHeader, URI: DefaultURIHeader, Method: DefaultMethodHeader, IP: DefaultIPHeader, Priority: DefaultPriorityHeader}
}

// Validate checks the header names, each error naming its flag
// (--forward-auth.user-header, ...).
func (h Headers) Validate() []error {
	var errs []error
	for _, f := range h.flags() {
		if *f.v != "" && !headerNamePattern.MatchString(*f.v) {
			errs = append(errs, fmt.Errorf("--forward-auth.%s: %q is not a header name (or %q)", f.flag, *f.v, NoHeader))
		}
	}
	return errs
}

type headerFlag struct {
	flag, usage string
	v           *string
}

func (h *Headers) flags() []headerFlag {
	return []headerFlag{
		{"user-header", "header with the authenticated user, set by the proxy", &h.User},
		{"api-key-header", "header with the authenticated API key, set by the proxy", &h.APIKey},
		{"plan-header", "header with the client's plan, set by the proxy", &h.Plan},
		{"uri-header", "header with the original request URI", &h.URI},
		{"method-header", "header with the original request method", &h.Method},
		{"ip-header", "header with the client address, its rightmost entry", &h.IP},
		{"priority-header", "header with the request's priority class (--priority.classes; missing or unknown: default), set by the proxy", &h.Priority},
	}
}

// headerValue is a header name flag: NoHeader is "", off.
type headerValue struct{ v *string }

func (f headerValue) String() string {
	if f.v == nil || *f.v == "" {
		return NoHeader
	}
	return *f.v
}

func (f headerValue) Set(s string) error {
	if s == NoHeader {
		s = ""
	}
	*f.v = s
	return nil
}

// Config is forward-auth as limiterd's --forward-auth.* flags set it.
// Start from DefaultConfig.
type Config struct {
	// Enabled serves Path on the HTTP listener, or on Address when set.
	Enabled bool
	// Address, when set, is forward-auth's own listener (same connection
	// limit, timeouts and TLS as the HTTP one), and Path is no longer
	// served on the HTTP listener. It implies Enabled.
	Address string
	// SecretFile holds a secret the proxy must send in SecretHeader;
	// requests without it are answered 401.
	SecretFile string
	// Headers are the request headers the attributes are read from.
	Headers Headers
}

// DefaultConfig is the flags' defaults: off, with DefaultHeaders.
func DefaultConfig() Config { return Config{Headers: DefaultHeaders()} }

// Serving says whether Path is served at all.
func (c Config) Serving() bool { return c.Enabled || c.Address != "" }

// RegisterFlags defines the --forward-auth.* flags on fs, writing into c,
// with DefaultConfig's values as their defaults.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	*c = DefaultConfig()
	fs.BoolVar(&c.Enabled, "forward-auth.enabled", false, "serve "+Path+" on the HTTP listener for nginx auth_request and Traefik forwardAuth")
	fs.StringVar(&c.Address, "forward-auth.listen-address", "", "serve "+Path+" on its own listener, and no longer on the HTTP one (implies --forward-auth.enabled)")
	fs.StringVar(&c.SecretFile, "forward-auth.secret-file", "", fmt.Sprintf("file holding a secret (at least %d characters) the proxy must send in %s; requests without it get 401", MinSecretLen, SecretHeader))
	for _, f := range c.Headers.flags() {
		fs.Var(headerValue{f.v}, "forward-auth."+f.flag, "forward-auth: "+f.usage+" ("+NoHeader+": off)")
	}
}

// Validate reports every bad field, each naming its flag; it changes
// nothing.
func (c Config) Validate() error {
	errs := c.Headers.Validate()
	if c.SecretFile != "" && !c.Serving() {
		errs = append(errs, errors.New("--forward-auth.secret-file: needs --forward-auth.enabled or --forward-auth.listen-address"))
	}
	return errors.Join(errs...)
}

// headers are the request headers forward-auth trusts, each "" when off.
type headers struct {
	user, apiKey, plan, uri, method, ip, priority string
}

func (h Headers) on() headers {
	return headers{user: h.User, apiKey: h.APIKey, plan: h.Plan, uri: h.URI, method: h.Method, ip: h.IP, priority: h.Priority}
}

// forwardAuthHandler answers nginx auth_request and Traefik forwardAuth: it
// checks the request the proxy describes in its headers by attributes,
// every matching rule at once, and answers
//
//   - 200 with the quota headers when allowed;
//   - 429 with Retry-After and the quota headers when over the limit;
//   - 503 with Retry-After and the quota headers when refused only for
//     the reserve a rule keeps for more important priority classes than
//     the request's (its priority header);
//   - 503 when a fail-closed rule cannot be decided;
//   - 400 when a configured header is missing or invalid (no identity, a
//     URI that is not a path or that the backend could read as another
//     path, see requestPath; an address that is not an IP).
//
// With the query parameter mode=nginx every refusal is a 403, the one
// refusal auth_request passes on besides 401, with the real status in
// X-Limiterd-Status for the nginx configuration to answer with (and a
// 400's reason in X-Limiterd-Error).
//
// The headers are trusted as they come: only the proxy may reach this
// endpoint, and the proxy must set each of them itself, overwriting what
// the client sent.
func Handler(hs Headers, svc *checkapi.Service, log *slog.Logger) http.Handler {
	h := hs.on()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		nginx := r.URL.Query().Get("mode") == "nginx"
		refuse := func(code int, msg string) {
			if nginx {
				w.Header().Set(StatusHeader, fmt.Sprint(code))
				if code == http.StatusBadRequest {
					w.Header().Set(ErrorHeader, msg)
				}
				code = http.StatusForbidden
			}
			w.Header().Set("Cache-Control", "no-store")
			http.Error(w, msg, code)
		}
		a, err := h.attributes(r)
		if err != nil {
			refuse(http.StatusBadRequest, err.Error())
			return
		}
		req := &limiterv1.CheckRequest{Attributes: a}
		if h.priority != "" {
			req.Priority = r.Header.Get(h.priority)
		}
		resp, err := svc.Decide(r.Context(), req)
		if err != nil {
			var inv *request.InvalidError
			switch {
			case errors.Is(err, request.ErrConcurrencyRule):
				// The rule file is not wrong; serving it here would be:
				// nginx and Traefik never say when a request ends, so a
				// lease taken here could never be released.
				log.Warn("forward-auth request matched a concurrency rule, refused", "err", err)
				refuse(http.StatusInternalServerError, errForwardAuthConcurrency+err.Error())
			case errors.As(err, &inv):
				refuse(http.StatusBadRequest, err.Error())
			case errors.Is(err, engine.ErrUnavailable), errors.Is(err, engine.ErrOverloaded),
				errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
				refuse(http.StatusServiceUnavailable, "rate limit undecided: "+err.Error())
			default:
				log.Warn("forward-auth check failed", "err", err)
				refuse(http.StatusInternalServerError, err.Error())
			}
			return
		}
		httplimit.SetHeaders(w.Header(), resp, time.Now())
		if !resp.GetAllowed() {
			if resp.GetReason() == limiterv1.Reason_RESERVED {
				refuse(http.StatusServiceUnavailable, "service busy: lower priority requests are shed")
				return
			}
			refuse(http.StatusTooManyRequests, "too many requests")
			return
		}
		w.Header().Set("Cache-Control", "no-store")
		w.WriteHeader(http.StatusOK)
	})
}

// errForwardAuthConcurrency starts the answer to a request that matched a
// concurrency rule.
const errForwardAuthConcurrency = "forward-auth cannot enforce concurrency rules (nginx and Traefik never report the end of a request, so a lease could never be released; use pkg/httplimit or Acquire/Release): "

// attributes reads the request the proxy describes; the error says which
// header is missing or wrong.
func (h headers) attributes(r *http.Request) (*limiterv1.Attributes, error) {
	a := &limiterv1.Attributes{}
	if h.user != "" {
		a.User = r.Header.Get(h.user)
	}
	if h.apiKey != "" {
		a.ApiKey = r.Header.Get(h.apiKey)
	}
	if (h.user != "" || h.apiKey != "") && a.User == "" && a.ApiKey == "" {
		return nil, fmt.Errorf("no identity: %s missing", strings.Join(nonEmpty(h.user, h.apiKey), " and "))
	}
	if h.plan != "" {
		a.Plan = r.Header.Get(h.plan)
	}
	if h.uri != "" {
		raw := r.Header.Get(h.uri)
		if raw == "" {
			return nil, fmt.Errorf("%s missing", h.uri)
		}
		p, err := requestPath(raw)
		if err != nil {
			return nil, fmt.Errorf("%s: %q: %w", h.uri, raw, err)
		}
		a.Path = p
	}
	if h.method != "" {
		if a.Method = r.Header.Get(h.method); a.Method == "" {
			return nil, fmt.Errorf("%s missing", h.method)
		}
	}
	if h.ip != "" {
		// The rightmost entry: the one the proxy in front appended.
		v := r.Header.Values(h.ip)
		if len(v) == 0 {
			return nil, fmt.Errorf("%s missing", h.ip)
		}
		last := v[len(v)-1]
		a.Ip = strings.TrimSpace(last[strings.LastIndexByte(last, ',')+1:])
		if a.Ip == "" {
			return nil, fmt.Errorf("%s: empty", h.ip)
		}
	}
	return a, nil
}

// requestPath is the path of the request URI raw (the origin form, as
// proxies send it: a path and a query) that rules are matched on.
//
// nginx passes $request_uri to the backend as the client wrote it, and
// Traefik the client's escaped path: what the backend routes is read from
// those bytes by the backend's own rules, which differ (one decodes %2F
// into a separator, one strips ";jsessionid=...", one resolves "..",
// one treats '\' as '/'). So a path any of them could read as another is
// refused rather than guessed at: an escaped '/', '.', '%', '\' or ';',
// a raw '\' or ';', a "." or ".." segment, an empty segment ("//") and
// an escaped control byte. The other escapes name the same path however
// they are written and are decoded; one trailing '/' is dropped (a
// backend mostly routes /a/ as /a). Case is left to the rules' match,
// which ignores it.
func requestPath(raw string) (string, error) {
	p, _, _ := strings.Cut(raw, "?")
	if !strings.HasPrefix(p, "/") {
		return "", errors.New("not a request path (it must start with /)")
	}
	if i := strings.IndexAny(p, ";\\#"); i >= 0 {
		return "", fmt.Errorf("%q in the path: the backend may read it as another path (a parameter, a separator), so it is refused", p[i])
	}
	for rest := p; ; {
		i := strings.IndexByte(rest, '%')
		if i < 0 {
			break
		}
		if i+2 >= len(rest) || !isHex(rest[i+1]) || !isHex(rest[i+2]) {
			return "", fmt.Errorf("%q is not a percent escape", rest[i:min(i+3, len(rest))])
		}
		esc := rest[i : i+3]
		switch c := unhex(rest[i+1])<<4 | unhex(rest[i+2]); {
		case c == '/' || c == '.' || c == '%' || c == '\\' || c == ';':
			return "", fmt.Errorf("%s (an escaped %q) in the path: the backend may decode it into another path, so it is refused", esc, c)
		case c < 0x20 || c == 0x7f:
			return "", fmt.Errorf("%s (a control byte) in the path", esc)
		}
		rest = rest[i+3:]
	}
	for seg := range strings.SplitSeq(p[1:], "/") {
		switch seg {
		case ".", "..":
			return "", fmt.Errorf("a %q segment in the path: the backend may resolve it to another path, so it is refused", seg)
		}
	}
	if strings.Contains(p, "//") {
		return "", errors.New("an empty segment (//) in the path: the backend may merge it away, so it is refused")
	}
	dec, err := url.PathUnescape(p)
	if err != nil {
		return "", err
	}
	if len(dec) > 1 {
		dec = strings.TrimSuffix(dec, "/")
	}
	return dec, nil
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func unhex(c byte) byte {
	switch {
	case c <= '9':
		return c - '0'
	case c >= 'a':
		return c - 'a' + 10
	}
	return c - 'A' + 10
}

func nonEmpty(s ...string) []string {
	var out []string
	for _, v := range s {
		if v != "" {
			out = append(out, v)
		}
	}
	return out
}
