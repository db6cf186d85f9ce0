package testenv

import (
	"bufio"
	"io"
	"os/exec"
	"testing"
	"time"
)

// StartPiped starts cmd with pipes to its stdin and from its stdout, and
// ends it when the test ends: its stdin closed first, then, after 5 s, a
// kill of its own pid.
func StartPiped(t testing.TB, cmd *exec.Cmd) (stdin io.WriteCloser, stdout *bufio.Reader) {
	t.Helper()
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		in.Close()
		done := make(chan struct{})
		go func() {
			_ = cmd.Wait() // how it ended is not the test's question
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	return in, bufio.NewReader(out)
}
