// Package secretfile reads the secrets the daemons are given as files
// (tokens, passwords, peer secrets, NATS credentials and nkey seeds): a
// file any user of the machine may read is refused, one its group may
// read is accepted with a warning (Kubernetes mounts a secret for a
// non-root container as root:fsGroup, mode 0440), and a secret shorter
// than asked is refused. Errors name the flag.
package secretfile

import (
	"fmt"
	"log/slog"
	"os"
	"strings"
)

// Check looks at the permissions of path, given by flag: an error when
// others may read or write it or its group may write it; a warning in log
// (which may be nil) when its group may read it.
func Check(flag, path string, log *slog.Logger) error {
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("%s: %w", flag, err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s: %s is not a regular file", flag, path)
	}
	perm := fi.Mode().Perm()
	if perm&0o007 != 0 || perm&0o020 != 0 {
		return fmt.Errorf("%s: %s is open to other users (mode %v): chmod 600 it (or 640 for a group of the daemon's own)", flag, path, perm)
	}
	if perm&0o040 != 0 && log != nil {
		log.Warn("a secret file is readable by its group: make sure the group is the daemon's alone", "flag", flag, "path", path, "mode", perm.String())
	}
	return nil
}

// Read checks path as Check does, then reads it: surrounding blanks are
// trimmed, and a secret shorter than minLen characters is refused.
func Read(flag, path string, minLen int, log *slog.Logger) ([]byte, error) {
	if err := Check(flag, path, log); err != nil {
		return nil, err
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", flag, err)
	}
	s := []byte(strings.TrimSpace(string(b)))
	if len(s) < minLen {
		return nil, fmt.Errorf("%s: the secret in %s must be at least %d characters, it has %d", flag, path, minLen, len(s))
	}
	return s, nil
}
