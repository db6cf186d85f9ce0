package admin

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestPage: a page for browsers is open when no admin authentication is
// configured; with a token it asks a browser for it (401, Basic), admits
// it as a Basic password or a bearer token, and refuses (and counts) a
// wrong one.
func TestPage(t *testing.T) {
	src, tok, log := testSource(t, "rules:\n  - id: api\n    capacity: 1\n    refill_per_second: 1\n")
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "the page") })
	get := func(a *Admin, set func(*http.Request)) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		if set != nil {
			set(req)
		}
		rec := httptest.NewRecorder()
		a.Page(ok).ServeHTTP(rec, req)
		return rec
	}

	open, err := New(src, Options{Logger: log}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if rec := get(open, nil); rec.Code != http.StatusOK {
		t.Errorf("no admin authentication configured: %d, want the page", rec.Code)
	}

	a, err := New(src, Options{TokenFile: tok, Logger: log}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	rec := get(a, nil)
	if rec.Code != http.StatusUnauthorized || !strings.HasPrefix(rec.Header().Get("WWW-Authenticate"), "Basic ") || strings.Contains(rec.Body.String(), "the page") {
		t.Errorf("no credentials: %d %q, want 401 asking for Basic", rec.Code, rec.Header().Get("WWW-Authenticate"))
	}
	if rec := get(a, func(r *http.Request) { r.SetBasicAuth("anyone", fuzzToken) }); rec.Code != http.StatusOK || rec.Body.String() != "the page" {
		t.Errorf("the token as a Basic password: %d, want the page", rec.Code)
	}
	if rec := get(a, func(r *http.Request) { r.Header.Set("Authorization", "Bearer "+fuzzToken) }); rec.Code != http.StatusOK {
		t.Errorf("the bearer token: %d, want the page", rec.Code)
	}
	before := testutil.ToFloat64(a.refused.WithLabelValues(ReasonBadToken))
	for _, set := range []func(*http.Request){
		func(r *http.Request) { r.SetBasicAuth("admin", fuzzToken+"x") },
		func(r *http.Request) { r.SetBasicAuth(fuzzToken, "") },
		func(r *http.Request) { r.Header.Set("Authorization", "Bearer wrong") },
	} {
		if rec := get(a, set); rec.Code != http.StatusUnauthorized || strings.Contains(rec.Body.String(), "the page") {
			t.Errorf("a wrong token: %d, want 401", rec.Code)
		}
	}
	if got := testutil.ToFloat64(a.refused.WithLabelValues(ReasonBadToken)) - before; got != 3 {
		t.Errorf("%v refusals counted, want 3", got)
	}
}
