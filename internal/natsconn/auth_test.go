package natsconn_test

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
)

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func writeFile(t *testing.T, dir, name string, data []byte, mode os.FileMode) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, data, mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
	return p
}

func userSeed(t *testing.T) (pub string, seed []byte) {
	t.Helper()
	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	pub, _ = kp.PublicKey()
	seed, _ = kp.Seed()
	return pub, seed
}

// connect connects with a's options and reports the first error: the
// connection's, or the server's refusal.
func connect(t *testing.T, url string, a natsconn.Auth) (*nats.Conn, error) {
	t.Helper()
	opts, err := a.Options(quiet())
	if err != nil {
		t.Fatalf("Options: %v", err)
	}
	nc, err := nats.Connect(url, append(opts, nats.Timeout(5*time.Second))...)
	if err != nil {
		return nil, err
	}
	t.Cleanup(nc.Close)
	return nc, nil
}

// roundTrip publishes on a subject and reads it back through nc.
func roundTrip(t *testing.T, nc *nats.Conn) {
	t.Helper()
	sub, err := nc.SubscribeSync("probe")
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish("probe", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := sub.NextMsg(5 * time.Second); err != nil {
		t.Fatalf("message back: %v", err)
	}
}

func TestAuthNkeySeed(t *testing.T) {
	pub, seed := userSeed(t)
	srv := natstest.NewServer(t, natstest.Config(fmt.Sprintf("authorization { users = [ { nkey: %s } ] }", pub)))
	dir := t.TempDir()

	if _, err := connect(t, srv.URL(), natsconn.Auth{}); !errors.Is(err, nats.ErrAuthorization) {
		t.Fatalf("connect without credentials: %v, want %v", err, nats.ErrAuthorization)
	}
	_, other := userSeed(t)
	if _, err := connect(t, srv.URL(), natsconn.Auth{NkeySeedFile: writeFile(t, dir, "other.nk", other, 0o600)}); !errors.Is(err, nats.ErrAuthorization) {
		t.Fatalf("connect with an unknown nkey: %v, want %v", err, nats.ErrAuthorization)
	}
	nc, err := connect(t, srv.URL(), natsconn.Auth{NkeySeedFile: writeFile(t, dir, "user.nk", seed, 0o600)})
	if err != nil {
		t.Fatalf("connect with the nkey: %v", err)
	}
	roundTrip(t, nc)
}

// TestAuthCredsFileOperatorMode: a user JWT and its seed (a .creds file
// as nsc writes it) against a server in operator mode.
func TestAuthCredsFileOperatorMode(t *testing.T) {
	okp, _ := nkeys.CreateOperator()
	opub, _ := okp.PublicKey()
	ojwt, err := jwt.NewOperatorClaims(opub).Encode(okp)
	if err != nil {
		t.Fatal(err)
	}
	account := func(name string) (nkeys.KeyPair, string, string) {
		akp, _ := nkeys.CreateAccount()
		apub, _ := akp.PublicKey()
		ac := jwt.NewAccountClaims(apub)
		ac.Name = name
		ajwt, err := ac.Encode(okp)
		if err != nil {
			t.Fatal(err)
		}
		return akp, apub, ajwt
	}
	_, spub, sjwt := account("SYS")
	akp, apub, ajwt := account("LIMITER")
	creds := func(signer nkeys.KeyPair) []byte {
		upub, useed := userSeed(t)
		uc := jwt.NewUserClaims(upub)
		ujwt, err := uc.Encode(signer)
		if err != nil {
			t.Fatal(err)
		}
		b, err := jwt.FormatUserConfig(ujwt, useed)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	srv := natstest.NewServer(t, natstest.Config(fmt.Sprintf("operator: %q\nsystem_account: %s\nresolver: MEMORY\nresolver_preload: {\n  %s: %q\n  %s: %q\n}",
		ojwt, spub, spub, sjwt, apub, ajwt)))
	dir := t.TempDir()

	// A user signed by an account the operator never issued is refused.
	stranger, _ := nkeys.CreateAccount()
	if _, err := connect(t, srv.URL(), natsconn.Auth{CredsFile: writeFile(t, dir, "stranger.creds", creds(stranger), 0o600)}); !errors.Is(err, nats.ErrAuthorization) {
		t.Fatalf("connect with a foreign account's user: %v, want %v", err, nats.ErrAuthorization)
	}
	nc, err := connect(t, srv.URL(), natsconn.Auth{CredsFile: writeFile(t, dir, "user.creds", creds(akp), 0o600)})
	if err != nil {
		t.Fatalf("connect with the creds file: %v", err)
	}
	roundTrip(t, nc)
}

// TestAuthTLS: the server requires TLS and a client certificate signed by
// its CA; the client verifies the server against the CA.
func TestAuthTLS(t *testing.T) {
	ca := testenv.NewCA(t)
	srvCert, srvKey := ca.Issue(t, "nats", true)
	cliCert, cliKey := ca.Issue(t, "limiterd", false)
	srv := natstest.NewServer(t, natstest.Config(fmt.Sprintf("tls {\n  cert_file: %q\n  key_file: %q\n  ca_file: %q\n  verify: true\n}",
		srvCert, srvKey, ca.File)))

	if _, err := connect(t, srv.URL(), natsconn.Auth{TLSCAFile: ca.File}); err == nil {
		t.Fatal("connect without a client certificate to a server that requires one: no error")
	}
	if _, err := connect(t, srv.URL(), natsconn.Auth{TLSCAFile: testenv.NewCA(t).File,
		TLSCertFile: cliCert, TLSKeyFile: cliKey}); err == nil {
		t.Fatal("connect trusting another CA than the server's: no error")
	}
	nc, err := connect(t, srv.URL(), natsconn.Auth{TLSCAFile: ca.File, TLSCertFile: cliCert, TLSKeyFile: cliKey})
	if err != nil {
		t.Fatalf("connect over mTLS: %v", err)
	}
	if !nc.TLSRequired() {
		t.Error("the connection does not use TLS")
	}
	roundTrip(t, nc)
}

// TestAuthBadFlags: every bad value is an error at start naming its flag.
func TestAuthBadFlags(t *testing.T) {
	dir := t.TempDir()
	_, seed := userSeed(t)
	good := writeFile(t, dir, "good.nk", seed, 0o600)
	open := writeFile(t, dir, "open.nk", seed, 0o644)
	junk := writeFile(t, dir, "junk", []byte("not a key\n"), 0o600)
	pemJunk := writeFile(t, dir, "junk.pem", []byte("-----BEGIN NOTHING-----\n"), 0o644)
	ca := testenv.NewCA(t)
	certFile, keyFile := ca.Issue(t, "c", false)
	tests := []struct {
		name   string
		auth   natsconn.Auth
		flag   string
		target error
	}{
		{"creds and seed", natsconn.Auth{CredsFile: good, NkeySeedFile: good}, "--nats.creds-file and --nats.nkey-seed-file", natsconn.ErrConflict},
		{"admin creds and seed", natsconn.Auth{CredsFile: good, NkeySeedFile: good, Prefix: natsconn.AdminFlagPrefix}, "--admin.nats-creds-file and --admin.nats-nkey-seed-file", natsconn.ErrConflict},
		{"seed open to others", natsconn.Auth{NkeySeedFile: open}, "--nats.nkey-seed-file", nil},
		{"seed missing", natsconn.Auth{NkeySeedFile: filepath.Join(dir, "none")}, "--nats.nkey-seed-file", os.ErrNotExist},
		{"seed not a seed", natsconn.Auth{NkeySeedFile: junk}, "--nats.nkey-seed-file", nil},
		{"creds not creds", natsconn.Auth{CredsFile: junk}, "--nats.creds-file", nil},
		{"creds a bare seed", natsconn.Auth{CredsFile: good}, "--nats.creds-file", nil},
		{"creds open to others", natsconn.Auth{CredsFile: open}, "--nats.creds-file", nil},
		{"admin creds missing", natsconn.Auth{CredsFile: filepath.Join(dir, "none"), Prefix: natsconn.AdminFlagPrefix}, "--admin.nats-creds-file", os.ErrNotExist},
		{"ca missing", natsconn.Auth{TLSCAFile: filepath.Join(dir, "none")}, "--nats.tls-ca-file", os.ErrNotExist},
		{"ca no pem", natsconn.Auth{TLSCAFile: pemJunk}, "--nats.tls-ca-file", nil},
		{"cert without key", natsconn.Auth{TLSCertFile: certFile}, "--nats.tls-cert-file and --nats.tls-key-file", nil},
		{"key without cert", natsconn.Auth{TLSKeyFile: keyFile}, "--nats.tls-cert-file and --nats.tls-key-file", nil},
		{"cert with the wrong key", natsconn.Auth{TLSCertFile: certFile, TLSKeyFile: junk}, "--nats.tls-cert-file, --nats.tls-key-file", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.auth.Options(quiet())
			if err == nil {
				t.Fatal("no error")
			}
			if !strings.HasPrefix(err.Error(), tt.flag+": ") {
				t.Errorf("error %q does not start with %q", err, tt.flag+": ")
			}
			if tt.target != nil && !errors.Is(err, tt.target) {
				t.Errorf("error %v is not %v", err, tt.target)
			}
		})
	}
	if _, err := (&natsconn.Auth{NkeySeedFile: good, TLSCAFile: ca.File, TLSCertFile: certFile, TLSKeyFile: keyFile}).Options(quiet()); err != nil {
		t.Errorf("good files: %v", err)
	}
}

func TestAuthRegisterFlags(t *testing.T) {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	var main, admin natsconn.Auth
	main.RegisterFlags(fs, natsconn.FlagPrefix, true)
	admin.RegisterFlags(fs, natsconn.AdminFlagPrefix, false)
	if err := fs.Parse([]string{"--nats.creds-file", "a", "--nats.tls-ca-file", "b", "--nats.tls-cert-file", "c", "--nats.tls-key-file", "d", "--admin.nats-nkey-seed-file", "e"}); err != nil {
		t.Fatal(err)
	}
	want := natsconn.Auth{CredsFile: "a", TLSCAFile: "b", TLSCertFile: "c", TLSKeyFile: "d", Prefix: natsconn.FlagPrefix}
	if main != want {
		t.Errorf("main = %+v, want %+v", main, want)
	}
	if admin != (natsconn.Auth{NkeySeedFile: "e", Prefix: natsconn.AdminFlagPrefix}) {
		t.Errorf("admin = %+v", admin)
	}
	if fs.Lookup("admin.nats-tls-ca-file") != nil {
		t.Error("the admin connection has TLS flags of its own; it uses the main connection's")
	}
}

func TestWarnURLSecrets(t *testing.T) {
	tests := []struct {
		url  string
		warn bool
	}{
		{"nats://127.0.0.1:4222", false},
		{"nats://u:hunter2hunter2@127.0.0.1:4222", true},
		{"nats://a:4222,nats://s3cr3t-token@b:4222", true},
	}
	for _, tt := range tests {
		var buf bytes.Buffer
		natsconn.WarnURLSecrets("--nats.url", tt.url, slog.New(slog.NewTextHandler(&buf, nil)))
		if got := buf.Len() > 0; got != tt.warn {
			t.Errorf("%s: warned %v, want %v", natsconn.Redact(tt.url), got, tt.warn)
		}
		for _, secret := range []string{"hunter2", "s3cr3t"} {
			if strings.Contains(buf.String(), secret) || strings.Contains(natsconn.Redact(tt.url), secret) {
				t.Errorf("the warning or the redacted URL shows the secret: %s", buf.String())
			}
		}
	}
}
