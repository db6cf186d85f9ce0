package forwardauth

import (
	"flag"
	"net/http"
	"net/http/httptest"
	"path"
	"strings"
	"testing"
)

// FuzzForwardAuthAttributes: whatever the proxy's headers hold, reading
// them never panics, and a path read is clean and absolute.
func FuzzForwardAuthAttributes(f *testing.F) {
	f.Add("alice", "/api/orders?page=2", "GET", "203.0.113.9")
	f.Add("", "/api/%2e%2e/admin", "POST", "1.1.1.1, 2001:db8::1")
	f.Add("u", "//x/../y", "", ",")
	f.Add("u", "/a b", "GET", "")
	h := DefaultHeaders().on()
	f.Fuzz(func(t *testing.T, user, uri, method, ip string) {
		r, err := http.NewRequest("GET", "http://limiterd"+Path, nil)
		if err != nil {
			t.Fatal(err)
		}
		for k, v := range map[string]string{DefaultUserHeader: user, DefaultURIHeader: uri, DefaultMethodHeader: method, DefaultIPHeader: ip} {
			if v != "" {
				r.Header[k] = []string{v}
			}
		}
		a, err := h.attributes(r)
		if err != nil {
			return
		}
		if a.GetUser() == "" || a.GetMethod() == "" || a.GetIp() == "" {
			t.Fatalf("attributes %v read without an error from %q %q %q %q", a, user, uri, method, ip)
		}
		if p := a.GetPath(); !strings.HasPrefix(p, "/") || path.Clean(p) != p {
			t.Fatalf("path %q from %q is not clean and absolute", p, uri)
		}
	})
}

// TestForwardAuthPath: the URI header is matched as the backend will see
// it. A URI the proxy passes on raw and a backend could read as another
// path (an encoded '/', '.', '%', '\' or ';', a dot-segment, a ';'
// parameter, an empty segment, a control byte) is refused naming the
// header; other escapes are decoded and one trailing '/' dropped.
func TestForwardAuthPath(t *testing.T) {
	h := DefaultHeaders().on()
	for _, tt := range []struct {
		name, uri, want string // want "": refused
	}{
		{"plain", "/reports/1", "/reports/1"},
		{"query kept apart", "/reports/1?a=%2F..;x", "/reports/1"},
		{"root", "/", "/"},
		{"trailing slash", "/reports/", "/reports"},
		{"unreserved escape", "/%72eports/1", "/reports/1"},
		{"escaped space", "/a%20b", "/a b"},
		{"encoded dot-segment", "/reports/%2e%2e/x", ""},
		{"encoded dot-segment upper", "/reports/%2E%2E/x", ""},
		{"half encoded dot-segment", "/reports/.%2e/x", ""},
		{"encoded slash", "/reports/..%2Fx", ""},
		{"encoded slash lower", "/reports%2fx", ""},
		{"encoded percent", "/reports/%252e%252e/x", ""},
		{"encoded backslash", "/reports%5C..%5Cx", ""},
		{"encoded semicolon", "/reports%3Ba=b/1", ""},
		{"semicolon parameter", "/reports;a=b/1", ""},
		{"dot-segment", "/reports/../x", ""},
		{"dot segment", "/reports/./1", ""},
		{"trailing dot-segment", "/reports/..", ""},
		{"empty segment", "/reports//1", ""},
		{"leading empty segment", "//reports/1", ""},
		{"backslash", "/reports\\..\\x", ""},
		{"encoded NUL", "/reports/1%00.json", ""},
		{"bad escape", "/reports/%zz", ""},
		{"not a path", "reports/1", ""},
		{"absolute URI", "http://x/reports/1", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", Path, nil)
			r.Header.Set(DefaultUserHeader, "alice")
			r.Header.Set(DefaultURIHeader, tt.uri)
			r.Header.Set(DefaultMethodHeader, "GET")
			r.Header.Set(DefaultIPHeader, "203.0.113.9")
			a, err := h.attributes(r)
			switch {
			case tt.want == "" && err == nil:
				t.Fatalf("%q read as path %q, want it refused", tt.uri, a.GetPath())
			case tt.want == "" && !strings.Contains(err.Error(), DefaultURIHeader):
				t.Fatalf("%q refused with %q, which does not name %s", tt.uri, err, DefaultURIHeader)
			case tt.want != "" && err != nil:
				t.Fatalf("%q refused: %v, want path %q", tt.uri, err, tt.want)
			case tt.want != "" && a.GetPath() != tt.want:
				t.Fatalf("%q read as path %q, want %q", tt.uri, a.GetPath(), tt.want)
			}
		})
	}
}

// TestConfigFlags: the flags' defaults are DefaultConfig; "none" turns a
// header off (""), and Validate reports each bad field naming its flag
// without changing its input.
func TestConfigFlags(t *testing.T) {
	var c Config
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	c.RegisterFlags(fs)
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	if c != DefaultConfig() || c.Serving() {
		t.Fatalf("flag defaults %+v, want DefaultConfig %+v, not serving", c, DefaultConfig())
	}
	if err := fs.Parse([]string{"--forward-auth.listen-address=127.0.0.1:0", "--forward-auth.user-header=none", "--forward-auth.plan-header=X-Plan"}); err != nil {
		t.Fatal(err)
	}
	if !c.Serving() || c.Headers.User != "" || c.Headers.Plan != "X-Plan" || c.Headers.URI != DefaultURIHeader {
		t.Fatalf("after the flags: %+v", c)
	}
	if err := c.Validate(); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	bad := Config{SecretFile: "s", Headers: Headers{User: "X Auth: User", IP: "X-Forwarded-For"}}
	before := bad
	err := bad.Validate()
	if bad != before {
		t.Fatalf("Validate changed its input")
	}
	for _, want := range []string{"--forward-auth.user-header:", "--forward-auth.secret-file:"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate = %v, want an error naming %s", err, want)
		}
	}
}
