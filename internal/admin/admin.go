// Package admin is limiterd's admin API: rule changes over gRPC
// (limiter.v1.Admin) and HTTP (/admin/rules), authenticated by a bearer
// token or a client certificate of an allowed identity, stored through the
// rules source, and the reset of a rule's key.
package admin

import (
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"go.yaml.in/yaml/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/engine/topkeys"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/rulesource"
	"github.com/limiterd/limiterd/internal/secretfile"
	"github.com/limiterd/limiterd/internal/tlsconf"
	"github.com/limiterd/limiterd/pkg/bucket"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// maxRuleBytes bounds an admin request's body.
const maxRuleBytes = 64 << 10

// maxOverrideBytes bounds an override's body: a few numbers.
const maxOverrideBytes = 4 << 10

// Admin changes the rules through the rules source. A caller is admitted
// with the bearer token, or with a client certificate the listener verified
// whose identity is in Options.ClientIdentities; a certificate alone (of a
// CA that also signs gateways' certificates) admits nobody. Safe for
// concurrent use.
type Admin struct {
	limiterv1.UnimplementedAdminServer
	src        *rulesource.Source
	top        TopSource
	resetter   Resetter
	token      []byte
	identities []string
	refused    *prometheus.CounterVec
	resets     *prometheus.CounterVec
	log        *slog.Logger
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
	// Top, when set, answers TopLimited: the keys each rule refused
	// most, over the region.
	Top TopSource
	// Resetter, when set, answers ResetKey; nil: ResetKey is
	// FAILED_PRECONDITION.
	Resetter Resetter
	// Logger gets the warning about a group-readable token file, and a
	// line per key reset (nil: slog.Default()).
	Logger *slog.Logger
}

// Resetter puts a key of a rule back to full (engine.Engine.ResetKey),
// reporting whether the other regions are told. Its errors wrap
// rules.ErrInvalid (a bad rule id or key), rulesource.ErrNotFound (no such
// rule) or ErrNotHome; any other is the store's.
type Resetter interface {
	ResetKey(ctx context.Context, ruleID, key string) (propagated bool, err error)
}

// ErrNotHome: a reset of a pinned rule's key asked outside its home
// region, which alone holds the key's bucket.
var ErrNotHome = errors.New("the key's home is another region")

// ErrNoResetter: ResetKey on an admin API made without a Resetter.
var ErrNoResetter = errors.New("key resets are not served here")

// Results of a reset, the values of the result label of
// limiter_admin_resets_total.
const (
	// ResetDone: the key was reset.
	ResetDone = "reset"
	// ResetRefused: a bad rule id or key, no such rule, a concurrency
	// rule or a pinned key homed elsewhere; nothing changed.
	ResetRefused = "refused"
	// ResetFailed: the store failed; nothing changed.
	ResetFailed = "failed"
)

// TopSource gives the k keys a rule refused most over the region, how
// many instances that covers, and an error when it is this instance's
// alone (topshare.Share).
type TopSource interface {
	Top(ctx context.Context, ruleID string, k int) ([]topkeys.Entry, int, error)
}

// TopFunc is a TopSource of a function.
type TopFunc func(ctx context.Context, ruleID string, k int) ([]topkeys.Entry, int, error)

// Top calls f.
func (f TopFunc) Top(ctx context.Context, ruleID string, k int) ([]topkeys.Entry, int, error) {
	return f(ctx, ruleID, k)
}

// Bounds of TopLimited's limit.
const (
	DefaultTopLimit = 10
	MaxTopLimit     = 1000
)

// New makes the admin API of src, registering its metrics on reg.
func New(src *rulesource.Source, opts Options, reg prometheus.Registerer) (*Admin, error) {
	a := &Admin{src: src, identities: opts.ClientIdentities, top: opts.Top, resetter: opts.Resetter, log: cmp.Or(opts.Logger, slog.Default())}
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
	a.resets = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "limiter_admin_resets_total",
		Help: "Admin resets of a rule's key, by result (reset; refused: a bad rule or key, a concurrency rule, a pinned key homed elsewhere; failed: the store failed). Calls refused for their credentials are in limiter_admin_calls_refused_total.",
	}, []string{"result"})
	if err := reg.Register(a.resets); err != nil {
		return nil, err
	}
	for _, r := range []string{ResetDone, ResetRefused, ResetFailed} {
		a.resets.WithLabelValues(r)
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

// identity names the caller that sent the authorization values and whose
// connection verified the client certificate cert (nil: none), when it is
// admitted: "admin-token", or "cert:" and the certificate's identities.
func (a *Admin) identity(authorization []string, cert *x509.Certificate) (string, bool) {
	for _, v := range authorization {
		if a.tokenOK(v) {
			return "admin-token", true
		}
	}
	if len(a.identities) > 0 && tlsconf.Allowed(cert, a.identities) {
		return "cert:" + strings.Join(tlsconf.Identities(cert), ","), true
	}
	return "", false
}

// check admits a caller that sent the authorization values and whose
// connection verified the client certificate cert (nil: none); a refusal
// is counted.
func (a *Admin) check(authorization []string, cert *x509.Certificate) *errRefused {
	if _, ok := a.identity(authorization, cert); ok {
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

// grpcAuthorization is the authorization metadata of a gRPC call.
func grpcAuthorization(ctx context.Context) []string {
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		return md.Get("authorization")
	}
	return nil
}

// authorize admits a gRPC call.
func (a *Admin) authorize(ctx context.Context) error {
	if e := a.check(grpcAuthorization(ctx), tlsconf.VerifiedGRPC(ctx)); e != nil {
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
	case errors.Is(err, rulesource.ErrNoStore), errors.Is(err, rulesource.ErrReadOnly),
		errors.Is(err, ErrNotHome), errors.Is(err, ErrNoResetter):
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

func (a *Admin) PutOverride(ctx context.Context, req *limiterv1.PutOverrideRequest) (*limiterv1.PutOverrideResponse, error) {
	rev, err := a.putOverride(ctx, req.GetRuleId(), req.GetKey(), []byte(req.GetOverride()))
	if err != nil {
		return nil, adminStatus(err)
	}
	return &limiterv1.PutOverrideResponse{Revision: rev}, nil
}

func (a *Admin) DeleteOverride(ctx context.Context, req *limiterv1.DeleteOverrideRequest) (*limiterv1.DeleteOverrideResponse, error) {
	rev, err := a.src.PutOverride(ctx, req.GetRuleId(), req.GetKey(), nil)
	if err != nil {
		return nil, adminStatus(err)
	}
	return &limiterv1.DeleteOverrideResponse{Revision: rev}, nil
}

// putOverride parses the override body of key and puts it in rule id.
func (a *Admin) putOverride(ctx context.Context, id, key string, body []byte) (uint64, error) {
	if len(body) > maxOverrideBytes {
		return 0, &rules.Error{Index: -1, ID: id, Field: rules.OverrideField(key, ""), Err: fmt.Errorf("over %d bytes", maxOverrideBytes)}
	}
	o, err := rules.ParseOverride(key, body)
	if err != nil {
		var e *rules.Error
		if errors.As(err, &e) {
			e.ID = id
		}
		return 0, err
	}
	return a.src.PutOverride(ctx, id, key, o)
}

func (a *Admin) ListRules(context.Context, *limiterv1.ListRulesRequest) (*limiterv1.ListRulesResponse, error) {
	set := a.src.Current()
	resp := &limiterv1.ListRulesResponse{Version: set.Version()}
	for _, r := range set.Rules() {
		resp.Rules = append(resp.Rules, &limiterv1.RuleEntry{Id: r.ID, Source: r.Source(), Yaml: string(r.YAML())})
	}
	return resp, nil
}

func (a *Admin) TopLimited(ctx context.Context, req *limiterv1.TopLimitedRequest) (*limiterv1.TopLimitedResponse, error) {
	resp, err := a.topLimited(ctx, req.GetRuleId(), int(req.GetLimit()))
	if err != nil {
		return nil, adminStatus(err)
	}
	return resp, nil
}

// topLimited answers TopLimited for ruleID, limit keys (0: the default).
func (a *Admin) topLimited(ctx context.Context, ruleID string, limit int) (*limiterv1.TopLimitedResponse, error) {
	if err := rules.CheckID(ruleID); err != nil {
		return nil, err
	}
	if limit < 0 || limit > MaxTopLimit {
		return nil, fmt.Errorf("%w: limit: must be 0 (%d) to %d, got %d", rules.ErrInvalid, DefaultTopLimit, MaxTopLimit, limit)
	}
	if a.src.Current().Get(ruleID) == nil {
		return nil, fmt.Errorf("%w: no rule %q", rulesource.ErrNotFound, ruleID)
	}
	resp := &limiterv1.TopLimitedResponse{}
	if a.top == nil {
		return resp, nil
	}
	keys, n, err := a.top.Top(ctx, ruleID, cmp.Or(limit, DefaultTopLimit))
	if err != nil {
		resp.Partial = err.Error()
	}
	resp.Instances = uint32(n)
	for _, k := range keys {
		resp.Keys = append(resp.Keys, &limiterv1.LimitedKey{Key: k.Key, Count: k.Count, Error: k.Error})
	}
	return resp, nil
}

func (a *Admin) ResetKey(ctx context.Context, req *limiterv1.ResetKeyRequest) (*limiterv1.ResetKeyResponse, error) {
	// The interceptor admitted the call (Authorize): this names who.
	who, ok := a.identity(grpcAuthorization(ctx), tlsconf.VerifiedGRPC(ctx))
	if !ok {
		// Served without the interceptor: refuse, as it would.
		if err := a.authorize(ctx); err != nil {
			return nil, err
		}
	}
	propagated, err := a.reset(ctx, req.GetRuleId(), req.GetKey(), who)
	if err != nil {
		return nil, adminStatus(err)
	}
	return &limiterv1.ResetKeyResponse{Propagated: propagated}, nil
}

// reset puts key of ruleID back to full for the caller who, counting and
// logging the outcome.
func (a *Admin) reset(ctx context.Context, ruleID, key, who string) (bool, error) {
	propagated, err := a.resetKey(ctx, ruleID, key)
	result := ResetDone
	switch {
	case err == nil:
	case errors.Is(err, rules.ErrInvalid), errors.Is(err, rulesource.ErrNotFound), errors.Is(err, ErrNotHome), errors.Is(err, ErrNoResetter):
		result = ResetRefused
	default:
		result = ResetFailed
	}
	a.resets.WithLabelValues(result).Inc()
	// The key is a client's: the line names it by a digest, as the
	// caller can compute it (sha256, the first 8 bytes in hex).
	sum := sha256.Sum256([]byte(key))
	attrs := []any{"rule", ruleID, "key_sha256", hex.EncodeToString(sum[:8]), "by", who}
	if err != nil {
		a.log.Warn("key reset refused", append(attrs, "result", result, "err", err)...)
		return false, err
	}
	a.log.Info("key reset", append(attrs, "propagated", propagated)...)
	return propagated, nil
}

func (a *Admin) resetKey(ctx context.Context, ruleID, key string) (bool, error) {
	if err := rules.CheckID(ruleID); err != nil {
		return false, err
	}
	if err := bucket.ValidateKey(key); err != nil {
		return false, fmt.Errorf("%w: key: %w", rules.ErrInvalid, err)
	}
	r := a.src.Current().Get(ruleID)
	switch {
	case r == nil:
		return false, fmt.Errorf("%w: no rule %q", rulesource.ErrNotFound, ruleID)
	case r.Concurrent():
		return false, fmt.Errorf("%w: rule_id: %q is a concurrency rule: its leases are released by their holders, not reset", rules.ErrInvalid, ruleID)
	case a.resetter == nil:
		return false, ErrNoResetter
	}
	return a.resetter.ResetKey(ctx, ruleID, key)
}

// routes serves the same calls over HTTP: PUT, DELETE and GET on
// /admin/rules/{id}, GET /admin/rules (bodies and answers in YAML), PUT
// and DELETE on /admin/rules/{id}/overrides/{key} (bodies and answers in
// JSON), GET /admin/rules/{id}/top?limit=N (JSON), and
// POST /admin/rules/{id}/keys/{key}:reset (JSON; a key holding '/' is
// sent escaped, %2F).
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
	override := func(w http.ResponseWriter, r *http.Request, rev uint64) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(struct { // nothing to do when the client went away
			Rule     string `json:"rule"`
			Key      string `json:"key"`
			Revision uint64 `json:"revision"`
		}{r.PathValue("id"), r.PathValue("key"), rev})
	}
	mux.HandleFunc("PUT /admin/rules/{id}/overrides/{key}", auth(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, maxOverrideBytes+1))
		if err != nil {
			http.Error(w, fmt.Sprintf("body: must be an override of at most %d bytes", maxOverrideBytes), http.StatusBadRequest)
			return
		}
		rev, err := a.putOverride(r.Context(), r.PathValue("id"), r.PathValue("key"), body)
		if err != nil {
			fail(w, err)
			return
		}
		override(w, r, rev)
	}))
	mux.HandleFunc("DELETE /admin/rules/{id}/overrides/{key}", auth(func(w http.ResponseWriter, r *http.Request) {
		rev, err := a.src.PutOverride(r.Context(), r.PathValue("id"), r.PathValue("key"), nil)
		if err != nil {
			fail(w, err)
			return
		}
		override(w, r, rev)
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
	mux.HandleFunc("GET /admin/rules/{id}/top", auth(func(w http.ResponseWriter, r *http.Request) {
		limit := 0
		if v := r.URL.Query().Get("limit"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil {
				http.Error(w, fmt.Sprintf("limit: %q is not a number", v), http.StatusBadRequest)
				return
			}
			limit = n
		}
		resp, err := a.topLimited(r.Context(), r.PathValue("id"), limit)
		if err != nil {
			fail(w, err)
			return
		}
		type key struct {
			Key   string `json:"key"`
			Count uint64 `json:"count"`
			Error uint64 `json:"error"`
		}
		out := struct {
			Rule      string `json:"rule"`
			Keys      []key  `json:"keys"`
			Instances uint32 `json:"instances"`
			Partial   string `json:"partial,omitempty"`
		}{Rule: r.PathValue("id"), Keys: []key{}, Instances: resp.Instances, Partial: resp.Partial}
		for _, k := range resp.Keys {
			out.Keys = append(out.Keys, key{k.Key, k.Count, k.Error})
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(out) // nothing to do when the client went away
	}))
	// A wildcard is a whole path segment: {key} holds the key and its
	// operation, "<key>:reset", whose suffix is cut here.
	mux.HandleFunc("POST /admin/rules/{id}/keys/{key}", auth(func(w http.ResponseWriter, r *http.Request) {
		key, ok := strings.CutSuffix(r.PathValue("key"), ":reset")
		if !ok {
			http.Error(w, fmt.Sprintf("%q: the only operation on a key is :reset", r.PathValue("key")), http.StatusNotFound)
			return
		}
		who, _ := a.identity(r.Header.Values("Authorization"), tlsconf.Verified(r.TLS))
		propagated, err := a.reset(r.Context(), r.PathValue("id"), key, who)
		if err != nil {
			fail(w, err)
			return
		}
		out := struct {
			Rule       string `json:"rule"`
			Key        string `json:"key"`
			Propagated bool   `json:"propagated"`
		}{r.PathValue("id"), key, propagated}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(out) // nothing to do when the client went away
	}))
	mux.HandleFunc("GET /admin/rules", auth(list))
	mux.HandleFunc("GET /admin/rules/{id}", auth(list))
}

// Page guards a page for browsers, such as the status page: open when no
// admin authentication is configured (no token, no client identities);
// otherwise it admits what the admin API admits, and also the admin token
// as the password of HTTP Basic authentication (any user name), which a
// browser asks for on its own. A refusal is counted as an admin call's.
func (a *Admin) Page(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(a.token) == 0 && len(a.identities) == 0 {
			h.ServeHTTP(w, r)
			return
		}
		authorization := r.Header.Values("Authorization")
		if _, pass, ok := r.BasicAuth(); ok {
			authorization = []string{"Bearer " + pass}
		}
		if e := a.check(authorization, tlsconf.Verified(r.TLS)); e != nil {
			code := http.StatusForbidden
			if e.code == codes.Unauthenticated {
				code = http.StatusUnauthorized
				w.Header().Set("WWW-Authenticate", `Basic realm="limiterd", charset="UTF-8"`)
			}
			http.Error(w, e.msg+" (a browser: any user name, the admin token as the password)", code)
			return
		}
		h.ServeHTTP(w, r)
	})
}
