package limiterd

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"

	"github.com/limiterd/limiterd/internal/testenv"
)

// helperEnv selects what TestHelperProcess does in a child process.
const helperEnv = "LIMITERD_TEST_HELPER"

// TestHelperProcess is not a test: the race test runs this test binary as
// its client processes and CPU burners. Run directly, it does nothing.
func TestHelperProcess(t *testing.T) {
	switch os.Getenv(helperEnv) {
	case "check":
		// Connect, wait for the start line on stdin, check once, print.
		cc := dial(t, os.Getenv("LIMITERD_ADDR"))
		client := limiterv1.NewLimiterClient(cc)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		// The connection is up before the start.
		if _, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "tb", Key: "warm-" + os.Getenv("LIMITERD_KEY")}); err != nil {
			fmt.Println("error:", err)
			os.Exit(0)
		}
		fmt.Println("ready")
		bufio.NewReader(os.Stdin).ReadString('\n')
		resp, err := client.Check(ctx, &limiterv1.CheckRequest{RuleId: "tb", Key: os.Getenv("LIMITERD_KEY")})
		switch {
		case err != nil:
			fmt.Println("error:", err)
		case resp.GetAllowed():
			fmt.Println("allowed")
		default:
			fmt.Println("limited")
		}
		os.Exit(0)
	case "attrs":
		// One check by attributes per line of JSON on stdin, one verdict
		// per line on stdout, until stdin closes.
		client := limiterv1.NewLimiterClient(dial(t, os.Getenv("LIMITERD_ADDR")))
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			var a limiterv1.Attributes
			if err := json.Unmarshal(in.Bytes(), &a); err != nil {
				fmt.Println("error:", err)
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			resp, err := client.Check(ctx, &limiterv1.CheckRequest{Attributes: &a})
			cancel()
			switch {
			case err != nil:
				fmt.Println("error:", strings.ReplaceAll(err.Error(), "\n", " "))
			case resp.GetAllowed():
				fmt.Println("allowed")
			default:
				fmt.Println("limited")
			}
		}
		os.Exit(0)
	case "burn":
		// Keep one core busy until stdin closes (or 60 s at most).
		stop := make(chan struct{})
		go func() {
			io.Copy(io.Discard, os.Stdin)
			close(stop)
		}()
		deadline := time.Now().Add(60 * time.Second)
		for x := 0; time.Now().Before(deadline); x++ {
			select {
			case <-stop:
				os.Exit(0)
			default:
			}
			for i := range 100_000 {
				x ^= i
			}
		}
		os.Exit(0)
	}
}

// helper starts this test binary as a helper process of kind, ended when
// the test ends (by its own pid, with its stdin closed first).
func helper(t *testing.T, kind string, env ...string) (stdin io.WriteCloser, stdout *bufio.Reader) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), append(env, helperEnv+"="+kind)...)
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
			cmd.Wait()
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	return in, bufio.NewReader(out)
}

// TestRaceSeparateProcessesBusyCores: 50 clients, each its own process,
// check one 10-token bucket through two limiterd instances with default
// flags while two more processes keep both cores busy: exactly 10 are
// admitted, every run. (A store timeout that counted limiterd's own
// queueing opened the breakers here, and the fail-open fallback admitted
// 20 and 21.)
func TestRaceSeparateProcessesBusyCores(t *testing.T) {
	if testing.Short() {
		t.Skip("starts 100+ processes")
	}
	c := testenv.RedisCluster(t, 3, 0)
	defaults := func(o *Options) { o.RedisTimeout = 0 } // the flag's default
	ds := []*Daemon{startDaemon(t, c.Addrs(), defaults), startDaemon(t, c.Addrs(), defaults)}
	for range 2 {
		helper(t, "burn")
	}
	for run := range 3 {
		key := fmt.Sprintf("procs-%d", run)
		type client struct {
			in  io.WriteCloser
			out *bufio.Reader
		}
		clients := make([]client, 50)
		for i := range clients {
			in, out := helper(t, "check", "LIMITERD_ADDR="+ds[i%2].GRPCAddr(), "LIMITERD_KEY="+key)
			clients[i] = client{in, out}
		}
		for i, cl := range clients {
			if line, _ := cl.out.ReadString('\n'); strings.TrimSpace(line) != "ready" {
				t.Fatalf("run %d: client %d: %q, want ready", run, i, line)
			}
		}
		for _, cl := range clients {
			cl.in.Write([]byte("go\n"))
		}
		var mu sync.Mutex
		counts := map[string]int{}
		var wg sync.WaitGroup
		for _, cl := range clients {
			wg.Go(func() {
				line, _ := cl.out.ReadString('\n')
				line = strings.TrimSpace(line)
				if strings.HasPrefix(line, "error:") {
					t.Errorf("run %d: %s", run, line)
					line = "error"
				}
				mu.Lock()
				counts[line]++
				mu.Unlock()
			})
		}
		wg.Wait()
		t.Logf("run %d: %v", run, counts)
		if counts["allowed"] != 10 || counts["limited"] != 40 {
			t.Fatalf("run %d: %v; want exactly 10 allowed and 40 limited", run, counts)
		}
	}
}
