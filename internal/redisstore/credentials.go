package redisstore

import (
	"log/slog"

	"github.com/limiterd/limiterd/internal/secretfile"
	"github.com/limiterd/limiterd/internal/tlsconf"
)

// Credentials are how both daemons authenticate to Redis, from their
// --redis.username, --redis.password-file, --redis.tls and
// --redis.tls-{ca,cert,key}-file flags.
type Credentials struct {
	Username, PasswordFile string
	// TLS connects over TLS, verifying the servers against the system's
	// roots, or TLSCAFile when set; TLSCertFile and TLSKeyFile are the
	// client certificate (for tls-auth-clients). Any file implies TLS.
	TLS                                bool
	TLSCAFile, TLSCertFile, TLSKeyFile string
	// Logger gets the warning about a group-readable password file.
	Logger *slog.Logger
}

// Apply sets o's username, password (read from PasswordFile, surrounding
// blanks trimmed) and TLS; errors name the flag.
func (c Credentials) Apply(o *Options) error {
	o.Username = c.Username
	if c.PasswordFile != "" {
		b, err := secretfile.Read("--redis.password-file", c.PasswordFile, 1, c.Logger)
		if err != nil {
			return err
		}
		o.Password = string(b)
	}
	if c.TLS || c.TLSCAFile != "" || c.TLSCertFile != "" || c.TLSKeyFile != "" {
		tc, err := tlsconf.Client(tlsconf.Files{CA: c.TLSCAFile, Cert: c.TLSCertFile, Key: c.TLSKeyFile,
			CAFlag: "--redis.tls-ca-file", CertFlag: "--redis.tls-cert-file", KeyFlag: "--redis.tls-key-file"})
		if err != nil {
			return err
		}
		o.TLS = tc
	}
	return nil
}
