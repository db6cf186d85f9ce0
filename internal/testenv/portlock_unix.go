//go:build unix

package testenv

import (
	"io"
	"os"
	"path/filepath"
	"sync"
	"syscall"
)

// portLockPath is the file whose byte at offset p a test process locks
// (a POSIX record lock) while it holds port p: every test process of the
// machine locks the same file, so no two hand out the same port, even
// after the server on it stopped for a restart. Read once at start, so
// that a test's own TMPDIR does not move it.
var portLockPath = filepath.Join(os.TempDir(), "limiterd-test-ports.lock")

// portLock is the file, opened once and never closed: closing any
// descriptor of it would drop every lock this process holds on it. The
// kernel drops them when the process ends, however it ends.
var portLock struct {
	once sync.Once
	f    *os.File
}

// claimPort locks port p for this process, reporting false when another
// process holds it. Without the file (it cannot be made) every port is
// claimed, as before there was one.
func claimPort(p int) bool {
	portLock.once.Do(func() {
		if f, err := os.OpenFile(portLockPath, os.O_RDWR|os.O_CREATE, 0o666); err == nil {
			portLock.f = f
		}
	})
	if portLock.f == nil {
		return true
	}
	lk := syscall.Flock_t{Type: syscall.F_WRLCK, Whence: io.SeekStart, Start: int64(p), Len: 1}
	return syscall.FcntlFlock(portLock.f.Fd(), syscall.F_SETLK, &lk) == nil
}

// unclaimPort drops this process's lock on port p.
func unclaimPort(p int) {
	if portLock.f == nil {
		return
	}
	lk := syscall.Flock_t{Type: syscall.F_UNLCK, Whence: io.SeekStart, Start: int64(p), Len: 1}
	_ = syscall.FcntlFlock(portLock.f.Fd(), syscall.F_SETLK, &lk)
}
