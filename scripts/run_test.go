package scripts

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/pkg/gossip"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// TestRunScript: `make run` (scripts/run.sh) serves the README's examples,
// the admin API's writes included: a rule put at run time, an override of
// one of its keys in force on the next check, a reset, the override
// deleted. A call without the token is refused. The spends limiterd
// admits reach the NATS server's stream, with no warning logged. SIGTERM
// stops limiterd and the NATS server it started, and frees their ports.
func TestRunScript(t *testing.T) {
	runDir := filepath.Join(t.TempDir(), "run")
	grpcAddr, httpAddr, natsAddr := testenv.FreeAddr(t), testenv.FreeAddr(t), testenv.FreeAddr(t)
	log := filepath.Join(t.TempDir(), "run.log")
	out, err := os.Create(log)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	cmd := exec.Command("bash", "scripts/run.sh")
	cmd.Dir = ".."
	cmd.Env = append(os.Environ(), "RUN_DIR="+runDir, "GRPC_ADDR="+grpcAddr, "HTTP_ADDR="+httpAddr, "NATS_ADDR="+natsAddr)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// done is closed when run.sh has exited, with its error in waitErr.
	done := make(chan struct{})
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		select {
		case <-done:
		default:
			_ = cmd.Process.Signal(syscall.SIGTERM)
			<-done
		}
	})

	// The first run builds limiterd and nats-server.
	ready := func() bool {
		resp, err := http.Get("http://" + httpAddr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}
	for deadline := time.Now().Add(3 * time.Minute); !ready(); time.Sleep(200 * time.Millisecond) {
		select {
		case <-done:
			t.Fatalf("run.sh exited: %v\n%s", waitErr, testenv.TailFiles(log))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("limiterd not ready after 3 minutes\n%s", testenv.TailFiles(log))
		}
	}
	token, err := os.ReadFile(filepath.Join(runDir, "admin-token"))
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(filepath.Join(runDir, "admin-token")); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("admin token mode %v, %v; want 0600", st.Mode().Perm(), err)
	}
	call := func(method, path, body string, auth bool) (int, string) {
		t.Helper()
		req, err := http.NewRequest(method, "http://"+httpAddr+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if auth {
			req.Header.Set("Authorization", "Bearer "+string(token))
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	lim := limiterv1.NewLimiterClient(conn)
	limitOf := func(key string) float64 {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		r, err := lim.Check(ctx, &limiterv1.CheckRequest{RuleId: "tenants", Key: key})
		if err != nil {
			t.Fatalf("Check %s: %v", key, err)
		}
		return r.GetLimit()
	}

	if code, body := call(http.MethodPut, "/admin/rules/tenants", `{"id":"tenants","capacity":100,"refill_per_second":10}`, false); code != http.StatusUnauthorized {
		t.Fatalf("PutRule without the token: %d %s, want 401", code, body)
	}
	if code, body := call(http.MethodPut, "/admin/rules/tenants", `{"id":"tenants","capacity":100,"refill_per_second":10}`, true); code != http.StatusOK {
		t.Fatalf("PutRule: %d %s", code, body)
	}
	testenv.WaitFor(t, "the rule put in force", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := lim.Check(ctx, &limiterv1.CheckRequest{RuleId: "tenants", Key: "probe"})
		return err == nil
	})
	if code, body := call(http.MethodPut, "/admin/rules/tenants/overrides/tenant-acme", `{"capacity":500,"refill_per_second":50}`, true); code != http.StatusOK {
		t.Fatalf("PutOverride: %d %s", code, body)
	}
	testenv.WaitFor(t, "the override in force", func() bool { return limitOf("tenant-acme") == 500 })
	if got := limitOf("someone-else"); got != 100 {
		t.Errorf("another key's limit %v, want the rule's 100", got)
	}
	if code, body := call(http.MethodPost, "/admin/rules/tenants/keys/tenant-acme:reset", "", true); code != http.StatusOK || !strings.Contains(body, `"key":"tenant-acme"`) {
		t.Errorf("ResetKey: %d %s", code, body)
	}
	if code, body := call(http.MethodGet, "/admin/rules/tenants/top", "", true); code != http.StatusOK || !strings.Contains(body, `"rule":"tenants"`) {
		t.Errorf("TopLimited: %d %s", code, body)
	}
	// Spend an estimate, settle the actual cost: the difference comes back.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	est, err := lim.Check(ctx, &limiterv1.CheckRequest{RuleId: "tenants", Key: "tenant-b", Cost: 50, Settle: true})
	if err != nil || !est.GetAllowed() || est.GetSettlement() == "" {
		t.Fatalf("Check with settle: %v, %v", est, err)
	}
	if st, err := lim.Settle(ctx, &limiterv1.SettleRequest{Settlement: est.GetSettlement(), ActualCost: 12}); err != nil || !st.GetSettled() {
		t.Fatalf("Settle: %v, %v", st, err)
	}
	if r, err := lim.Check(ctx, &limiterv1.CheckRequest{RuleId: "tenants", Key: "tenant-b"}); err != nil || r.GetRemaining() < 87 {
		t.Errorf("after settling 12 of an estimate of 50: %v, %v; want at least 87 remaining", r, err)
	}
	if code, body := call(http.MethodDelete, "/admin/rules/tenants/overrides/tenant-acme", "", true); code != http.StatusOK {
		t.Fatalf("DeleteOverride: %d %s", code, body)
	}
	testenv.WaitFor(t, "the override gone", func() bool { return limitOf("tenant-acme") == 100 })

	nc, err := nats.Connect("nats://" + natsAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "spends published", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		st, err := js.Stream(ctx, gossip.LocalStream("local"))
		if err != nil {
			return false
		}
		info, err := st.Info(ctx)
		return err == nil && info.State.Msgs > 0
	})
	if b, err := os.ReadFile(log); err != nil {
		t.Fatal(err)
	} else if strings.Contains(string(b), "level=WARN") || strings.Contains(string(b), "level=ERROR") {
		t.Errorf("run.sh logged a warning or an error:\n%s", b)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("run.sh still running 30 s after SIGTERM\n%s", testenv.TailFiles(log))
	}
	for _, addr := range []string{grpcAddr, httpAddr, natsAddr} {
		_, port, _ := net.SplitHostPort(addr)
		p, _ := strconv.Atoi(port)
		if !testenv.CanListen(p) {
			t.Errorf("%s still taken after run.sh stopped: a process it started outlived it", addr)
		}
	}
}
