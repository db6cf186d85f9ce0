// Package nginx tests limiterd.conf, the nginx configuration of
// limiterd's forward-auth, in a real nginx against a real limiterd on a
// real Redis Cluster.
package nginx

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/frontdoor/forwardauth"
	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
	"github.com/limiterd/limiterd/pkg/httplimit"
)

// installHint is the command that installs nginx.
const installHint = "apt-get install -y nginx (or: make deps)"

const rulesYAML = `rules:
  - id: api
    capacity: 3
    refill_per_second: 0.01
    key_by: user
    match:
      path: /api/**
  - id: reports
    capacity: 3
    refill_per_second: 0.01
    key_by: user
    match:
      path: /reports/**
  - id: login
    capacity: 5
    refill_per_second: 0.01
    key_by: ip
    on_failure: closed
    match:
      path: /login
`

// lookNginx finds nginx on PATH or in /usr/sbin (not on every user's
// PATH), or ends the test: a failure with CI=true, a skip elsewhere.
func lookNginx(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("nginx"); err == nil {
		return p
	}
	if _, err := os.Stat("/usr/sbin/nginx"); err == nil {
		return "/usr/sbin/nginx"
	}
	if ci, _ := strconv.ParseBool(os.Getenv("CI")); ci {
		t.Fatalf("nginx not found and CI=true, so this is a failure, not a skip; install it with: %s", installHint)
	}
	t.Skipf("nginx not found; install it with: %s", installHint)
	return ""
}

// freePort returns a loopback port for nginx to bind (testenv.ReservePort).
func freePort(t *testing.T) int {
	t.Helper()
	p, err := testenv.ReservePort()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// replaceOnce replaces the one line of conf holding marker, or fails.
func replaceOnce(t *testing.T, conf, old, new string) string {
	t.Helper()
	if n := strings.Count(conf, old); n != 1 {
		t.Fatalf("limiterd.conf: %q occurs %d times, want once", old, n)
	}
	return strings.Replace(conf, old, new, 1)
}

// startNginx runs limiterd.conf in a real nginx, its addresses replaced by
// limiterdAddr and appAddr, and returns the address clients connect to.
// nginx is stopped by its pid when the test ends.
func startNginx(t *testing.T, limiterdAddr, secret, appAddr string, users map[string]string) string {
	t.Helper()
	bin := lookNginx(t)
	src, err := os.ReadFile("limiterd.conf")
	if err != nil {
		t.Fatal(err)
	}
	// Not t.TempDir: nginx's workers run as nobody when the test runs as
	// root, and must read the password file.
	dir, err := os.MkdirTemp("", "limiterd-nginx-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	var htpasswd strings.Builder
	for u, p := range users {
		fmt.Fprintf(&htpasswd, "%s:{PLAIN}%s\n", u, p)
	}
	if err := os.WriteFile(filepath.Join(dir, "limiterd.htpasswd"), []byte(htpasswd.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	mainConf := fmt.Sprintf(`worker_processes 1;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
events { worker_connections 64; }
http {
    access_log off;
    client_body_temp_path %[1]s/body;
    proxy_temp_path %[1]s/proxy;
    fastcgi_temp_path %[1]s/fastcgi;
    uwsgi_temp_path %[1]s/uwsgi;
    scgi_temp_path %[1]s/scgi;
    include %[1]s/limiterd.conf;
}
`, dir)
	if err := os.WriteFile(filepath.Join(dir, "nginx.conf"), []byte(mainConf), 0o644); err != nil {
		t.Fatal(err)
	}

	for try := 0; ; try++ {
		port := freePort(t)
		conf := string(src)
		conf = replaceOnce(t, conf, "server 127.0.0.1:9092;", "server "+limiterdAddr+";")
		conf = replaceOnce(t, conf, `"REPLACE-WITH-THE-FORWARD-AUTH-SECRET"`, strconv.Quote(secret))
		conf = replaceOnce(t, conf, "server 127.0.0.1:8000;", "server "+appAddr+";")
		conf = replaceOnce(t, conf, "listen 8080;", fmt.Sprintf("listen 127.0.0.1:%d;", port))
		if err := os.WriteFile(filepath.Join(dir, "limiterd.conf"), []byte(conf), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command(bin, "-t", "-q", "-p", dir, "-c", filepath.Join(dir, "nginx.conf"), "-e", filepath.Join(dir, "error.log")).CombinedOutput(); err != nil {
			t.Fatalf("nginx -t: %v\n%s%s", err, out, readFile(filepath.Join(dir, "error.log")))
		}
		cmd := exec.Command(bin, "-p", dir, "-c", filepath.Join(dir, "nginx.conf"), "-e", filepath.Join(dir, "error.log"), "-g", "daemon off;")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
		if err := cmd.Start(); err != nil {
			t.Fatalf("start nginx: %v", err)
		}
		exited := make(chan struct{})
		go func() {
			cmd.Wait()
			close(exited)
		}()
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		if waitListening(addr, exited, 10*time.Second) {
			pid := cmd.Process.Pid
			t.Cleanup(func() { stopNginx(t, pid, exited) })
			return addr
		}
		stopNginx(t, cmd.Process.Pid, exited)
		log := readFile(filepath.Join(dir, "error.log"))
		if strings.Contains(log, "Address already in use") && try < 3 {
			continue
		}
		t.Fatalf("nginx did not come up on %s; error.log:\n%s", addr, log)
	}
}

func readFile(p string) string {
	b, _ := os.ReadFile(p)
	return string(b)
}

// waitListening reports whether addr accepts connections before timeout
// and before exited closes.
func waitListening(addr string, exited <-chan struct{}, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			return false
		default:
		}
		if c, err := net.DialTimeout("tcp", addr, 100*time.Millisecond); err == nil {
			c.Close()
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}

// stopNginx asks the master (pid) to quit gracefully, then kills its
// process group if it has not exited within 5 s.
func stopNginx(t *testing.T, pid int, exited <-chan struct{}) {
	syscall.Kill(pid, syscall.SIGQUIT)
	select {
	case <-exited:
		return
	case <-time.After(5 * time.Second):
	}
	t.Logf("nginx (pid %d) did not quit in 5s; killing its process group", pid)
	syscall.Kill(-pid, syscall.SIGKILL)
	<-exited
}

// TestNginx sends requests through a real nginx running limiterd.conf to
// a tiny application, limiterd deciding each one.
func TestNginx(t *testing.T) {
	lookNginx(t)
	cluster := redistest.NewCluster(t, 3, 0)
	rules := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(rules, []byte(rulesYAML), 0o600); err != nil {
		t.Fatal(err)
	}
	secretFile := testenv.SecretFile(t)
	secret, err := os.ReadFile(secretFile)
	if err != nil {
		t.Fatal(err)
	}
	o := limiterd.DefaultOptions()
	o.Server.GRPCAddress, o.Server.HTTPAddress, o.Rules.File = "127.0.0.1:0", "127.0.0.1:0", rules
	o.Redis.Addrs, o.RedisTuning.Timeout = cluster.Addrs(), 100*time.Millisecond
	o.ForwardAuth.Address, o.ForwardAuth.SecretFile = "127.0.0.1:0", secretFile
	o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	d, err := limiterd.New(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	stopLimiterd := sync.OnceFunc(func() { d.Stop(context.Background()) })
	t.Cleanup(stopLimiterd)

	var served atomic.Int64
	var servedURIs sync.Map // request URI -> true, as the application received it
	app := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		servedURIs.Store(r.RequestURI, true)
		_, _ = io.WriteString(w, "app")
	}))
	t.Cleanup(app.Close)
	addr := startNginx(t, d.ForwardAuthAddr(), strings.TrimSpace(string(secret)), app.Listener.Addr().String(),
		map[string]string{"alice": "alice-pw", "bob": "bob-pw", "carol": "carol-pw", "dave": "dave-pw", "erin": "erin-pw"})

	hc := &http.Client{Timeout: 10 * time.Second}
	do := func(method, path, user, password string, extra ...string) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequest(method, "http://"+addr+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		if user != "" {
			req.SetBasicAuth(user, password)
		}
		for i := 0; i+1 < len(extra); i += 2 {
			req.Header.Set(extra[i], extra[i+1])
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, string(body)
	}
	quotaHeaders := []string{"RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset",
		"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "RateLimit-Policy", "RateLimit"}

	// Allowed: the application's 200 with the quota headers.
	for i := range 3 {
		resp, body := do("GET", "/api/orders?page=1", "alice", "alice-pw")
		h := resp.Header
		if resp.StatusCode != 200 || body != "app" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, body)
		}
		for _, name := range quotaHeaders {
			if h.Get(name) == "" {
				t.Fatalf("request %d: no %s in %v", i, name, h)
			}
		}
		reset, _ := strconv.ParseInt(h.Get("X-RateLimit-Reset"), 10, 64)
		if h.Get("RateLimit-Limit") != "3" || h.Get("RateLimit-Remaining") != strconv.Itoa(2-i) ||
			h.Get("RateLimit-Policy") != `"api";q=3;w=300` || h.Get("Retry-After") != "" ||
			reset < time.Now().Unix() || reset > time.Now().Unix()+301 {
			t.Fatalf("request %d headers: %v", i, h)
		}
	}
	// The (limit+1)th: 429 with Retry-After >= 1 and the headers; the
	// application never sees it.
	before := served.Load()
	resp, _ := do("GET", "/api/orders", "alice", "alice-pw")
	if ra, err := strconv.Atoi(resp.Header.Get("Retry-After")); resp.StatusCode != http.StatusTooManyRequests || err != nil || ra < 1 || ra > 100 {
		t.Fatalf("4th request: %d, headers %v; want 429 with Retry-After in [1, 100]", resp.StatusCode, resp.Header)
	}
	for _, name := range quotaHeaders {
		if resp.Header.Get(name) == "" {
			t.Fatalf("429 without %s: %v", name, resp.Header)
		}
	}
	t.Logf("through nginx, the 4th request: %s, %v", resp.Status, resp.Header)
	if resp.Header.Get(forwardauth.StatusHeader) != "" {
		t.Fatalf("the internal %s header reached the client", forwardauth.StatusHeader)
	}
	if served.Load() != before {
		t.Fatal("the application served a refused request")
	}

	// A wrong password is auth_basic's 401 and spends nothing of bob's;
	// an X-Auth-User or X-Forwarded-For of the client's own is not read.
	if resp, _ := do("GET", "/api/orders", "bob", "wrong"); resp.StatusCode != 401 {
		t.Fatalf("wrong password: %d, want 401", resp.StatusCode)
	}
	if resp, _ := do("GET", "/api/orders", "", ""); resp.StatusCode != 401 {
		t.Fatalf("no credentials: %d, want 401", resp.StatusCode)
	}
	resp, _ = do("GET", "/api/orders", "bob", "bob-pw", "X-Auth-User", "alice", "X-Forwarded-For", "192.0.2.99")
	if resp.StatusCode != 200 || resp.Header.Get("RateLimit-Remaining") != "2" {
		t.Fatalf("bob: %d %v, want 200 with 2 left of bob's own 3", resp.StatusCode, resp.Header)
	}

	// A URI nginx passes on raw that the application could read as another
	// path is refused 400 with limiterd's reason, never let through as a
	// path no rule matches; a case or an escape that names the same path
	// is counted under the rule. erin's 3 reports are spent first.
	for i := range 3 {
		if resp, _ := do("GET", "/reports/1", "erin", "erin-pw"); resp.StatusCode != 200 {
			t.Fatalf("erin's report %d: %d", i, resp.StatusCode)
		}
	}
	before = served.Load()
	for _, tt := range []struct {
		uri  string
		code int
	}{
		{"/reports/%2e%2e/x", http.StatusBadRequest},
		{"/reports/..%2Fx", http.StatusBadRequest},
		{"/reports;a=b/1", http.StatusBadRequest},
		{"/reports/../x", http.StatusBadRequest},
		{"/reports//1", http.StatusBadRequest},
		{"/REPORTS/1", http.StatusTooManyRequests},
		{"/%72eports/1", http.StatusTooManyRequests},
	} {
		resp, body := do("GET", tt.uri, "erin", "erin-pw")
		if resp.StatusCode != tt.code || (tt.code == http.StatusBadRequest && !strings.Contains(body, forwardauth.DefaultURIHeader)) {
			_, got := servedURIs.Load(tt.uri)
			t.Errorf("GET %s with /reports/** spent: %d %q (the application received it raw: %v), want %d",
				tt.uri, resp.StatusCode, body, got, tt.code)
		}
	}
	if n := served.Load() - before; n != 0 {
		t.Errorf("the application served %d of the refused reports", n)
	}

	// The fail-closed login rule keys by the connection's address.
	if resp, _ := do("POST", "/login", "carol", "carol-pw"); resp.StatusCode != 200 || resp.Header.Get("RateLimit-Limit") != "5" {
		t.Fatalf("/login: %d %v", resp.StatusCode, resp.Header)
	}
	// The store goes away: limiterd cannot decide the fail-closed rule,
	// and the client sees 503, not 429; the fail-open rule still decides.
	cluster.StopAll()
	if resp, _ := do("POST", "/login", "carol", "carol-pw"); resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "" {
		t.Fatalf("/login with the store down: %d %v, want 503", resp.StatusCode, resp.Header)
	}
	if resp, body := do("GET", "/api/orders", "carol", "carol-pw"); resp.StatusCode != 200 || body != "app" {
		t.Fatalf("/api/orders with the store down: %d %q, want 200", resp.StatusCode, body)
	}
	// limiterd goes away: nginx fails open, without quota headers.
	stopLimiterd()
	resp, body := do("GET", "/api/orders", "dave", "dave-pw")
	if resp.StatusCode != 200 || body != "app" || resp.Header.Get("RateLimit-Limit") != "" {
		t.Fatalf("limiterd down: %d %q %v, want the application's 200 without quota headers", resp.StatusCode, body, resp.Header)
	}
}

// TestHeadersCopied: limiterd.conf copies exactly the headers limiterd
// sets, each with its matching $upstream_http_ variable.
func TestHeadersCopied(t *testing.T) {
	b, err := os.ReadFile("limiterd.conf")
	if err != nil {
		t.Fatal(err)
	}
	conf := string(b)
	for _, name := range httplimit.HeaderNames {
		v := strings.ToLower(strings.ReplaceAll(name, "-", "_"))
		set := fmt.Sprintf("auth_request_set $limiterd_%s $upstream_http_%s;", v, v)
		add := fmt.Sprintf("add_header %s $limiterd_%s always;", name, v)
		for _, line := range []string{set, add} {
			if !strings.Contains(conf, line) {
				t.Errorf("limiterd.conf lacks %q", line)
			}
		}
	}
	if got, want := strings.Count(conf, "add_header "), len(httplimit.HeaderNames); got != want {
		t.Errorf("%d add_header lines, want %d (one per header limiterd sets)", got, want)
	}
	for _, h := range []string{forwardauth.StatusHeader, forwardauth.ErrorHeader} {
		if st := strings.ToLower(strings.ReplaceAll(h, "-", "_")); !strings.Contains(conf, "$upstream_http_"+st+";") {
			t.Errorf("limiterd.conf does not read %s", h)
		}
	}
	for _, h := range []string{forwardauth.DefaultUserHeader, forwardauth.DefaultURIHeader,
		forwardauth.DefaultMethodHeader, forwardauth.DefaultIPHeader} {
		if !strings.Contains(conf, "proxy_set_header "+h+" $") {
			t.Errorf("limiterd.conf does not set %s, a header limiterd reads by default", h)
		}
	}
	if !strings.Contains(conf, forwardauth.Path+"?mode=nginx;") {
		t.Errorf("limiterd.conf does not ask %s?mode=nginx", forwardauth.Path)
	}
}
