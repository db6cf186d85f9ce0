package redisstore

import (
	"crypto/tls"
	"log/slog"

	"github.com/limiterd/limiterd/internal/secretfile"
)

// Credentials are how both daemons authenticate to Redis, from their
// --redis.username, --redis.password-file and --redis.tls flags.
type Credentials struct {
	Username, PasswordFile string
	TLS                    bool
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
	if c.TLS {
		o.TLS = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	return nil
}
