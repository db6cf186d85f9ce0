package admin

import (
	"bytes"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/rules"
)

const fuzzToken = "fuzz-admin-token-0123456789"

// newFuzzAdmin is the HTTP admin API over a rules source without a bucket:
// a rule that passes every check is then refused only for the missing
// store (409).
func newFuzzAdmin(t testing.TB) http.Handler {
	src, tok, log := testSource(t, "rules:\n  - id: from-file\n    capacity: 1\n    refill_per_second: 1\n")
	a, err := New(src, Options{TokenFile: tok, Logger: log}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	a.Routes(mux)
	return mux
}

func put(h http.Handler, id, body string) (int, string) {
	req := httptest.NewRequest("PUT", "/admin/rules/"+id, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+fuzzToken)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	return w.Code, w.Body.String()
}

// TestAdminRuleBody: the outcomes the fuzz target tells apart.
func TestAdminRuleBody(t *testing.T) {
	h := newFuzzAdmin(t)
	for _, tt := range []struct {
		id, body string
		code     int
		names    string
	}{
		{"r", "id: r\ncapacity: 5\nrefill_per_second: 1\n", http.StatusConflict, "--nats.url"},
		{"r", "id: r\ncapacity: -5\nrefill_per_second: 1\n", http.StatusBadRequest, "capacity: "},
		{"y", "id: r\ncapacity: 5\nrefill_per_second: 1\n", http.StatusBadRequest, "id: "},
		{"from-file", "id: from-file\ncapacity: 5\nrefill_per_second: 1\n", http.StatusBadRequest, "rules file"},
	} {
		code, msg := put(h, tt.id, tt.body)
		if code != tt.code || !strings.Contains(msg, tt.names) {
			t.Errorf("PUT %q: %d %q, want %d naming %q", tt.body, code, msg, tt.code, tt.names)
		}
	}
}

// FuzzAdminRuleBody: any body PUT to /admin/rules/{id} is either refused
// 400 with an error that names the field (or, for a body that is not YAML
// at all, says so), or is a valid rule, refused here only for the missing
// store, whose YAML parses back to the same rule.
//
//	go test -run '^$' -fuzz FuzzAdminRuleBody -fuzztime 30s ./internal/admin
func FuzzAdminRuleBody(f *testing.F) {
	h := newFuzzAdmin(f)
	f.Add("r", []byte("id: r\ncapacity: 5\nrefill_per_second: 1\n"))
	f.Add("w", []byte(`{"id": "w", "algorithm": "sliding_window", "limit": 100, "window": "1m"}`))
	f.Add("p", []byte("id: p\ncapacity: 5\nrefill_per_second: 1\nhome: pinned\nhome_keys: {a: eu-west}\n"))
	f.Add("m", []byte("id: m\nlimit: 3\nwindow: 1h\nalgorithm: sliding_log\nmatch: {path: /a/**, methods: [GET]}\nkey_by: attr:x\n"))
	f.Add("from-file", []byte("id: from-file\ncapacity: 1\nrefill_per_second: 1\n"))
	f.Add("x", []byte("id: x\ncapacity: 1\nrefill_per_secnod: 1\n"))
	f.Add("x", []byte("id: x\ncapacity: &a 1\nlimit: *a\n"))
	f.Add("x", []byte("id: [x\n"))
	f.Add("x", []byte(""))
	f.Add("x", []byte("id: x\ncapacity: 1e400\nrefill_per_second: -0\n"))
	f.Add("y", []byte("id: x\ncapacity: 1\nrefill_per_second: 1\n"))
	f.Add("o", []byte("id: o\ncapacity: 5\nrefill_per_second: 1\noverrides: {acme: {capacity: 50}, b: {refill_per_second: 2}}\n"))
	f.Add("o", []byte("id: o\nlimit: 5\nwindow: 1m\nalgorithm: fixed_window\noverrides: {acme: {window: 1h, burst: 2}}\n"))
	f.Fuzz(func(t *testing.T, id string, body []byte) {
		if strings.ContainsAny(id, "/?#%") || id == "" || id == "." || id == ".." {
			return // not one path segment
		}
		req := httptest.NewRequest("PUT", "/admin/rules/x", bytes.NewReader(body))
		req.SetPathValue("id", id)
		req.URL.Path = "/admin/rules/" + id
		req.Header.Set("Authorization", "Bearer "+fuzzToken)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		msg := w.Body.String()
		switch w.Code {
		case http.StatusBadRequest:
			_, err := rules.ParseRule(body, rules.SourceAdmin)
			if err == nil {
				// A valid rule refused for its place: the id or the cap.
				if !strings.Contains(msg, "id: ") && !strings.Contains(msg, "rules: ") {
					t.Fatalf("a valid rule refused without naming id or rules: %q", msg)
				}
				return
			}
			var e *rules.Error
			if !errors.As(err, &e) || !errors.Is(err, rules.ErrInvalid) {
				t.Fatalf("ParseRule error not a *rules.Error: %v", err)
			}
			if e.Field == "" && !yamlLevel(e) {
				t.Fatalf("refused without naming a field: %q", msg)
			}
			if e.Field != "" && !strings.Contains(msg, e.Field+": ") {
				t.Fatalf("the answer %q does not name the field %s", msg, e.Field)
			}
		case http.StatusConflict:
			// Valid: it must round-trip.
			r, err := rules.ParseRule(body, rules.SourceAdmin)
			if err != nil {
				t.Fatalf("accepted (%q) but ParseRule refuses it: %v", msg, err)
			}
			again, err := rules.ParseRule(r.YAML(), rules.SourceAdmin)
			if err != nil {
				t.Fatalf("the YAML of an accepted rule does not parse: %v\n%s", err, r.YAML())
			}
			if !bytes.Equal(again.YAML(), r.YAML()) || again.Bucket() != r.Bucket() || again.ID != id {
				t.Fatalf("round trip changed the rule:\n%s\n%s", r.YAML(), again.YAML())
			}
		case http.StatusNotFound:
			// The mux refused a path that does not match the route.
		default:
			t.Fatalf("PUT answered %d: %q", w.Code, msg)
		}
	})
}

// yamlLevel reports whether e is about the body as a whole (not YAML, not
// one rule), where no field is at fault.
func yamlLevel(e *rules.Error) bool {
	m := e.Err.Error()
	return strings.HasPrefix(m, "yaml: ") || strings.Contains(m, "empty") || strings.Contains(m, "cannot unmarshal") ||
		strings.Contains(m, "a rule") || strings.Contains(m, "mapping")
}
