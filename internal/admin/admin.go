// Package admin is limiterd's admin API: rule changes over gRPC
// (limiter.v1.Admin) and HTTP (/admin/rules), authenticated by a bearer
// token or a client certificate of an allowed identity, stored through the
// rules source.
package admin

import (
	"context"
	"crypto/subtle"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"go.yaml.in/yaml/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/rulesource"
	"github.com/limiterd/limiterd/internal/secretfile"
	"github.com/limiterd/limiterd/internal/tlsconf"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// maxRuleBytes bounds an admin request's body.
const maxRuleBytes = 64 << 10

// Admin changes the rules through the rules source. A caller is admitted
// with the bearer token, or with a client certificate the listener verified
// whose identity is in Options.ClientIdentities; a certificate alone (of a
// CA that also signs gateways' certificates) admits nobody. Safe for
// concurrent use.
type Admin struct {
	limiterv1.UnimplementedAdminServer
	src        *rulesource.Source
	token      []byte
	identities []string
	refused    *prometheus.CounterVec
}

// MinTokenLen is the shortest admin token accepted.
const MinTokenLen = 16

// Reasons a call is refused, the values of the reason label of
// limiter_admin_calls_refused_total.
const (
	// ReasonNoCredentials: neither a token nor a client certificate.
	ReasonNoCredentials = "no_credentials"
	// ReasonBadToken: a token that is not the admin token.
	ReasonBadToken = "bad_token"
	// ReasonIdentity: a verified client certificate whose identity is not
	// in --admin.client-identities.
	ReasonIdentity = "identity_not_allowed"
)

// Options configure the admin API.
type Options struct {
	// TokenFile (--admin.token-file) holds the bearer token, checked as
	// package secretfile does; empty: no token admits.
	TokenFile string
	// ClientIdentities (--admin.client-identities) are the client
	// certificate identities (DNS or URI SAN, or CN) admitted without the
	// token; empty: a certificate never admits.
	ClientIdentities []string
	// Logger gets the warning about a group-readable token file.
	Logger *slog.Logger
}

// New makes the admin API of src, registering its metrics on reg.
func New(src *rulesource.Source, opts Options, reg prometheus.Registerer) (*Admin, error) {
	a := &Admin{src: src, identities: opts.ClientIdentities}
	if opts.TokenFile != "" {
		var err error
		if a.token, err = secretfile.Read("--admin.token-file", opts.TokenFile, MinTokenLen, opts.Logger); err != nil {
			return nil, err
		}
	}
	a.refused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "limiter_admin_calls_refused_total",
		Help: "Admin API calls refused, by reason (no_credentials, bad_token, identity_not_allowed: a verified client certificate not in --admin.client-identities).",
	}, []string{"reason"})
	if err := reg.Register(a.refused); err != nil {
		return nil, err
	}
	for _, r := range []string{ReasonNoCredentials, ReasonBadToken, ReasonIdentity} {
		a.refused.WithLabelValues(r)
	}
	return a, nil
}

// errRefused is a refused call: code is Unauthenticated (no valid
// credentials) or PermissionDenied (a verified identity not allowed).
type errRefused struct {
	code   codes.Code
	reason string
	msg    string
}

func (e *errRefused) Error() string { return e.msg }

func (a *Admin) tokenOK(got string) bool {
	tok, ok := strings.CutPrefix(got, "Bearer ")
	return ok && len(a.token) > 0 && subtle.ConstantTimeCompare([]byte(tok), a.token) == 1
}

// check admits a caller that sent the authorization values and whose
// connection verified the client certificate cert (nil: none); a refusal
// is counted.
func (a *Admin) check(authorization []string, cert *x509.Certificate) *errRefused {
	for _, v := range authorization {
		if a.tokenOK(v) {
			return nil
		}
	}
	if len(a.identities) > 0 && tlsconf.Allowed(cert, a.identities) {
		return nil
	}
	var e *errRefused
	switch {
	case len(authorization) > 0:
		e = &errRefused{codes.Unauthenticated, ReasonBadToken, "admin calls need the admin bearer token: the one given is wrong"}
	case cert != nil && len(a.identities) > 0:
		e = &errRefused{codes.PermissionDenied, ReasonIdentity, fmt.Sprintf(
			"client certificate %q: not an identity of --admin.client-identities", strings.Join(tlsconf.Identities(cert), ","))}
	case cert != nil:
		e = &errRefused{codes.PermissionDenied, ReasonIdentity,
			"a client certificate alone does not admit admin calls: send the admin bearer token (or list the identity in --admin.client-identities)"}
	default:
		e = &errRefused{codes.Unauthenticated, ReasonNoCredentials, "admin calls need a bearer token (Authorization: Bearer <token>)"}
	}
	a.refused.WithLabelValues(e.reason).Inc()
	return e
}

// authorize admits a gRPC call.
func (a *Admin) authorize(ctx context.Context) error {
	var auth []string
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		auth = md.Get("authorization")
	}
	if e := a.check(auth, tlsconf.VerifiedGRPC(ctx)); e != nil {
		return status.Error(e.code, e.msg)
	}
	return nil
}

// Authorize authenticates a call of method when it is one of the Admin
// service, and returns nil for every other call; the daemon's one unary
// interceptor calls it.
func (a *Admin) Authorize(ctx context.Context, method string) error {
	if strings.HasPrefix(method, "/"+limiterv1.Admin_ServiceDesc.ServiceName+"/") {
		return a.authorize(ctx)
	}
	return nil
}

func adminStatus(err error) error {
	switch {
	case errors.Is(err, rules.ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, rulesource.ErrNotFound):
		return status.Error(codes.NotFound, err.Error())
	case errors.Is(err, rulesource.ErrNoStore), errors.Is(err, rulesource.ErrReadOnly):
		return status.Error(codes.FailedPrecondition, err.Error())
	}
	return status.Error(codes.Unavailable, err.Error())
}

func (a *Admin) PutRule(ctx context.Context, req *limiterv1.PutRuleRequest) (*limiterv1.PutRuleResponse, error) {
	if len(req.GetRule()) > maxRuleBytes {
		return nil, status.Errorf(codes.InvalidArgument, "rule: over %d bytes", maxRuleBytes)
	}
	rev, err := a.src.Put(ctx, []byte(req.GetRule()))
	if err != nil {
		return nil, adminStatus(err)
	}
	return &limiterv1.PutRuleResponse{Revision: rev}, nil
}

func (a *Admin) DeleteRule(ctx context.Context, req *limiterv1.DeleteRuleRequest) (*limiterv1.DeleteRuleResponse, error) {
	if err := a.delete(ctx, req.GetId()); err != nil {
		return nil, adminStatus(err)
	}
	return &limiterv1.DeleteRuleResponse{}, nil
}

// delete removes the admin rule id, refusing an id no rule can have (such
// as "api.", not a key of the rules bucket) as invalid before the bucket
// is asked.
func (a *Admin) delete(ctx context.Context, id string) error {
	if err := rules.CheckID(id); err != nil {
		return err
	}
	return a.src.Delete(ctx, id)
}

func (a *Admin) ListRules(context.Context, *limiterv1.ListRulesRequest) (*limiterv1.ListRulesResponse, error) {
	set := a.src.Current()
	resp := &limiterv1.ListRulesResponse{Version: set.Version()}
	for _, r := range set.Rules() {
		resp.Rules = append(resp.Rules, &limiterv1.RuleEntry{Id: r.ID, Source: r.Source(), Yaml: string(r.YAML())})
	}
	return resp, nil
}

// routes serves the same calls over HTTP: PUT, DELETE and GET on
// /admin/rules/{id}, GET /admin/rules. Bodies and answers are YAML.
func (a *Admin) Routes(mux *http.ServeMux) {
	auth := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if e := a.check(r.Header.Values("Authorization"), tlsconf.Verified(r.TLS)); e != nil {
				code := http.StatusForbidden
				if e.code == codes.Unauthenticated {
					code = http.StatusUnauthorized
					w.Header().Set("WWW-Authenticate", `Bearer realm="limiterd admin"`)
				}
				http.Error(w, e.msg, code)
				return
			}
			h(w, r)
		}
	}
	fail := func(w http.ResponseWriter, err error) {
		code := http.StatusServiceUnavailable
		switch status.Code(adminStatus(err)) {
		case codes.InvalidArgument:
			code = http.StatusBadRequest
		case codes.NotFound:
			code = http.StatusNotFound
		case codes.FailedPrecondition:
			code = http.StatusConflict
		}
		http.Error(w, err.Error(), code)
	}
	mux.HandleFunc("PUT /admin/rules/{id}", auth(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, maxRuleBytes+1))
		if err != nil || len(body) > maxRuleBytes {
			http.Error(w, fmt.Sprintf("body: must be a rule of at most %d bytes", maxRuleBytes), http.StatusBadRequest)
			return
		}
		rule, err := rules.ParseRule(body, rules.SourceAdmin)
		if err == nil && rule.ID != r.PathValue("id") {
			err = fmt.Errorf("%w: id: %q in the body, %q in the path", rules.ErrInvalid, rule.ID, r.PathValue("id"))
		}
		if err != nil {
			fail(w, err)
			return
		}
		rev, err := a.src.Put(r.Context(), body)
		if err != nil {
			fail(w, err)
			return
		}
		w.Header().Set("Content-Type", "application/yaml")
		fmt.Fprintf(w, "id: %s\nrevision: %d\n", rule.ID, rev)
	}))
	mux.HandleFunc("DELETE /admin/rules/{id}", auth(func(w http.ResponseWriter, r *http.Request) {
		if err := a.delete(r.Context(), r.PathValue("id")); err != nil {
			fail(w, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	list := func(w http.ResponseWriter, r *http.Request) {
		resp, _ := a.ListRules(r.Context(), nil)
		id := r.PathValue("id")
		type entry struct {
			Source string    `yaml:"source"`
			Rule   yaml.Node `yaml:"rule"`
		}
		out := struct {
			Version string  `yaml:"version"`
			Rules   []entry `yaml:"rules"`
		}{Version: resp.Version}
		for _, e := range resp.Rules {
			if id != "" && e.Id != id {
				continue
			}
			var n yaml.Node
			if err := yaml.Unmarshal([]byte(e.Yaml), &n); err != nil || len(n.Content) == 0 {
				continue
			}
			out.Rules = append(out.Rules, entry{Source: e.Source, Rule: *n.Content[0]})
		}
		if id != "" && len(out.Rules) == 0 {
			http.Error(w, fmt.Sprintf("no rule %q", id), http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/yaml")
		w.Header().Set("X-Rules-Version", resp.Version)
		_ = yaml.NewEncoder(w).Encode(out) // nothing to do when the client went away
	}
	mux.HandleFunc("GET /admin/rules", auth(list))
	mux.HandleFunc("GET /admin/rules/{id}", auth(list))
}
