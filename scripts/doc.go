// Package scripts holds no code: it is the home of the tests of the
// checkout's plumbing, so that `go test ./...` (make test) catches a build
// output committed by mistake, a .gitignore that misses one, a shell script
// of this directory or a make target that no longer does what the Makefile
// and the docs say it does, and a command of cmd/ whose --help fails.
package scripts
