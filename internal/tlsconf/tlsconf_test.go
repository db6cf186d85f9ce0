package tlsconf

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"net/url"
	"os"
	"strings"
	"testing"

	"github.com/limiterd/limiterd/internal/testenv"
)

// TestAllowed: a certificate is allowed by a DNS SAN, a URI SAN or its
// common name; nil (no verified certificate) never is.
func TestAllowed(t *testing.T) {
	u, _ := url.Parse("spiffe://example.org/ops")
	c := &x509.Certificate{Subject: pkix.Name{CommonName: "ops-cn"}, DNSNames: []string{"ops.example.org"}, URIs: []*url.URL{u}}
	for _, tt := range []struct {
		allowed []string
		want    bool
	}{
		{[]string{"ops.example.org"}, true},
		{[]string{"spiffe://example.org/ops"}, true},
		{[]string{"ops-cn"}, true},
		{[]string{"gateway"}, false},
		{[]string{""}, false},
		{nil, false},
	} {
		if got := Allowed(c, tt.allowed); got != tt.want {
			t.Errorf("Allowed(%v) = %v, want %v", tt.allowed, got, tt.want)
		}
	}
	if Allowed(nil, []string{"ops-cn"}) {
		t.Error("no certificate allowed")
	}
	if Allowed(&x509.Certificate{}, []string{""}) {
		t.Error("an empty common name matched an empty identity")
	}
}

// TestErrorsNameTheFlags: missing or wrong files are errors naming the
// flag of the file at fault.
func TestErrorsNameTheFlags(t *testing.T) {
	flags := Files{CertFlag: "--x.cert", KeyFlag: "--x.key", CAFlag: "--x.ca"}
	for _, tt := range []struct {
		name string
		f    func() error
		flag string
	}{
		{"server without a key", func() error { f := flags; f.Cert = "c.pem"; _, err := Server(f); return err }, "--x.key"},
		{"server with missing files", func() error { f := flags; f.Cert, f.Key = "/none/c", "/none/k"; _, err := Server(f); return err }, "--x.cert"},
		{"client with a missing CA", func() error { f := flags; f.CA = "/none/ca"; _, err := Client(f); return err }, "--x.ca"},
		{"client with a certificate and no key", func() error { f := flags; f.Cert = "/none/c"; _, err := Client(f); return err }, "--x.key"},
	} {
		if err := tt.f(); err == nil || !strings.Contains(err.Error(), tt.flag) {
			t.Errorf("%s: %v, want an error naming %s", tt.name, err, tt.flag)
		}
	}
}

// TestKeyOpenToOthersRefused: a private key file other users may read is
// refused, naming its flag, on a server and a client alike.
func TestKeyOpenToOthersRefused(t *testing.T) {
	cert, key := testenv.NewCA(t).Issue(t, "localhost", true)
	if err := os.Chmod(key, 0o644); err != nil {
		t.Fatal(err)
	}
	f := Files{Cert: cert, Key: key, CertFlag: "--x.cert", KeyFlag: "--x.key", CAFlag: "--x.ca"}
	if _, err := Server(f); err == nil || !strings.HasPrefix(err.Error(), "--x.key: ") || !strings.Contains(err.Error(), "open to other users") {
		t.Fatalf("server with a 0644 key: %v", err)
	}
	if _, err := Client(f); err == nil || !strings.HasPrefix(err.Error(), "--x.key: ") {
		t.Fatalf("client with a 0644 key: %v", err)
	}
	if err := os.Chmod(key, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Server(f); err != nil {
		t.Fatalf("server with a 0600 key: %v", err)
	}
}
