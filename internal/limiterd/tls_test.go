package limiterd

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newCA(t *testing.T) *testCA {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue returns a PEM certificate and key for a server (127.0.0.1) or a client.
func (ca *testCA) issue(t *testing.T, serial int64, server bool) (certPEM, keyPEM []byte) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})
}

func writeFile(t *testing.T, dir, name string, b []byte) string {
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestMutualTLS: with a client CA, only clients holding a certificate it
// signed get an answer; plaintext and certificate-less clients do not.
func TestMutualTLS(t *testing.T) {
	dir := t.TempDir()
	ca := newCA(t)
	srvCert, srvKey := ca.issue(t, 2, true)
	cliCert, cliKey := ca.issue(t, 3, false)
	d := startDaemon(t, nil, func(o *Options) {
		o.TLSCertFile = writeFile(t, dir, "server.pem", srvCert)
		o.TLSKeyFile = writeFile(t, dir, "server.key", srvKey)
		o.TLSClientCAFile = writeFile(t, dir, "ca.pem", ca.pem)
	})
	roots := x509.NewCertPool()
	roots.AddCert(ca.cert)
	pair, err := tls.X509KeyPair(cliCert, cliKey)
	if err != nil {
		t.Fatal(err)
	}
	check := func(creds credentials.TransportCredentials) error {
		cc, err := grpc.NewClient(d.GRPCAddr(), grpc.WithTransportCredentials(creds))
		if err != nil {
			return err
		}
		defer cc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err = limiterv1.NewLimiterClient(cc).Check(ctx, &limiterv1.CheckRequest{RuleId: "tb", Key: "k"})
		return err
	}
	if err := check(credentials.NewTLS(&tls.Config{RootCAs: roots, Certificates: []tls.Certificate{pair}})); err != nil {
		t.Fatalf("client with a certificate: %v", err)
	}
	if err := check(credentials.NewTLS(&tls.Config{RootCAs: roots})); err == nil {
		t.Fatal("client without a certificate was answered")
	}
	if err := check(insecure.NewCredentials()); err == nil {
		t.Fatal("plaintext client was answered")
	}
}
