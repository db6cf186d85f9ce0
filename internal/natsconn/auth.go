package natsconn

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/limiterd/limiterd/internal/secretfile"
	"github.com/limiterd/limiterd/internal/tlsconf"
)

// Flag name prefixes of Auth: the main connection's flags are
// --nats.creds-file and so on; the admin writer's --admin.nats-creds-file.
const (
	FlagPrefix      = "nats."
	AdminFlagPrefix = "admin.nats-"
)

// ErrConflict is wrapped by the error of two options that exclude each
// other (a credentials file and an nkey seed file).
var ErrConflict = errors.New("mutually exclusive")

// Auth is how a daemon authenticates to NATS and verifies the server: a
// user credentials file (a user JWT and its nkey seed, as nsc writes it) or
// an nkey seed file, and TLS (a CA to verify the server, and a client
// certificate when the server asks for one). The zero value connects
// without credentials over plain TCP, or TLS verified against the system's
// roots when the server asks for TLS. Prefix names the flags in errors.
type Auth struct {
	CredsFile    string
	NkeySeedFile string
	TLSCAFile    string
	TLSCertFile  string
	TLSKeyFile   string
	// Prefix of the flag names, FlagPrefix when empty.
	Prefix string
}

func (a *Auth) flag(name string) string {
	p := a.Prefix
	if p == "" {
		p = FlagPrefix
	}
	return "--" + p + name
}

// RegisterFlags defines the flags of a's credentials on fs under prefix
// (FlagPrefix or AdminFlagPrefix), and the TLS flags when withTLS is set.
func (a *Auth) RegisterFlags(fs *flag.FlagSet, prefix string, withTLS bool) {
	a.Prefix = prefix
	who := "NATS"
	if prefix == AdminFlagPrefix {
		who = "the admin API's NATS connection, the only one that writes the rules bucket,"
	}
	fs.StringVar(&a.CredsFile, prefix+"creds-file", "", "user credentials file (JWT and nkey seed) of "+who+" (mode 0600)")
	fs.StringVar(&a.NkeySeedFile, prefix+"nkey-seed-file", "", "nkey seed file of "+who+" (mode 0600)")
	if withTLS {
		fs.StringVar(&a.TLSCAFile, prefix+"tls-ca-file", "", "CA bundle that NATS server certificates must chain to (connects over TLS)")
		fs.StringVar(&a.TLSCertFile, prefix+"tls-cert-file", "", "client certificate presented to NATS (PEM; needs --"+prefix+"tls-key-file)")
		fs.StringVar(&a.TLSKeyFile, prefix+"tls-key-file", "", "private key of --"+prefix+"tls-cert-file (PEM)")
	}
}

// Set reports whether a gives a credential of its own.
func (a *Auth) Set() bool { return a.CredsFile != "" || a.NkeySeedFile != "" }

// Validate reports the combinations that cannot work, each error naming
// its flags; it reads no file (Options does).
func (a *Auth) Validate() error {
	var errs []error
	if a.CredsFile != "" && a.NkeySeedFile != "" {
		errs = append(errs, fmt.Errorf("%s and %s: %w, give one", a.flag("creds-file"), a.flag("nkey-seed-file"), ErrConflict))
	}
	if (a.TLSCertFile == "") != (a.TLSKeyFile == "") {
		errs = append(errs, fmt.Errorf("%s and %s: give both or neither", a.flag("tls-cert-file"), a.flag("tls-key-file")))
	}
	return errors.Join(errs...)
}

// Options checks and reads a's files and returns the nats.Options that use
// them. A secret file open to other users, a file that does not parse, a
// certificate without its key: each is an error naming its flag. The
// credentials file is read again at each reconnection (nats.go does), so a
// rotated file is picked up.
func (a *Auth) Options(log *slog.Logger) ([]nats.Option, error) {
	if err := a.Validate(); err != nil {
		return nil, err
	}
	var opts []nats.Option
	switch {
	case a.CredsFile != "":
		f := a.flag("creds-file")
		if err := secretfile.Check(f, a.CredsFile, log); err != nil {
			return nil, err
		}
		b, err := os.ReadFile(a.CredsFile)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f, err)
		}
		j, err := nkeys.ParseDecoratedJWT(b)
		if err == nil {
			_, err = jwt.DecodeUserClaims(j)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %s holds no user JWT: %w", f, a.CredsFile, err)
		}
		if _, err := nkeys.ParseDecoratedUserNKey(b); err != nil {
			return nil, fmt.Errorf("%s: %s holds no user nkey seed: %w", f, a.CredsFile, err)
		}
		opts = append(opts, nats.UserCredentials(a.CredsFile))
	case a.NkeySeedFile != "":
		f := a.flag("nkey-seed-file")
		if err := secretfile.Check(f, a.NkeySeedFile, log); err != nil {
			return nil, err
		}
		o, err := nats.NkeyOptionFromSeed(a.NkeySeedFile)
		if err != nil {
			return nil, fmt.Errorf("%s: %s: %w", f, a.NkeySeedFile, err)
		}
		opts = append(opts, o)
	}
	if a.TLSCAFile == "" && a.TLSCertFile == "" {
		return opts, nil
	}
	tc, err := tlsconf.Client(tlsconf.Files{Cert: a.TLSCertFile, Key: a.TLSKeyFile, CA: a.TLSCAFile,
		CertFlag: a.flag("tls-cert-file"), KeyFlag: a.flag("tls-key-file"), CAFlag: a.flag("tls-ca-file")})
	if err != nil {
		return nil, err
	}
	return append(opts, nats.Secure(tc)), nil
}

// WarnURLSecrets logs a warning for each server URL in urls (a
// comma-separated list, as --nats.url) that carries a password or a token:
// any user of the machine reads it in the process list. The warning shows
// the URL without it.
func WarnURLSecrets(flag, urls string, log *slog.Logger) {
	for _, s := range strings.Split(urls, ",") {
		u, err := url.Parse(strings.TrimSpace(s))
		if err != nil || u.User == nil {
			continue
		}
		log.Warn("a NATS URL carries a password or token, which every user of this machine sees in the process list (ps): use --nats.creds-file or --nats.nkey-seed-file instead",
			"flag", flag, "url", Redact(s))
	}
}

// Redact returns urls (comma-separated) with the user information of each
// (a password or a token) replaced, for logs and status pages.
func Redact(urls string) string {
	parts := strings.Split(urls, ",")
	for i, s := range parts {
		u, err := url.Parse(strings.TrimSpace(s))
		if err != nil {
			parts[i] = "(unparsable URL)"
			continue
		}
		if u.User != nil {
			u.User = url.User("redacted")
		}
		parts[i] = u.String()
	}
	return strings.Join(parts, ",")
}
