package admin

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// resetFunc is a Resetter of a function.
type resetFunc func(ctx context.Context, ruleID, key string) (bool, error)

func (f resetFunc) ResetKey(ctx context.Context, ruleID, key string) (bool, error) {
	return f(ctx, ruleID, key)
}

// TestResetOutcomes: what the Resetter answers becomes the status of
// both front doors, and each outcome is counted once per call; a
// concurrency rule never reaches the Resetter.
func TestResetOutcomes(t *testing.T) {
	src, tok, log := testSource(t, "rules:\n  - id: api\n    capacity: 1\n    refill_per_second: 1\n"+
		"  - id: held\n    algorithm: concurrency\n    limit: 1\n    lease_ttl: 1s\n")
	var answer error
	var asked []string
	a, err := New(src, Options{TokenFile: tok, Logger: log, Resetter: resetFunc(func(_ context.Context, rule, key string) (bool, error) {
		asked = append(asked, rule+"/"+key)
		return answer == nil, answer
	})}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	a.Routes(mux)
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer "+fuzzToken))
	for _, tt := range []struct {
		name     string
		rule     string
		answer   error
		code     codes.Code
		httpCode int
		result   string
	}{
		{"reset", "api", nil, codes.OK, http.StatusOK, ResetDone},
		{"home elsewhere", "api", fmt.Errorf("%w: reset the key in eu-west", ErrNotHome), codes.FailedPrecondition, http.StatusConflict, ResetRefused},
		{"store down", "api", errors.New("redis: connection refused"), codes.Unavailable, http.StatusServiceUnavailable, ResetFailed},
		{"concurrency rule", "held", nil, codes.InvalidArgument, http.StatusBadRequest, ResetRefused},
	} {
		t.Run(tt.name, func(t *testing.T) {
			answer, asked = tt.answer, nil
			before := testutil.ToFloat64(a.resets.WithLabelValues(tt.result))
			resp, err := a.ResetKey(ctx, &limiterv1.ResetKeyRequest{RuleId: tt.rule, Key: "k"})
			if status.Code(err) != tt.code || (err == nil && !resp.GetPropagated()) {
				t.Errorf("ResetKey = %v, %v; want %v", resp, err, tt.code)
			}
			req := httptest.NewRequest("POST", "/admin/rules/"+tt.rule+"/keys/k:reset", nil)
			req.Header.Set("Authorization", "Bearer "+fuzzToken)
			w := httptest.NewRecorder()
			mux.ServeHTTP(w, req)
			if w.Code != tt.httpCode {
				t.Errorf("HTTP reset = %d %q, want %d", w.Code, w.Body.String(), tt.httpCode)
			}
			if tt.code == codes.FailedPrecondition && !strings.Contains(w.Body.String(), "eu-west") {
				t.Errorf("HTTP reset = %q, want the home named", w.Body.String())
			}
			if got := testutil.ToFloat64(a.resets.WithLabelValues(tt.result)) - before; got != 2 {
				t.Errorf("limiter_admin_resets_total{result=%q} rose by %v, want 2", tt.result, got)
			}
			wantAsked := 2
			if tt.rule == "held" {
				wantAsked = 0 // refused before the store
			}
			if len(asked) != wantAsked {
				t.Errorf("the Resetter was asked %v, want %d calls", asked, wantAsked)
			}
		})
	}
}
