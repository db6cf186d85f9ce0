// Package tlsconf is the TLS set-up both daemons share: server and client
// configurations loaded from PEM files, with errors that name the flags,
// and the identities of a client certificate a listener verified.
package tlsconf

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"slices"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	"github.com/limiterd/limiterd/internal/secretfile"
)

// Files are the PEM files of one TLS link and the flags that name them,
// for error messages. A zero Files is no TLS.
type Files struct {
	// Cert and Key are this side's certificate and private key.
	Cert, Key string
	// CA is, for a server, the CA client certificates must chain to
	// (mTLS); for a client, the CA the server's certificate must chain to
	// (empty: the system's roots).
	CA string
	// CertFlag, KeyFlag and CAFlag name the flags of the three files.
	CertFlag, KeyFlag, CAFlag string
}

// Server is the configuration of a listener: Cert and Key required; with
// CA, client certificates signed by it are required and verified.
func Server(f Files) (*tls.Config, error) {
	if f.Cert == "" || f.Key == "" {
		return nil, fmt.Errorf("%s, %s: give both", f.CertFlag, f.KeyFlag)
	}
	cert, err := f.keyPair()
	if err != nil {
		return nil, err
	}
	tc := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if f.CA != "" {
		if tc.ClientCAs, err = Pool(f.CAFlag, f.CA); err != nil {
			return nil, err
		}
		tc.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return tc, nil
}

// Client is the configuration of a connection: the server is verified
// against CA (the system's roots without it), and Cert and Key, when
// given, are the client certificate.
func Client(f Files) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if f.CA != "" {
		pool, err := Pool(f.CAFlag, f.CA)
		if err != nil {
			return nil, err
		}
		tc.RootCAs = pool
	}
	if (f.Cert == "") != (f.Key == "") {
		return nil, fmt.Errorf("%s, %s: give both or neither", f.CertFlag, f.KeyFlag)
	}
	if f.Cert != "" {
		cert, err := f.keyPair()
		if err != nil {
			return nil, err
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// keyPair loads Cert and Key. The private key is a secret file: one open
// to other users is refused (package secretfile).
func (f Files) keyPair() (tls.Certificate, error) {
	cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("%s, %s: %w", f.CertFlag, f.KeyFlag, err)
	}
	if err := secretfile.Check(f.KeyFlag, f.Key, nil); err != nil {
		return tls.Certificate{}, err
	}
	return cert, nil
}

// Pool reads a PEM bundle of CA certificates; errors name flag.
func Pool(flag, file string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", flag, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: %s holds no PEM certificate", flag, file)
	}
	return pool, nil
}

// Identities are the names a certificate proves: its DNS and URI subject
// alternative names, and its common name.
func Identities(c *x509.Certificate) []string {
	ids := slices.Clone(c.DNSNames)
	for _, u := range c.URIs {
		ids = append(ids, u.String())
	}
	if c.Subject.CommonName != "" {
		ids = append(ids, c.Subject.CommonName)
	}
	return ids
}

// Verified returns the leaf of the client certificate the listener
// verified, or nil when the connection has none (plaintext, or TLS
// without client certificates).
func Verified(state *tls.ConnectionState) *x509.Certificate {
	if state == nil || len(state.VerifiedChains) == 0 || len(state.VerifiedChains[0]) == 0 {
		return nil
	}
	return state.VerifiedChains[0][0]
}

// VerifiedGRPC is Verified for the connection of a gRPC call.
func VerifiedGRPC(ctx context.Context) *x509.Certificate {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return nil
	}
	return Verified(&ti.State)
}

// Allowed reports whether the verified certificate c (nil: none) has one
// of the identities in allowed.
func Allowed(c *x509.Certificate, allowed []string) bool {
	if c == nil {
		return false
	}
	for _, id := range Identities(c) {
		if slices.Contains(allowed, id) {
			return true
		}
	}
	return false
}
