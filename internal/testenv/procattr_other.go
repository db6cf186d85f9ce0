//go:build !linux

package testenv

import "syscall"

// sysProcAttr returns nil: only Linux can kill a child when its parent dies,
// so elsewhere a killed test binary may leave servers behind.
func sysProcAttr() *syscall.SysProcAttr { return nil }
