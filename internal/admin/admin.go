// Package admin is limiterd's admin API: rule changes over gRPC
// (limiter.v1.Admin) and HTTP (/admin/rules), authenticated by a bearer
// token or a client certificate, stored through the rules source.
package admin

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"

	"go.yaml.in/yaml/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/internal/rulesource"
	"github.com/limiterd/limiterd/internal/secretfile"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// maxRuleBytes bounds an admin request's body.
const maxRuleBytes = 64 << 10

// Admin changes the rules through the rules source. Callers are
// authenticated by a bearer token, or, on gRPC, by a client certificate the
// listener verified (mTLS).
type Admin struct {
	limiterv1.UnimplementedAdminServer
	src   *rulesource.Source
	token []byte
	mtls  bool
}

// MinTokenLen is the shortest admin token accepted.
const MinTokenLen = 16

// New makes the admin API of src; tokenFile (--admin.token-file) holds the
// bearer token, checked as package secretfile does.
func New(src *rulesource.Source, tokenFile string, mtls bool, log *slog.Logger) (*Admin, error) {
	a := &Admin{src: src, mtls: mtls}
	if tokenFile != "" {
		var err error
		if a.token, err = secretfile.Read("--admin.token-file", tokenFile, MinTokenLen, log); err != nil {
			return nil, err
		}
	}
	return a, nil
}

func (a *Admin) tokenOK(got string) bool {
	tok, ok := strings.CutPrefix(got, "Bearer ")
	return ok && len(a.token) > 0 && subtle.ConstantTimeCompare([]byte(tok), a.token) == 1
}

// authorize admits a gRPC call with the token or a verified client certificate.
func (a *Admin) authorize(ctx context.Context) error {
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		for _, v := range md.Get("authorization") {
			if a.tokenOK(v) {
				return nil
			}
		}
	}
	if a.mtls {
		if p, ok := peer.FromContext(ctx); ok {
			if ti, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(ti.State.VerifiedChains) > 0 {
				return nil
			}
		}
	}
	return status.Error(codes.Unauthenticated, "admin calls need a bearer token or a client certificate")
}

// interceptor authenticates every call of the Admin service.
func (a *Admin) Interceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if strings.HasPrefix(info.FullMethod, "/"+limiterv1.Admin_ServiceDesc.ServiceName+"/") {
		if err := a.authorize(ctx); err != nil {
			return nil, err
		}
	}
	return h(ctx, req)
}

func adminStatus(err error) error {
	switch {
	case errors.Is(err, rules.ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, rulesource.ErrNotFound):
		return status.Error(codes.NotFound, err.Error())
	case errors.Is(err, rulesource.ErrNoStore):
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
	if err := a.src.Delete(ctx, req.GetId()); err != nil {
		return nil, adminStatus(err)
	}
	return &limiterv1.DeleteRuleResponse{}, nil
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
			if !a.tokenOK(r.Header.Get("Authorization")) {
				w.Header().Set("WWW-Authenticate", `Bearer realm="limiterd admin"`)
				http.Error(w, "admin calls need a bearer token", http.StatusUnauthorized)
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
		if err := a.src.Delete(r.Context(), r.PathValue("id")); err != nil {
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
		yaml.NewEncoder(w).Encode(out)
	}
	mux.HandleFunc("GET /admin/rules", auth(list))
	mux.HandleFunc("GET /admin/rules/{id}", auth(list))
}
