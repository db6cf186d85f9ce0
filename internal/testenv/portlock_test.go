//go:build unix

package testenv

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

// TestPortHeldByAnotherProcess: a port pair another test process reserved
// cannot be claimed here while that process lives (its server may be
// stopped for a restart, the port free to bind), and can once it ended.
func TestPortHeldByAnotherProcess(t *testing.T) {
	const offset = 10000
	if os.Getenv("TESTENV_HOLD_PORT") == "1" {
		p, err := ReservePortPair(offset)
		if err != nil {
			fmt.Println("error:", err)
			return
		}
		fmt.Println("port", p)
		// Hold it until the parent closes stdin.
		_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestPortHeldByAnotherProcess$")
	cmd.Env = append(os.Environ(), "TESTENV_HOLD_PORT=1")
	in, out := StartPiped(t, cmd)
	var p int
	for sc := bufio.NewScanner(out); sc.Scan(); {
		if n, ok := strings.CutPrefix(sc.Text(), "port "); ok {
			p, _ = strconv.Atoi(n)
			break
		}
		if strings.HasPrefix(sc.Text(), "error:") {
			t.Fatal(sc.Text())
		}
	}
	if p == 0 {
		t.Fatal("the other process named no port")
	}
	for _, port := range []int{p, p + offset} {
		if !CanListen(port) {
			t.Fatalf("port %d is bound: want it reserved, not bound", port)
		}
		if claimPort(port) {
			t.Fatalf("port %d claimed here while another process holds it", port)
		}
	}
	in.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("the other process: %v", err)
	}
	for _, port := range []int{p, p + offset} {
		if !claimPort(port) {
			t.Fatalf("port %d still held after the process that held it ended", port)
		}
		unclaimPort(port)
	}
}
