package redisstore

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// TestConnTLS: against a real redis-server that serves only TLS and
// requires client certificates, the flags' CA verifies the server and the
// client certificate is accepted; a client with another CA, or without a
// certificate, is refused.
func TestConnTLS(t *testing.T) {
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

	ping := func(c Conn) error {
		c.Addrs = []string{node.Addr()}
		o, err := c.Options(nil)
		if err != nil {
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
		c    Conn
		ok   bool
	}{
		{"CA and client certificate", Conn{TLSCAFile: ca.File, TLSCertFile: cliCert, TLSKeyFile: cliKey}, true},
		{"--redis.tls with the files", Conn{TLS: true, TLSCAFile: ca.File, TLSCertFile: cliCert, TLSKeyFile: cliKey}, true},
		{"no client certificate", Conn{TLSCAFile: ca.File}, false},
		{"the system's roots", Conn{TLS: true, TLSCertFile: cliCert, TLSKeyFile: cliKey}, false},
		{"another CA", Conn{TLSCAFile: other.File, TLSCertFile: cliCert, TLSKeyFile: cliKey}, false},
		{"a certificate of another CA", Conn{TLSCAFile: ca.File, TLSCertFile: otherCert, TLSKeyFile: otherKey}, false},
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

// TestConnTLSErrors: bad files are refused at Apply, naming the flag.
func TestConnTLSErrors(t *testing.T) {
	ca := testenv.NewCA(t)
	cert, key := ca.Issue(t, "limiterd", false)
	for _, tt := range []struct {
		name string
		c    Conn
		flag string
	}{
		{"missing CA file", Conn{TLSCAFile: "/nonexistent/ca.pem"}, "--redis.tls-ca-file"},
		{"CA file without PEM", Conn{TLSCAFile: key}, "--redis.tls-ca-file"},
		{"a certificate without its key", Conn{TLSCertFile: cert}, "--redis.tls-key-file"},
		{"a key that is not the certificate's", Conn{TLSCertFile: cert, TLSKeyFile: ca.File}, "--redis.tls-cert-file"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.c.Options(nil)
			if err == nil || !strings.Contains(err.Error(), tt.flag) {
				t.Fatalf("Options: %v, want an error naming %s", err, tt.flag)
			}
		})
	}
}

// TestTuningDefaultsAreTheFlags: the flags' defaults are DefaultTuning,
// which is valid, and each flag sets its own field.
func TestTuningDefaultsAreTheFlags(t *testing.T) {
	var got Tuning
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	got.RegisterFlags(fs)
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	if want := DefaultTuning(); got != want {
		t.Fatalf("flag defaults %+v, want DefaultTuning %+v", got, want)
	}
	if err := got.Validate(); err != nil {
		t.Fatalf("DefaultTuning is invalid: %v", err)
	}
	if err := fs.Parse([]string{"--redis.linger=0", "--redis.no-coalesce", "--redis.pipelines-per-node=3"}); err != nil {
		t.Fatal(err)
	}
	if got.Linger != 0 || !got.NoCoalesce || got.PipelinesPerNode != 3 {
		t.Fatalf("after the flags: %+v", got)
	}
	if err := got.Validate(); err != nil {
		t.Fatalf("linger 0 (never waits) refused: %v", err)
	}
}

// TestTuningValidate: every field out of range is reported at once, each
// naming its flag, and Validate changes nothing.
func TestTuningValidate(t *testing.T) {
	bad := Tuning{Timeout: 0, ReplyDeadline: 2 * time.Minute, MaxQueueWait: 10 * time.Millisecond, DialTimeout: -1,
		PoolSize: -1, MaxBatch: 0, PipelinesPerNode: 65, Linger: 10 * time.Millisecond, BreakerOpen: 0}
	before := bad
	err := bad.Validate()
	if bad != before {
		t.Fatalf("Validate changed its input: %+v, was %+v", bad, before)
	}
	for _, flag := range []string{"--redis.timeout", "--redis.reply-deadline", "--redis.dial-timeout", "--redis.pool-size",
		"--redis.max-batch", "--redis.pipelines-per-node", "--redis.linger", "--redis.breaker-open"} {
		if err == nil || !strings.Contains(err.Error(), flag+":") {
			t.Errorf("Validate = %v: want an error naming %s", err, flag)
		}
	}
	if err != nil && strings.Contains(err.Error(), "--redis.max-queue-wait:") {
		t.Errorf("Validate = %v: --redis.max-queue-wait is valid", err)
	}
}

// TestConnValidate: credentials without an address are refused naming the
// flags; none at all is the embedded store's case.
func TestConnValidate(t *testing.T) {
	if err := (Conn{}).Validate(); err != nil {
		t.Fatalf("no Redis: %v", err)
	}
	for _, c := range []Conn{{Username: "u"}, {PasswordFile: "p"}, {TLS: true}, {TLSCAFile: "ca.pem"}} {
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "need --redis.addrs") {
			t.Errorf("%+v: %v, want an error naming --redis.addrs", c, err)
		}
	}
	if err := (Conn{Addrs: []string{"127.0.0.1:1"}, Username: "u", TLS: true}).Validate(); err != nil {
		t.Errorf("with an address: %v", err)
	}
}
