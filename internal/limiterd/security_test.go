package limiterd

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/internal/frontdoor/forwardauth"
	"github.com/limiterd/limiterd/internal/rulesource"
	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// metricValue is the value of the series of name whose labels include
// labels (a counter or a gauge); 0 when there is none.
func metricValue(t *testing.T, d *Daemon, name string, labels map[string]string) float64 {
	t.Helper()
	for _, mf := range mustGather(t, d) {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue next
				}
			}
			if m.GetCounter() != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

func tokenFile(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte(adminToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// dialTLS dials addr over TLS trusting ca, presenting the client
// certificate in certFile and keyFile.
func dialTLS(t *testing.T, addr string, ca *testenv.CA, certFile, keyFile string) *grpc.ClientConn {
	t.Helper()
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(
		&tls.Config{RootCAs: ca.Pool(), Certificates: []tls.Certificate{pair}})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// TestAdminCertificateIsNotEnough: with mTLS on the gRPC listener, a
// gateway holding a certificate of the client CA is not an admin: without
// the token it is refused PutRule (PermissionDenied, counted), unless its
// identity is in --admin.client-identities; the token admits it anyway.
func TestAdminCertificateIsNotEnough(t *testing.T) {
	ns := natstest.NewServer(t)
	ca := testenv.NewCA(t)
	srvCert, srvKey := ca.Issue(t, "limiterd", true)
	gwCert, gwKey := ca.Issue(t, "gateway.edge", false)
	opsCert, opsKey := ca.Issue(t, "ops.admin", false)
	tok := tokenFile(t)
	start := func(identities ...string) *Daemon {
		return startDaemon(t, nil, func(o *Options) {
			o.Server.TLSCertFile, o.Server.TLSKeyFile, o.Server.TLSClientCAFile = srvCert, srvKey, ca.File
			o.NATS.URL, o.Admin.TokenFile, o.Admin.ClientIdentities = ns.URL(), tok, identities
		})
	}
	ctx := context.Background()
	rule := &limiterv1.PutRuleRequest{Rule: "id: from-a-gateway\ncapacity: 1\nrefill_per_second: 1\n"}

	// The attack: no identities configured, a gateway's certificate alone.
	d := start()
	gw := limiterv1.NewAdminClient(dialTLS(t, d.GRPCAddr(), ca, gwCert, gwKey))
	if _, err := gw.PutRule(ctx, rule); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("PutRule with a gateway certificate and no token: %v, want PermissionDenied", err)
	}
	if _, err := gw.ListRules(ctx, &limiterv1.ListRulesRequest{}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("ListRules with a gateway certificate and no token: %v, want PermissionDenied", err)
	}
	if got := metricValue(t, d, "limiter_admin_calls_refused_total", map[string]string{"reason": "identity_not_allowed"}); got != 2 {
		t.Fatalf("refused calls counted: %v, want 2", got)
	}
	bad := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer not-the-admin-token-at-all")
	if _, err := gw.PutRule(bad, rule); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("PutRule with a wrong token: %v, want Unauthenticated", err)
	}
	authed := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+adminToken)
	if _, err := gw.PutRule(authed, rule); err != nil {
		t.Fatalf("PutRule with the token over mTLS: %v", err)
	}
	if _, err := gw.DeleteRule(authed, &limiterv1.DeleteRuleRequest{Id: "from-a-gateway"}); err != nil {
		t.Fatal(err)
	}

	// With an identities list: the gateway is still refused, the
	// operators' certificate admitted.
	d = start("ops.admin", "spiffe://example.org/ops")
	gw = limiterv1.NewAdminClient(dialTLS(t, d.GRPCAddr(), ca, gwCert, gwKey))
	_, err := gw.PutRule(ctx, rule)
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "gateway.edge") {
		t.Fatalf("PutRule with a certificate not in --admin.client-identities: %v, want PermissionDenied naming it", err)
	}
	ops := limiterv1.NewAdminClient(dialTLS(t, d.GRPCAddr(), ca, opsCert, opsKey))
	if _, err := ops.PutRule(ctx, rule); err != nil {
		t.Fatalf("PutRule with an allowed identity: %v", err)
	}
	list, err := ops.ListRules(ctx, &limiterv1.ListRulesRequest{})
	if err != nil || list.Version == "" {
		t.Fatalf("ListRules with an allowed identity: %v, %v", list, err)
	}
	if _, err := ops.DeleteRule(ctx, &limiterv1.DeleteRuleRequest{Id: "from-a-gateway"}); err != nil {
		t.Fatal(err)
	}
}

// TestAdminIdentitiesNeedAClientCA: --admin.client-identities without a
// listener that verifies client certificates is refused at start.
func TestAdminIdentitiesNeedAClientCA(t *testing.T) {
	o := DefaultOptions()
	o.Rules.File, o.Admin.ClientIdentities, o.Logger = "testdata/rules.yml", []string{"ops"}, quietLogger()
	_, err := New(o)
	if err == nil || !strings.Contains(err.Error(), "--admin.client-identities") {
		t.Fatalf("New: %v, want an error naming --admin.client-identities", err)
	}
}

const pinnedRule = "id: %s\ncapacity: 5\nrefill_per_second: 1\nhome: pinned\nhome_keys: {tenant-a: %s}\n"

// TestAdminRulesCannotPoison: a pinned rule whose home_keys name a region
// outside the topology is refused by the admin API naming the field, and
// nothing is stored; the next good rule is in force on every limiterd. An
// entry written around the API into the bucket that the topology refuses
// is left out alone and counted as a failure, and every limiterd reports
// as in force exactly what its engine decides with.
func TestAdminRulesCannotPoison(t *testing.T) {
	ns := natstest.NewServer(t)
	topo, secret, tok := twoRegionTopology(t), testenv.SecretFile(t), tokenFile(t)
	opts := func(o *Options) {
		o.Region.Name, o.Region.TopologyFile, o.Region.PeerSecretFile = "us-east", topo, secret
		o.NATS.URL, o.Admin.TokenFile = ns.URL(), tok
	}
	a := startDaemon(t, nil, opts)
	b := startDaemon(t, nil, opts)
	clientB := limiterv1.NewLimiterClient(dial(t, b.GRPCAddr()))
	adminA := limiterv1.NewAdminClient(dial(t, a.GRPCAddr()))
	authed := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+adminToken)

	// The attack: refused, over HTTP and gRPC, naming the field.
	code, msg := adminHTTP(t, a, "PUT", "/admin/rules/poison", adminToken, fmt.Sprintf(pinnedRule, "poison", "mars"))
	if code != http.StatusBadRequest || !strings.Contains(msg, `home_keys.tenant-a: region "mars" is not in the topology`) {
		t.Fatalf("PUT of a rule homed in mars: %d %q, want 400 naming home_keys.tenant-a", code, msg)
	}
	_, err := adminA.PutRule(authed, &limiterv1.PutRuleRequest{Rule: fmt.Sprintf(pinnedRule, "poison", "mars")})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "home_keys.tenant-a") {
		t.Fatalf("PutRule of a rule homed in mars: %v, want InvalidArgument naming home_keys.tenant-a", err)
	}
	// The next good put is in force everywhere (it makes the bucket: the
	// refused ones did not).
	if code, msg := adminHTTP(t, a, "PUT", "/admin/rules/good", adminToken, fmt.Sprintf(pinnedRule, "good", "eu-west")); code != http.StatusOK {
		t.Fatalf("PUT of a good rule: %d %q", code, msg)
	}
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(context.Background(), rulesource.DefaultBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Get(context.Background(), "poison"); err == nil {
		t.Fatal("the refused rule was stored")
	}
	clientA := limiterv1.NewLimiterClient(dial(t, a.GRPCAddr()))
	waitRule(t, clientB, "good", false, time.Now())
	waitRule(t, clientA, "good", false, time.Now())
	agree(t, a, b)

	// Around the API: written straight into the bucket, refused alone by
	// every limiterd, counted; the rules in force stay, and a later good
	// rule still comes into force.
	failures := metricValue(t, b, "limiter_rules_reloads_total", map[string]string{"source": "admin", "result": "failure"})
	if _, err := kv.Put(context.Background(), "sneaky", []byte(fmt.Sprintf(pinnedRule, "sneaky", "mars"))); err != nil {
		t.Fatal(err)
	}
	if code, _ := adminHTTP(t, a, "PUT", "/admin/rules/later", adminToken, "id: later\ncapacity: 1\nrefill_per_second: 1\n"); code != http.StatusOK {
		t.Fatalf("PUT of a later rule: %d", code)
	}
	waitRule(t, clientB, "later", false, time.Now())
	waitRule(t, clientA, "later", false, time.Now())
	if got := metricValue(t, b, "limiter_rules_reloads_total", map[string]string{"source": "admin", "result": "failure"}); got != failures+1 {
		t.Fatalf("limiter_rules_reloads_total{source=admin,result=failure}: %v, want %v", got, failures+1)
	}
	if _, err := clientB.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "sneaky", Key: "k"}); status.Code(err) != codes.NotFound {
		t.Fatalf("the entry written around the API is in force: %v", err)
	}
	agree(t, a, b)
}

// agree checks that each daemon reports as in force (ListRules, the
// X-Rules-Version header, limiter_rules_version_info) the set its engine
// decides with.
func agree(t *testing.T, ds ...*Daemon) {
	t.Helper()
	for _, d := range ds {
		engineVersion := d.engine.Rules().Version()
		list, err := d.admin.ListRules(context.Background(), &limiterv1.ListRulesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if list.Version != engineVersion {
			t.Fatalf("ListRules says version %s, the engine decides with %s", list.Version, engineVersion)
		}
		req, _ := http.NewRequest("GET", "http://"+d.HTTPAddr()+"/admin/rules", nil)
		req.Header.Set("Authorization", "Bearer "+adminToken)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if got := resp.Header.Get("X-Rules-Version"); got != engineVersion {
			t.Fatalf("X-Rules-Version %s, the engine decides with %s", got, engineVersion)
		}
		if got := metricValue(t, d, "limiter_rules_version_info", map[string]string{"version": engineVersion}); got != 1 {
			t.Fatalf("limiter_rules_version_info{version=%q} is %v, want 1", engineVersion, got)
		}
	}
}

// TestAdminRuleCap: a put past --rules.max-rules is refused naming the
// field, and nothing is stored; a rules file over it is refused at start.
func TestAdminRuleCap(t *testing.T) {
	ns := natstest.NewServer(t)
	tok := tokenFile(t)
	fileRules := strings.Count(readFile(t, "testdata/rules.yml"), "- id:")
	d := startDaemon(t, nil, func(o *Options) {
		o.NATS.URL, o.Admin.TokenFile, o.Rules.MaxRules = ns.URL(), tok, fileRules+1
	})
	client := limiterv1.NewLimiterClient(dial(t, d.GRPCAddr()))
	if code, msg := adminHTTP(t, d, "PUT", "/admin/rules/one", adminToken, "id: one\ncapacity: 1\nrefill_per_second: 1\n"); code != http.StatusOK {
		t.Fatalf("PUT up to the cap: %d %q", code, msg)
	}
	waitRule(t, client, "one", false, time.Now())
	code, msg := adminHTTP(t, d, "PUT", "/admin/rules/two", adminToken, "id: two\ncapacity: 1\nrefill_per_second: 1\n")
	if code != http.StatusBadRequest || !strings.Contains(msg, "rules: ") || !strings.Contains(msg, "--rules.max-rules") {
		t.Fatalf("PUT past the cap: %d %q, want 400 naming rules and --rules.max-rules", code, msg)
	}
	// Replacing a rule is not one more.
	if code, msg := adminHTTP(t, d, "PUT", "/admin/rules/one", adminToken, "id: one\ncapacity: 2\nrefill_per_second: 1\n"); code != http.StatusOK {
		t.Fatalf("PUT replacing a rule at the cap: %d %q", code, msg)
	}
	if code, _ := adminHTTP(t, d, "GET", "/admin/rules/two", adminToken, ""); code != http.StatusNotFound {
		t.Fatalf("the refused rule is listed: %d", code)
	}

	o := DefaultOptions()
	o.Rules.File, o.Rules.MaxRules, o.Logger = "testdata/rules.yml", fileRules-1, quietLogger()
	_, err := New(o)
	if err == nil || !strings.Contains(err.Error(), "--rules.max-rules") {
		t.Fatalf("New with a rules file over the cap: %v", err)
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestForwardAuthOwnListener: with --forward-auth.listen-address and
// --forward-auth.secret-file, forward-auth answers only there, and only
// requests carrying the secret; the others are 401 and counted. The HTTP
// port, which Prometheus scrapes, no longer serves it.
func TestForwardAuthOwnListener(t *testing.T) {
	secretFile := testenv.SecretFile(t)
	secret := strings.TrimSpace(readFile(t, secretFile))
	d := startDaemon(t, nil, func(o *Options) {
		o.Rules.File = writeRules(t, forwardAuthRules)
		o.ForwardAuth.Address, o.ForwardAuth.SecretFile = "127.0.0.1:0", secretFile
	})
	get := func(addr string, h map[string]string) int {
		req, err := http.NewRequest("GET", "http://"+addr+forwardauth.Path, nil)
		if err != nil {
			t.Fatal(err)
		}
		for k, v := range h {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	h := proxyHeaders("alice", "/api/x", "GET", "192.0.2.1")
	if code := get(d.ForwardAuthAddr(), h); code != http.StatusUnauthorized {
		t.Fatalf("without the secret: %d, want 401", code)
	}
	h[forwardauth.SecretHeader] = "a-guess-of-the-secret-0000"
	if code := get(d.ForwardAuthAddr(), h); code != http.StatusUnauthorized {
		t.Fatalf("with a wrong secret: %d, want 401", code)
	}
	if got := metricValue(t, d, "limiter_forward_auth_unauthenticated_total", nil); got != 2 {
		t.Fatalf("limiter_forward_auth_unauthenticated_total: %v, want 2", got)
	}
	h[forwardauth.SecretHeader] = secret
	if code := get(d.ForwardAuthAddr(), h); code != http.StatusOK {
		t.Fatalf("with the secret: %d, want 200", code)
	}
	if code := get(d.HTTPAddr(), h); code != http.StatusNotFound {
		t.Fatalf("on the metrics port: %d, want 404", code)
	}
}

// TestHTTPOverTLS: with --http.tls-cert-file the HTTP listener (admin API,
// metrics) serves TLS only; with --http.tls-client-ca-file and
// --admin.client-identities an operator's certificate is admitted to the
// HTTP admin API without the token, a gateway's refused (403).
func TestHTTPOverTLS(t *testing.T) {
	ca := testenv.NewCA(t)
	srvCert, srvKey := ca.Issue(t, "limiterd", true)
	opsCert, opsKey := ca.Issue(t, "ops.admin", false)
	gwCert, gwKey := ca.Issue(t, "gateway.edge", false)
	d := startDaemon(t, nil, func(o *Options) {
		o.Server.HTTPTLSCertFile, o.Server.HTTPTLSKeyFile, o.Server.HTTPTLSClientCAFile = srvCert, srvKey, ca.File
		o.Admin.ClientIdentities, o.Admin.TokenFile = []string{"ops.admin"}, tokenFile(t)
	})
	client := func(cert, key string) *http.Client {
		pair, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			t.Fatal(err)
		}
		return &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool(), Certificates: []tls.Certificate{pair}}}}
	}
	get := func(c *http.Client, path string) int {
		resp, err := c.Get("https://" + d.HTTPAddr() + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := get(client(opsCert, opsKey), "/admin/rules"); code != http.StatusOK {
		t.Fatalf("admin over HTTPS with an allowed identity: %d", code)
	}
	if code := get(client(gwCert, gwKey), "/admin/rules"); code != http.StatusForbidden {
		t.Fatalf("admin over HTTPS with a gateway's certificate: %d, want 403", code)
	}
	if code := get(client(gwCert, gwKey), "/metrics"); code != http.StatusOK {
		t.Fatalf("metrics over HTTPS: %d", code)
	}
	if resp, err := http.Get("http://" + d.HTTPAddr() + "/metrics"); err == nil {
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Fatal("plaintext HTTP was served")
		}
	}
}

// lockedBuffer is a log sink safe for the daemon's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestTokenInClearWarning: the warning that the admin token travels in
// clear is logged for a plaintext HTTP listener on another address than
// loopback, and only then.
func TestTokenInClearWarning(t *testing.T) {
	for _, tt := range []struct {
		addr string
		warn bool
	}{
		{"127.0.0.1:9091", false}, {"[::1]:9091", false}, {"localhost:9091", false},
		{":9091", true}, {"0.0.0.0:9091", true}, {"10.1.2.3:9091", true}, {"limiterd.internal:9091", true},
	} {
		if got := !loopbackOnly(tt.addr); got != tt.warn {
			t.Errorf("%s: warning %v, want %v", tt.addr, got, tt.warn)
		}
	}
	var logs lockedBuffer
	startDaemon(t, nil, func(o *Options) {
		o.Admin.TokenFile = tokenFile(t)
		o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	})
	if strings.Contains(logs.String(), "travels in clear") {
		t.Fatal("warned for a loopback listener")
	}
}

// TestLongGossipIntervalWarning: flushes further apart than half the
// debt horizon are warned of at start (a debit keeps at most capacity +
// rate x DebtHorizon), and the default interval is not.
func TestLongGossipIntervalWarning(t *testing.T) {
	ns := natstest.NewServer(t)
	for _, tt := range []struct {
		interval time.Duration
		warn     bool
	}{{time.Second, false}, {6 * time.Second, true}} {
		var logs lockedBuffer
		startDaemon(t, nil, func(o *Options) {
			o.NATS.URL, o.NATS.GossipInterval = ns.URL(), tt.interval
			o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		})
		if got := strings.Contains(logs.String(), "over half the debt horizon"); got != tt.warn {
			t.Errorf("--gossip.interval %v: warned %v, want %v", tt.interval, got, tt.warn)
		}
	}
}
