package redisstore

import (
	"crypto/tls"
	"fmt"
	"os"
	"strings"
)

// Credentials are how both daemons authenticate to Redis, from their
// --redis.username, --redis.password-file and --redis.tls flags.
type Credentials struct {
	Username, PasswordFile string
	TLS                    bool
}

// Apply sets o's username, password (read from PasswordFile, surrounding
// blanks trimmed) and TLS; errors name the flag.
func (c Credentials) Apply(o *Options) error {
	o.Username = c.Username
	if c.PasswordFile != "" {
		b, err := os.ReadFile(c.PasswordFile)
		if err != nil {
			return fmt.Errorf("--redis.password-file: %w", err)
		}
		o.Password = strings.TrimSpace(string(b))
	}
	if c.TLS {
		o.TLS = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	return nil
}
