// Package envoy holds no code: its tests validate the Envoy example,
// envoy.yaml, against Envoy's own API (decoded strictly into the bootstrap
// proto of go-control-plane, every typed_config resolved and validated) and
// against the "Envoy" section of docs/front-doors.md: the domain, the cluster and the
// example rules, which must select the descriptors the routes produce.
package envoy

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"sigs.k8s.io/yaml"

	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/rules"
)

const (
	configFile = "envoy.yaml"
	configPath = "deploy/envoy/envoy.yaml"
	readmeFile = "../../docs/front-doors.md"
)

// The typed_config types the example may use; importing their packages
// registers them for protojson's Any resolution.
var (
	_ = (*hcmv3.HttpConnectionManager)(nil)
	_ = (*ratelimitv3.RateLimit)(nil)
	_ = (*routerv3.Router)(nil)
	_ = (*httpv3.HttpProtocolOptions)(nil)
)

// decode reads an Envoy bootstrap strictly: duplicate YAML keys and
// unknown fields (in typed_config too) are errors.
func decode(data []byte) (*bootstrapv3.Bootstrap, error) {
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return nil, err
	}
	var b bootstrapv3.Bootstrap
	if err := (protojson.UnmarshalOptions{DiscardUnknown: false}).Unmarshal(js, &b); err != nil {
		return nil, err
	}
	if err := b.ValidateAll(); err != nil {
		return nil, err
	}
	return &b, nil
}

// unpack resolves a typed_config and runs its validation rules.
func unpack(t *testing.T, where string, a *anypb.Any) proto.Message {
	t.Helper()
	m, err := a.UnmarshalNew()
	if err != nil {
		t.Fatalf("%s: %v", where, err)
	}
	if v, ok := m.(interface{ ValidateAll() error }); ok {
		if err := v.ValidateAll(); err != nil {
			t.Fatalf("%s: %v", where, err)
		}
	}
	return m
}

// example is what the test reads of envoy.yaml.
type example struct {
	bootstrap *bootstrapv3.Bootstrap
	// ratelimits are the ratelimit filters, in order.
	ratelimits []*ratelimitv3.RateLimit
	// descriptors are the routes' rate_limits entries.
	descriptors []descriptor
}

// descriptor is the shape of the descriptor a rate_limits entry produces:
// entries with a fixed value, and the keys whose value comes from the
// request.
type descriptor struct {
	route  string
	stage  uint32
	fixed  map[string]string
	varies []string
}

func (d descriptor) String() string {
	return fmt.Sprintf("route %s, stage %d: %v + %v", d.route, d.stage, d.fixed, d.varies)
}

func (d descriptor) has(key string) bool {
	_, ok := d.fixed[key]
	return ok || slices.Contains(d.varies, key)
}

func load(t *testing.T) *example {
	t.Helper()
	data, err := os.ReadFile(configFile)
	if err != nil {
		t.Fatal(err)
	}
	b, err := decode(data)
	if err != nil {
		t.Fatalf("%s: %v", configFile, err)
	}
	ex := &example{bootstrap: b}
	for _, l := range b.GetStaticResources().GetListeners() {
		for _, fc := range l.GetFilterChains() {
			for _, f := range fc.GetFilters() {
				hcm, ok := unpack(t, "listener "+l.GetName()+": "+f.GetName(), f.GetTypedConfig()).(*hcmv3.HttpConnectionManager)
				if !ok {
					continue
				}
				filters := hcm.GetHttpFilters()
				for i, hf := range filters {
					m := unpack(t, "http filter "+hf.GetName(), hf.GetTypedConfig())
					if rl, ok := m.(*ratelimitv3.RateLimit); ok {
						ex.ratelimits = append(ex.ratelimits, rl)
					}
					if _, ok := m.(*routerv3.Router); ok != (i == len(filters)-1) {
						t.Errorf("listener %s: the router must be the last http filter", l.GetName())
					}
				}
				for _, vh := range hcm.GetRouteConfig().GetVirtualHosts() {
					for _, r := range vh.GetRoutes() {
						for _, rl := range r.GetRoute().GetRateLimits() {
							ex.descriptors = append(ex.descriptors, shapeOf(t, r.GetMatch().GetPrefix(), rl))
						}
					}
				}
			}
		}
	}
	if len(ex.ratelimits) == 0 || len(ex.descriptors) == 0 {
		t.Fatalf("%s: %d ratelimit filters and %d rate_limits entries, want some of each", configFile, len(ex.ratelimits), len(ex.descriptors))
	}
	return ex
}

func shapeOf(t *testing.T, route string, rl *routev3.RateLimit) descriptor {
	t.Helper()
	d := descriptor{route: route, stage: rl.GetStage().GetValue(), fixed: map[string]string{}}
	or := func(key, def string) string {
		if key == "" {
			return def
		}
		return key
	}
	for _, a := range rl.GetActions() {
		switch {
		case a.GetGenericKey() != nil:
			d.fixed[or(a.GetGenericKey().GetDescriptorKey(), "generic_key")] = a.GetGenericKey().GetDescriptorValue()
		case a.GetHeaderValueMatch() != nil:
			d.fixed[or(a.GetHeaderValueMatch().GetDescriptorKey(), "header_match")] = a.GetHeaderValueMatch().GetDescriptorValue()
		case a.GetRemoteAddress() != nil:
			d.varies = append(d.varies, "remote_address")
		case a.GetRequestHeaders() != nil:
			d.varies = append(d.varies, a.GetRequestHeaders().GetDescriptorKey())
		default:
			t.Fatalf("route %s: action %v: not modelled by this test", route, a)
		}
	}
	return d
}

// readme is what the "Envoy" section of docs/front-doors.md documents.
type readme struct {
	domain, cluster string
	rules           *rules.Set
}

func loadReadme(t *testing.T) *readme {
	t.Helper()
	data, err := os.ReadFile(readmeFile)
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(data), "\n## Envoy\n")
	if !ok {
		t.Fatalf("%s: no \"## Envoy\" section", readmeFile)
	}
	section, _, _ = strings.Cut(section, "\n## ")
	if !strings.Contains(section, configPath) {
		t.Errorf("%s: the Envoy section does not name %s", readmeFile, configPath)
	}
	find := func(what string) string {
		m := regexp.MustCompile(what + " `([^`]+)`").FindStringSubmatch(section)
		if m == nil {
			t.Fatalf("%s: the Envoy section documents no %s", readmeFile, what)
		}
		return m[1]
	}
	r := &readme{domain: find("domain"), cluster: find("cluster")}
	_, block, ok := strings.Cut(section, "```yaml\n")
	if !ok {
		t.Fatalf("%s: the Envoy section has no rules example", readmeFile)
	}
	block, _, _ = strings.Cut(block, "```")
	if r.rules, err = rules.Parse(readmeFile, []byte(block)); err != nil {
		t.Fatal(err)
	}
	return r
}

// TestEnvoyExample: the ratelimit filters call the domain and cluster the
// docs document, fail open at stage 0 and make the x-ratelimit headers
// there, and the cluster speaks HTTP/2 to limiterd's gRPC port.
func TestEnvoyExample(t *testing.T) {
	ex, doc := load(t), loadReadme(t)
	stage0 := false
	for _, rl := range ex.ratelimits {
		where := fmt.Sprintf("ratelimit filter of stage %d", rl.GetStage())
		if rl.GetDomain() != doc.domain {
			t.Errorf("%s: domain %q, the docs document %q", where, rl.GetDomain(), doc.domain)
		}
		svc := rl.GetRateLimitService()
		if got := svc.GetGrpcService().GetEnvoyGrpc().GetClusterName(); got != doc.cluster {
			t.Errorf("%s: cluster %q, the docs document %q", where, got, doc.cluster)
		}
		if svc.GetTransportApiVersion() != corev3.ApiVersion_V3 {
			t.Errorf("%s: transport_api_version %v, want V3", where, svc.GetTransportApiVersion())
		}
		// limiterd adds no headers by default (--envoy.quota-headers):
		// the stage 0 filter makes them from the statuses, the others
		// none, or each header would come twice.
		want := ratelimitv3.RateLimit_OFF
		if rl.GetStage() == 0 {
			want = ratelimitv3.RateLimit_DRAFT_VERSION_03
		}
		if got := rl.GetEnableXRatelimitHeaders(); got != want {
			t.Errorf("%s: enable_x_ratelimit_headers %v, want %v (headers from stage 0 only)", where, got, want)
		}
		if rl.GetStage() == 0 {
			stage0 = true
			if rl.GetFailureModeDeny() {
				t.Errorf("%s: failure_mode_deny true: fail-open rules would fail closed while limiterd is unreachable", where)
			}
		}
	}
	if !stage0 {
		t.Error("no ratelimit filter of stage 0")
	}

	var found bool
	for _, c := range ex.bootstrap.GetStaticResources().GetClusters() {
		if c.GetName() != doc.cluster {
			continue
		}
		found = true
		opts, ok := c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
		if !ok {
			t.Fatalf("cluster %s: no HttpProtocolOptions: Envoy would speak HTTP/1.1, and gRPC needs HTTP/2", c.GetName())
		}
		hpo := unpack(t, "cluster "+c.GetName(), opts).(*httpv3.HttpProtocolOptions)
		if hpo.GetExplicitHttpConfig().GetHttp2ProtocolOptions() == nil {
			t.Errorf("cluster %s: not explicitly HTTP/2: %v", c.GetName(), hpo)
		}
		_, port, _ := net.SplitHostPort(limiterd.DefaultGRPCAddress)
		for _, eps := range c.GetLoadAssignment().GetEndpoints() {
			for _, ep := range eps.GetLbEndpoints() {
				if got := ep.GetEndpoint().GetAddress().GetSocketAddress().GetPortValue(); strconv.Itoa(int(got)) != port {
					t.Errorf("cluster %s: port %d, limiterd's gRPC port is %s", c.GetName(), got, port)
				}
			}
		}
	}
	if !found {
		t.Fatalf("no cluster %q", doc.cluster)
	}
}

// TestEnvoyExampleRules: every rule of the docs' example selects a
// descriptor the routes produce, in the stage whose filter fails the way
// the rule does, and every descriptor has a rule.
func TestEnvoyExampleRules(t *testing.T) {
	ex, doc := load(t), loadReadme(t)
	denyOfStage := map[uint32]bool{}
	for _, rl := range ex.ratelimits {
		denyOfStage[rl.GetStage()] = rl.GetFailureModeDeny()
	}
	used := make([]bool, len(ex.descriptors))
	for _, r := range doc.rules.Rules() {
		if r.Match == nil || r.Match.Domain != doc.domain {
			t.Errorf("rule %s: match.domain is not %q", r.ID, doc.domain)
			continue
		}
		keyAttr := map[string]string{rules.KeyByIP: "remote_address", rules.KeyByAPIKey: "api_key", rules.KeyByUser: "user"}[r.KeyBy]
		if name, ok := strings.CutPrefix(r.KeyBy, "attr:"); ok {
			keyAttr = name
		}
		matched := false
		for i, d := range ex.descriptors {
			if !attributesMatch(r.Match.Attributes, d) || (keyAttr != "" && !d.has(keyAttr)) {
				continue
			}
			matched, used[i] = true, true
			deny, ok := denyOfStage[d.stage]
			switch {
			case !ok:
				t.Errorf("rule %s: descriptor %v: no ratelimit filter of its stage", r.ID, d)
			case deny != (r.OnFailure == rules.FailClosed):
				t.Errorf("rule %s (on_failure %s): descriptor %v goes to a filter with failure_mode_deny %v", r.ID, r.OnFailure, d, deny)
			}
		}
		if !matched {
			t.Errorf("rule %s: matches no descriptor of %s", r.ID, configFile)
		}
	}
	for i, d := range ex.descriptors {
		if !used[i] {
			t.Errorf("descriptor %v: no rule of the docs' example selects it", d)
		}
	}
}

func attributesMatch(want map[string]string, d descriptor) bool {
	for k, v := range want {
		if got, ok := d.fixed[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// TestEnvoyDecodeStrict: decode refuses what Envoy would refuse.
func TestEnvoyDecodeStrict(t *testing.T) {
	good, err := os.ReadFile(configFile)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		old, new string
	}{
		{"unknown field in a typed_config", "domain: edge", "domian: edge"},
		{"unknown enum value", `enable_x_ratelimit_headers: "OFF"`, "enable_x_ratelimit_headers: DRAFT_VERSION_04"},
		{"unknown @type", "extensions.filters.http.router.v3.Router", "extensions.filters.http.router.v3.Routr"},
		{"duplicate key", "stat_prefix: ingress", "stat_prefix: ingress\n                stat_prefix: again"},
		{"validation rule", "connect_timeout: 1s", "connect_timeout: -1s"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if !bytes.Contains(good, []byte(tt.old)) {
				t.Fatalf("%s does not contain %q", configFile, tt.old)
			}
			bad := bytes.Replace(good, []byte(tt.old), []byte(tt.new), 1)
			_, err := decode(bad)
			if err == nil {
				t.Fatal("decoded without an error")
			}
			t.Log(err)
		})
	}
}
