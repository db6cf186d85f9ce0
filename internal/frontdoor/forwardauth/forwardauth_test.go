package forwardauth

import (
	"net/http"
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
	h := Headers{}.WithDefaults().on()
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
