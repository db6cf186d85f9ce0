package limiterd

import (
	"fmt"
	"net/http"
	"net/url"
	"path"
	"regexp"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/pkg/httplimit"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// Defaults of the forward-auth request headers: the names Traefik's
// forwardAuth sends, which the nginx configuration of deploy/nginx sends too,
// and the header an authentication layer in front sets to the user it
// authenticated.
const (
	DefaultForwardAuthUserHeader   = "X-Auth-User"
	DefaultForwardAuthURIHeader    = "X-Forwarded-Uri"
	DefaultForwardAuthMethodHeader = "X-Forwarded-Method"
	DefaultForwardAuthIPHeader     = "X-Forwarded-For"
	// ForwardAuthNoHeader turns a forward-auth header off.
	ForwardAuthNoHeader = "none"
	// ForwardAuthPath is the forward-auth route on the HTTP listener.
	ForwardAuthPath = "/forward-auth"
	// ForwardAuthStatusHeader carries the real status of a refusal in
	// nginx mode, where it is always 403.
	ForwardAuthStatusHeader = "X-Limiterd-Status"
)

var headerNamePattern = regexp.MustCompile("^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")

// forwardAuthHeaders are the request headers forward-auth trusts, each ""
// when off.
type forwardAuthHeaders struct {
	user, apiKey, plan, uri, method, ip string
}

func (o *Options) forwardAuthHeaders() forwardAuthHeaders {
	on := func(h string) string {
		if h == ForwardAuthNoHeader {
			return ""
		}
		return h
	}
	return forwardAuthHeaders{
		user: on(o.ForwardAuthUserHeader), apiKey: on(o.ForwardAuthAPIKeyHeader), plan: on(o.ForwardAuthPlanHeader),
		uri: on(o.ForwardAuthURIHeader), method: on(o.ForwardAuthMethodHeader), ip: on(o.ForwardAuthIPHeader),
	}
}

func (o *Options) setForwardAuthDefaults() {
	for _, f := range []struct {
		v   *string
		def string
	}{
		{&o.ForwardAuthUserHeader, DefaultForwardAuthUserHeader}, {&o.ForwardAuthURIHeader, DefaultForwardAuthURIHeader},
		{&o.ForwardAuthMethodHeader, DefaultForwardAuthMethodHeader}, {&o.ForwardAuthIPHeader, DefaultForwardAuthIPHeader},
	} {
		if *f.v == "" {
			*f.v = f.def
		}
	}
}

// validateForwardAuth checks the header names, each naming its flag.
func (o *Options) validateForwardAuth() []error {
	var errs []error
	for _, f := range []struct{ flag, v string }{
		{"user-header", o.ForwardAuthUserHeader}, {"api-key-header", o.ForwardAuthAPIKeyHeader},
		{"plan-header", o.ForwardAuthPlanHeader}, {"uri-header", o.ForwardAuthURIHeader},
		{"method-header", o.ForwardAuthMethodHeader}, {"ip-header", o.ForwardAuthIPHeader},
	} {
		if f.v != "" && f.v != ForwardAuthNoHeader && !headerNamePattern.MatchString(f.v) {
			errs = append(errs, fmt.Errorf("--forward-auth.%s: %q is not a header name (or %q)", f.flag, f.v, ForwardAuthNoHeader))
		}
	}
	return errs
}

// forwardAuthHandler answers nginx auth_request and Traefik forwardAuth: it
// checks the request the proxy describes in its headers by attributes,
// every matching rule at once, and answers
//
//   - 200 with the quota headers when allowed;
//   - 429 with Retry-After and the quota headers when over the limit;
//   - 503 when a fail-closed rule cannot be decided;
//   - 400 when a configured header is missing or invalid (no identity, a
//     URI that is not a path, an address that is not an IP).
//
// With the query parameter mode=nginx every refusal is a 403, the one
// refusal auth_request passes on besides 401, with the real status in
// X-Limiterd-Status for the nginx configuration to answer with.
//
// The headers are trusted as they come: only the proxy may reach this
// endpoint, and the proxy must set each of them itself, overwriting what
// the client sent.
func (d *Daemon) forwardAuthHandler() http.Handler {
	h := d.opts.forwardAuthHeaders()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		nginx := r.URL.Query().Get("mode") == "nginx"
		refuse := func(code int, msg string) {
			if nginx {
				w.Header().Set(ForwardAuthStatusHeader, fmt.Sprint(code))
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
		resp, err := d.service.Check(r.Context(), &limiterv1.CheckRequest{Attributes: a})
		if err != nil {
			switch status.Code(err) {
			case codes.InvalidArgument:
				refuse(http.StatusBadRequest, status.Convert(err).Message())
			case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled:
				refuse(http.StatusServiceUnavailable, "rate limit undecided: "+status.Convert(err).Message())
			default:
				d.log.Warn("forward-auth check failed", "code", status.Code(err).String(), "err", err)
				refuse(http.StatusInternalServerError, status.Convert(err).Message())
			}
			return
		}
		httplimit.SetHeaders(w.Header(), resp, time.Now())
		if !resp.GetAllowed() {
			refuse(http.StatusTooManyRequests, "too many requests")
			return
		}
		w.Header().Set("Cache-Control", "no-store")
		w.WriteHeader(http.StatusOK)
	})
}

// attributes reads the request the proxy describes; the error says which
// header is missing or wrong.
func (h forwardAuthHeaders) attributes(r *http.Request) (*limiterv1.Attributes, error) {
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
		// The origin form only, as proxies send it: a path and a query.
		u, err := url.ParseRequestURI(raw)
		if err != nil || raw[0] != '/' || u.Path == "" {
			return nil, fmt.Errorf("%s: %q is not a request path", h.uri, raw)
		}
		// As the upstream will route it: /api/%2e%2e/admin is /admin.
		a.Path = path.Clean(u.Path)
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

func nonEmpty(s ...string) []string {
	var out []string
	for _, v := range s {
		if v != "" {
			out = append(out, v)
		}
	}
	return out
}
