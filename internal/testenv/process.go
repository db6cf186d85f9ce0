package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
)

// Process is one run of a server started by StartProcess.
type Process struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once cmd.Wait returned
	err  error         // the result of cmd.Wait, set before done is closed
}

// StartProcess runs bin with args in dir, its output appended to the file
// output, killed with the test binary when that dies without running its
// cleanups (on Linux); Done closes when it exits.
func StartProcess(dir, output, bin string, args ...string) (*Process, error) {
	out, err := os.OpenFile(output, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		out.Close()
		return nil, err
	}
	p := &Process{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		out.Close()
		close(p.done)
	}()
	return p, nil
}

// Pid returns the process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Done is closed once the process has exited and been reaped.
func (p *Process) Done() <-chan struct{} { return p.done }

// Err returns how the process ended (the result of exec.Cmd.Wait), once
// Done is closed.
func (p *Process) Err() error { return p.err }

// Signal sends sig to the process.
func (p *Process) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }

// Kill sends SIGKILL and waits for the process to be reaped.
func (p *Process) Kill() {
	_ = p.cmd.Process.Kill() // fails only when the process is already gone
	<-p.done
}

// TailFiles returns the last lines of each file that exists and is not
// empty, each under a header naming it.
func TailFiles(paths ...string) string {
	const lines = 15
	var b strings.Builder
	for _, path := range paths {
		data, err := os.ReadFile(path)
		if err != nil || len(data) == 0 {
			continue
		}
		all := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
		if len(all) > lines {
			all = all[len(all)-lines:]
		}
		fmt.Fprintf(&b, "--- %s (last %d lines)\n%s\n", path, len(all), strings.Join(all, "\n"))
	}
	return b.String()
}
