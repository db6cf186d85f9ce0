package limiterd

import (
	"context"
	"encoding/base64"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// chromium is the path of a headless-capable Chromium, or the test is
// skipped (failed under CI: scripts/install-deps.sh installs Debian's).
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if testenv.InCI() {
		t.Fatal("no chromium on PATH: scripts/install-deps.sh chromium installs it")
	}
	t.Skip("no chromium on PATH")
	return ""
}

// TestStatusPageInBrowser loads the status page in a real headless
// Chromium, as an SRE would, on a limiterd with a Redis Cluster, NATS, an
// admin token and a topology whose other region does not answer: the page
// asks for the token (401) and, given it, loads with no console error or
// exception (its inline style and script pass its Content-Security-Policy);
// it shows the store's primaries and the unreachable region; a rule put
// through the admin API appears on the open page within a second, without
// a reload; the form's check answers, spending only when asked; and a
// key the form got refused shows among the most limited.
//
// With LIMITER_STATUS_SCREENSHOT=path it also writes a screenshot there
// (docs/status.png).
func TestStatusPageInBrowser(t *testing.T) {
	exe := chromium(t)
	cluster := redistest.NewCluster(t, 3, 0)
	ns := natstest.NewServer(t)
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(adminToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	topo := filepath.Join(t.TempDir(), "topology.yml")
	if err := os.WriteFile(topo, []byte("regions:\n  - name: us-east\n    limiter_address: 127.0.0.1:1\n  - name: eu-west\n    limiter_address: "+
		testenv.FreeAddr(t)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, cluster.Addrs(), func(o *Options) {
		o.NATS.URL, o.Admin.TokenFile = ns.URL(), tokenFile
		o.Region.Name, o.Region.TopologyFile = "us-east", topo
		o.Region.PeerSecretFile = testenv.SecretFile(t)
	})
	page := "http://" + d.HTTPAddr() + "/"

	resp, err := http.Get(page)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized || !strings.HasPrefix(resp.Header.Get("WWW-Authenticate"), "Basic") {
		t.Fatalf("the page without the token: %d %q, want 401 asking for Basic", resp.StatusCode, resp.Header.Get("WWW-Authenticate"))
	}

	actx, cancelA := chromedp.NewExecAllocator(context.Background(), append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(exe), chromedp.NoSandbox, chromedp.DisableGPU, chromedp.WindowSize(1200, 1100),
		chromedp.UserDataDir(t.TempDir()))...)
	defer cancelA()
	ctx, cancel := chromedp.NewContext(actx)
	defer cancel()
	ctx, cancelT := context.WithTimeout(ctx, 90*time.Second)
	defer cancelT()

	var mu sync.Mutex
	var problems []string
	if err := chromedp.Listen(ctx, func(ev any) {
		mu.Lock()
		defer mu.Unlock()
		switch ev := ev.(type) {
		case *runtime.EventConsoleAPICalled:
			if ev.Type == runtime.ConsoleAPICalledTypeError || ev.Type == runtime.ConsoleAPICalledTypeWarning {
				problems = append(problems, "console "+string(ev.Type))
			}
		case *runtime.EventExceptionThrown:
			problems = append(problems, "exception: "+ev.ExceptionDetails.Text)
		case *log.EventEntryAdded:
			if ev.Entry.Level == log.EntryLevelError || ev.Entry.Level == log.EntryLevelWarning {
				problems = append(problems, "log: "+ev.Entry.Text)
			}
		}
	}); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	basic := "Basic " + basicAuth("sre", adminToken)
	if _, err := chromedp.Call(ctx, network.SetExtraHTTPHeaders, network.SetExtraHTTPHeadersParams{
		Headers: network.Headers{"Authorization": basic}}); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	if err := chromedp.Do(ctx, chromedp.Navigate(page), chromedp.WaitVisible(chromedp.ID("rules"))); err != nil {
		t.Fatalf("load the page: %v", err)
	}
	// The page redraws its live part every half second: a node found
	// may be replaced before its text is read ("No node with given id
	// found"). Read again then.
	text := func(id string) string {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			s, err := chromedp.Run(ctx, chromedp.Text(chromedp.ID(id)))
			if err == nil {
				return s
			}
			if !strings.Contains(err.Error(), "No node with given id") || time.Now().After(deadline) {
				t.Fatalf("read #%s: %v", id, err)
			}
		}
	}
	if got := text("rules"); !strings.Contains(got, "tb") || !strings.Contains(got, "10, +0.000001/s") {
		t.Errorf("rules table %q: the file's rule tb (10, +0.000001/s) missing", got)
	}
	testenv.WaitFor(t, "the primaries and the unreachable region on the page", func() bool {
		nodes, regions := text("nodes"), text("regions")
		return strings.Count(nodes, "answering") == 3 && strings.Contains(regions, "eu-west") &&
			!strings.Contains(regions, "READY") && strings.Contains(regions, "this region")
	})

	// A rule put through the admin API shows on the open page within a
	// second of being in force here (the page refreshes its live part
	// every half second; the bound below leaves room for a loaded machine).
	code, msg := adminHTTP(t, d, "PUT", "/admin/rules/status-probe", adminToken, "id: status-probe\ncapacity: 7\nrefill_per_second: 1\n")
	if code != http.StatusOK {
		t.Fatalf("PutRule: %d %s", code, msg)
	}
	testenv.WaitFor(t, "the rule in force", func() bool { return d.rules.Current().Get("status-probe") != nil })
	inForce := time.Now()
	for !strings.Contains(text("rules"), "status-probe") {
		if time.Since(inForce) > 3*time.Second {
			t.Fatalf("the rule put is not on the open page %v after it was in force", time.Since(inForce))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("the rule put showed on the page %v after it was in force", time.Since(inForce).Round(time.Millisecond))

	// The form: usage first (nothing spent), then a real check.
	try := func(spend bool, cost string) string {
		t.Helper()
		actions := []chromedp.Action[chromedp.Void]{
			chromedp.SetValue(chromedp.ID("try-rule"), "status-probe"),
			chromedp.SetValue(chromedp.ID("try-key"), "tenant-1"),
			chromedp.SetValue(chromedp.ID("try-cost"), cost),
		}
		if spend {
			// The box is unticked on each answer's page.
			actions = append(actions, chromedp.Click(chromedp.ID("try-spend")))
		}
		actions = append(actions, chromedp.Click(chromedp.ID("try-submit")))
		before := text("result")
		if err := chromedp.Do(ctx, actions...); err != nil {
			t.Fatalf("submit the form: %v", err)
		}
		var after string
		testenv.WaitFor(t, "the form's answer", func() bool {
			s, err := chromedp.Run(ctx, chromedp.Text(chromedp.ID("result")))
			after = s
			return err == nil && s != before
		})
		return after
	}
	if got := try(false, "3"); !strings.Contains(got, "allowed") || !strings.Contains(got, "remaining 7 of 7") || !strings.Contains(got, "nothing spent") {
		t.Errorf("usage through the form: %q, want allowed, 7 of 7, nothing spent", got)
	}
	if got := try(true, "3"); !strings.Contains(got, "allowed") || !strings.Contains(got, "remaining 4 of 7") || !strings.Contains(got, "spent 3") {
		t.Errorf("a check through the form: %q, want allowed, 4 of 7 left, spent 3", got)
	}
	// Refused: the key shows among the most limited.
	if got := try(true, "5"); !strings.Contains(got, "refused") {
		t.Errorf("a check of 5 with 4 left through the form: %q, want refused", got)
	}
	testenv.WaitFor(t, "the refused key among the most limited", func() bool { return strings.Contains(text("top"), "tenant-1") })

	if path := os.Getenv("LIMITER_STATUS_SCREENSHOT"); path != "" {
		png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, png, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// One more refresh of the live part, then no problem may have been
	// logged in the whole visit.
	time.Sleep(1200 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if len(problems) > 0 {
		t.Errorf("the page logged: %s", strings.Join(problems, "; "))
	}
	if err := ctx.Err(); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
}

// basicAuth is the credentials of an HTTP Basic Authorization header.
func basicAuth(user, pass string) string {
	return base64.StdEncoding.EncodeToString([]byte(user + ":" + pass))
}
