package statuspage

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"
)

func fixture() Status {
	now := time.Now()
	return Status{
		Region: "us-east", Store: "Redis 127.0.0.1:7000", Version: "abc123",
		Rules:        []Rule{{ID: "api", Algorithm: "token_bucket", Limit: "100, +10/s", Home: "local", Source: "file", Overrides: 2}},
		Regions:      []Region{{Name: "us-east", Self: true}, {Name: "eu-west", Address: "10.0.0.2:8081", State: "TRANSIENT_FAILURE"}},
		Lag:          []Lag{{Source: "eu-west", Pending: 42, LastApplied: now.Add(-3 * time.Second)}},
		Nodes:        []Node{{Addr: "127.0.0.1:7000"}, {Addr: "127.0.0.1:7001", Err: "dial tcp: connection refused"}},
		Top:          []Top{{Rule: "api", Keys: []TopKey{{Key: "<script>alert(1)</script>", Count: 9}}}},
		Dependencies: "store: redis ok\nnats: ok", At: now,
	}
}

// TestPageShowsEveryPart: each part of the status is on the page, the
// key of a refused client escaped, and the page's one style and one script
// carry the nonce its Content-Security-Policy allows (and nothing else
// runs).
func TestPageShowsEveryPart(t *testing.T) {
	h := Handler(Options{Status: func(context.Context) Status { return fixture() }})
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("GET /: %d", rec.Code)
	}
	body := rec.Body.String()
	for _, want := range []string{"us-east", "abc123", "100, &#43;10/s", "eu-west", "TRANSIENT_FAILURE", "42",
		"3s ago", "connection refused", "answering", "store: redis ok", "&lt;script&gt;alert(1)&lt;/script&gt;</span> 9"} {
		if !strings.Contains(body, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	if strings.Contains(body, "<script>alert") {
		t.Error("a refused key is written unescaped")
	}
	if strings.Contains(body, `id="try"`) {
		t.Error("a form without Options.Try")
	}
	csp := rec.Header().Get("Content-Security-Policy")
	m := regexp.MustCompile(`script-src 'nonce-([A-Za-z0-9_-]+)'`).FindStringSubmatch(csp)
	if m == nil || !strings.Contains(csp, "default-src 'none'") {
		t.Fatalf("Content-Security-Policy %q: want default-src 'none' and a script nonce", csp)
	}
	if n := strings.Count(body, `nonce="`+m[1]+`"`); n != 2 || strings.Count(body, "<script") != 1 || strings.Count(body, "<style") != 1 {
		t.Errorf("%d elements carry the nonce; want the one style and the one script", n)
	}
	if got := rec.Header().Get("Cache-Control"); got != "no-store" {
		t.Errorf("Cache-Control %q, want no-store", got)
	}

	// The live part alone, for the page's refresh.
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/?part=live", nil))
	if b := rec.Body.String(); rec.Code != http.StatusOK || strings.Contains(b, "<html") || !strings.Contains(b, `id="rules"`) {
		t.Errorf("GET /?part=live: %d, want the live part alone:\n%s", rec.Code, b)
	}
}

// TestTryForm: the form's fields are validated, naming the one at fault,
// before any check; a valid one is answered, spending only when asked; a
// cross-origin POST is refused and checks nothing.
func TestTryForm(t *testing.T) {
	var tried []TryRequest
	h := Handler(Options{
		Status: func(context.Context) Status { return fixture() },
		Try: func(_ context.Context, req TryRequest) (TryResult, error) {
			tried = append(tried, req)
			if req.Rule == "nope" {
				return TryResult{}, errors.New(`rule_id: no rule "nope"`)
			}
			return TryResult{Allowed: !req.Spend, Remaining: 5.004321, Limit: 10, RetryAfter: 2 * time.Second}, nil
		},
	})
	post := func(form url.Values, header http.Header) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(form.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		for k, v := range header {
			req.Header[k] = v
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	for _, tt := range []struct {
		name string
		form url.Values
		want string
	}{
		{"no rule", url.Values{"key": {"k"}}, "rule: required"},
		{"no key", url.Values{"rule": {"api"}}, "key: required"},
		{"long key", url.Values{"rule": {"api"}, "key": {strings.Repeat("k", maxField+1)}}, "key: at most 512 bytes"},
		{"cost not a number", url.Values{"rule": {"api"}, "key": {"k"}, "cost": {"lots"}}, `cost: a number above 0, got &#34;lots&#34;`},
		{"cost zero", url.Values{"rule": {"api"}, "key": {"k"}, "cost": {"0"}}, "cost: a number above 0"},
		{"cost NaN", url.Values{"rule": {"api"}, "key": {"k"}, "cost": {"NaN"}}, "cost: a number above 0"},
		{"body too large", url.Values{"rule": {"api"}, "key": {strings.Repeat("k", maxFormBytes)}}, "form: at most 4096 bytes"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rec := post(tt.form, nil)
			if rec.Code != http.StatusBadRequest || !strings.Contains(rec.Body.String(), tt.want) {
				t.Errorf("%d, want 400 naming %q", rec.Code, tt.want)
			}
		})
	}
	if len(tried) != 0 {
		t.Fatalf("bad forms were checked: %v", tried)
	}

	rec := post(url.Values{"rule": {"api"}, "key": {"k"}, "cost": {"2.5"}}, nil)
	if b := rec.Body.String(); !strings.Contains(b, "allowed") || !strings.Contains(b, "remaining 5 of 10") || !strings.Contains(b, "nothing spent") {
		t.Errorf("usage: %s", b)
	}
	rec = post(url.Values{"rule": {"api"}, "key": {"k"}, "spend": {"on"}}, nil)
	if b := rec.Body.String(); !strings.Contains(b, "refused</span>, retry after 2s") || !strings.Contains(b, "refused: nothing spent") {
		t.Errorf("check: %s", b)
	}
	rec = post(url.Values{"rule": {"nope"}, "key": {"k"}}, nil)
	if !strings.Contains(rec.Body.String(), "rule_id: no rule &#34;nope&#34;") {
		t.Errorf("an unknown rule's error is not shown: %s", rec.Body.String())
	}
	want := []TryRequest{{Rule: "api", Key: "k", Cost: 2.5}, {Rule: "api", Key: "k", Cost: 1, Spend: true}, {Rule: "nope", Key: "k", Cost: 1}}
	if len(tried) != len(want) {
		t.Fatalf("tried %v, want %v", tried, want)
	}
	for i := range want {
		if tried[i] != want[i] {
			t.Errorf("try %d: %+v, want %+v", i, tried[i], want[i])
		}
	}

	n := len(tried)
	rec = post(url.Values{"rule": {"api"}, "key": {"k"}, "spend": {"on"}}, http.Header{"Sec-Fetch-Site": {"cross-site"}})
	if rec.Code != http.StatusForbidden || len(tried) != n {
		t.Errorf("a cross-origin POST: %d, %d checks; want 403 and none", rec.Code, len(tried)-n)
	}
	rec = post(url.Values{"rule": {"api"}, "key": {"k"}}, http.Header{"Origin": {"https://evil.example"}})
	if rec.Code != http.StatusForbidden || len(tried) != n {
		t.Errorf("a POST from another origin: %d, %d checks; want 403 and none", rec.Code, len(tried)-n)
	}
}

func TestMethods(t *testing.T) {
	h := Handler(Options{Status: func(context.Context) Status { return fixture() }})
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodDelete, "/", nil))
	if rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Allow") == "" {
		t.Errorf("DELETE /: %d, Allow %q; want 405 with Allow", rec.Code, rec.Header().Get("Allow"))
	}
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/", strings.NewReader("rule=a&key=b")))
	if rec.Code != http.StatusNotFound {
		t.Errorf("POST without Options.Try: %d, want 404", rec.Code)
	}
}
