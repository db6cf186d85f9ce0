//go:build !unix

package testenv

// claimPort claims every port: without POSIX record locks, ports are
// unique within a process only.
func claimPort(int) bool { return true }

// unclaimPort does nothing.
func unclaimPort(int) {}
