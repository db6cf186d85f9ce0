//go:build linux

package testenv

import "syscall"

// sysProcAttr asks the kernel to kill a server when the test binary dies
// without running its cleanups (a panic, or the -timeout of go test).
//
// Pdeathsig fires when the OS thread that started the child exits, not the
// process. The Go runtime only ends a thread when a goroutine that locked it
// returns without unlocking, which nothing here does.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
