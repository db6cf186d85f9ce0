package limiterd

import (
	"context"
	"crypto/tls"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/limiterd/limiterd/internal/testenv"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// TestMutualTLS: with a client CA, only clients holding a certificate it
// signed get an answer; plaintext and certificate-less clients do not.
func TestMutualTLS(t *testing.T) {
	ca := testenv.NewCA(t)
	srvCert, srvKey := ca.Issue(t, "server", true)
	cliCert, cliKey := ca.Issue(t, "test", false)
	d := startDaemon(t, nil, func(o *Options) {
		o.Server.TLSCertFile, o.Server.TLSKeyFile, o.Server.TLSClientCAFile = srvCert, srvKey, ca.File
	})
	roots := ca.Pool()
	pair, err := tls.LoadX509KeyPair(cliCert, cliKey)
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
