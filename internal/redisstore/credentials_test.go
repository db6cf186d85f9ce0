package redisstore

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// TestCredentialsTLS: against a real redis-server that serves only TLS and
// requires client certificates, the flags' CA verifies the server and the
// client certificate is accepted; a client with another CA, or without a
// certificate, is refused.
func TestCredentialsTLS(t *testing.T) {
	ca := testenv.NewCA(t)
	srvCert, srvKey := ca.Issue(t, "redis", true)
	cliCert, cliKey := ca.Issue(t, "limiterd", false)
	pair, err := tls.LoadX509KeyPair(cliCert, cliKey)
	if err != nil {
		t.Fatal(err)
	}
	node := redistest.NewTLSNode(t, redistest.TLSFiles{Cert: srvCert, Key: srvKey, CA: ca.File},
		&tls.Config{RootCAs: ca.Pool(), Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12})
	other := testenv.NewCA(t)
	otherCert, otherKey := other.Issue(t, "limiterd", false)

	ping := func(c Credentials) error {
		var o Options
		if err := c.Apply(&o); err != nil {
			return err
		}
		cl := redis.NewClient(&redis.Options{Addr: node.Addr(), TLSConfig: o.TLS, MaxRetries: -1, DialTimeout: 2 * time.Second})
		defer cl.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return cl.Ping(ctx).Err()
	}
	for _, tt := range []struct {
		name string
		c    Credentials
		ok   bool
	}{
		{"CA and client certificate", Credentials{TLSCAFile: ca.File, TLSCertFile: cliCert, TLSKeyFile: cliKey}, true},
		{"--redis.tls with the files", Credentials{TLS: true, TLSCAFile: ca.File, TLSCertFile: cliCert, TLSKeyFile: cliKey}, true},
		{"no client certificate", Credentials{TLSCAFile: ca.File}, false},
		{"the system's roots", Credentials{TLS: true, TLSCertFile: cliCert, TLSKeyFile: cliKey}, false},
		{"another CA", Credentials{TLSCAFile: other.File, TLSCertFile: cliCert, TLSKeyFile: cliKey}, false},
		{"a certificate of another CA", Credentials{TLSCAFile: ca.File, TLSCertFile: otherCert, TLSKeyFile: otherKey}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := ping(tt.c)
			if tt.ok && err != nil {
				t.Fatalf("PING: %v", err)
			}
			if !tt.ok && err == nil {
				t.Fatal("PING answered")
			}
			var uerr x509.UnknownAuthorityError
			if tt.name == "another CA" && !errors.As(err, &uerr) {
				t.Fatalf("PING with another CA: %v, want an unknown authority error", err)
			}
		})
	}
}

// TestCredentialsTLSErrors: bad files are refused at Apply, naming the flag.
func TestCredentialsTLSErrors(t *testing.T) {
	ca := testenv.NewCA(t)
	cert, key := ca.Issue(t, "limiterd", false)
	for _, tt := range []struct {
		name string
		c    Credentials
		flag string
	}{
		{"missing CA file", Credentials{TLSCAFile: "/nonexistent/ca.pem"}, "--redis.tls-ca-file"},
		{"CA file without PEM", Credentials{TLSCAFile: key}, "--redis.tls-ca-file"},
		{"a certificate without its key", Credentials{TLSCertFile: cert}, "--redis.tls-key-file"},
		{"a key that is not the certificate's", Credentials{TLSCertFile: cert, TLSKeyFile: ca.File}, "--redis.tls-cert-file"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var o Options
			err := tt.c.Apply(&o)
			if err == nil || !strings.Contains(err.Error(), tt.flag) {
				t.Fatalf("Apply: %v, want an error naming %s", err, tt.flag)
			}
		})
	}
}
