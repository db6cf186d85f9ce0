package deploy

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"

	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/logging"
	"github.com/limiterd/limiterd/internal/reconciler"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/region"
)

// k8sDir is the kustomize tree, relative to this package.
const k8sDir = "k8s"

// Container names of the two daemons in the manifests.
const (
	limiterdContainer   = "limiterd"
	reconcilerContainer = "reconciler"
)

// servedPaths are the HTTP paths each daemon's mux serves
// (internal/limiterd/daemon.go, internal/reconciler/reconciler.go);
// TestPromQLMetricsExported also requests every probe path of the manifests
// on the running daemons.
var servedPaths = map[string][]string{
	limiterdContainer:   {"/metrics", "/healthz", "/readyz"},
	reconcilerContainer: {"/metrics", "/healthz", "/readyz"},
}

// kinds maps each kind the manifests may hold to its API version and Go
// type. A kind not listed here fails the build test.
var kinds = map[string]struct {
	apiVersion string
	new        func() any
}{
	"Namespace":               {"v1", func() any { return new(corev1.Namespace) }},
	"ServiceAccount":          {"v1", func() any { return new(corev1.ServiceAccount) }},
	"ConfigMap":               {"v1", func() any { return new(corev1.ConfigMap) }},
	"Service":                 {"v1", func() any { return new(corev1.Service) }},
	"Deployment":              {"apps/v1", func() any { return new(appsv1.Deployment) }},
	"HorizontalPodAutoscaler": {"autoscaling/v2", func() any { return new(autoscalingv2.HorizontalPodAutoscaler) }},
	"PodDisruptionBudget":     {"policy/v1", func() any { return new(policyv1.PodDisruptionBudget) }},
	"NetworkPolicy":           {"networking.k8s.io/v1", func() any { return new(networkingv1.NetworkPolicy) }},
	"ServiceMonitor":          {"monitoring.coreos.com/v1", func() any { return new(monitoringv1.ServiceMonitor) }},
	"PrometheusRule":          {"monitoring.coreos.com/v1", func() any { return new(monitoringv1.PrometheusRule) }},
}

// decodeStrict decodes one object's JSON into v, rejecting unknown fields
// and trailing data.
func decodeStrict(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return fmt.Errorf("trailing data after the object")
	}
	return nil
}

// built is one kustomization's output, decoded.
type built struct {
	name string // "base" or the overlay's directory name
	objs []any

	deployments     map[string]*appsv1.Deployment
	services        map[string]*corev1.Service
	configMaps      map[string]*corev1.ConfigMap
	hpas            map[string]*autoscalingv2.HorizontalPodAutoscaler
	pdbs            map[string]*policyv1.PodDisruptionBudget
	netpols         map[string]*networkingv1.NetworkPolicy
	serviceMonitors map[string]*monitoringv1.ServiceMonitor
}

// kustomizeBuild builds the kustomization in dir with the kustomize API and
// decodes every object strictly into its Kubernetes type.
func kustomizeBuild(dir string) (*built, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), abs)
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	b := newBuilt(filepath.Base(dir))
	for _, r := range m.Resources() {
		data, err := r.MarshalJSON()
		if err != nil {
			return nil, fmt.Errorf("%s: %s %s: %w", dir, r.GetKind(), r.GetName(), err)
		}
		if err := b.add(r.GetKind(), r.GetApiVersion(), r.GetName(), data); err != nil {
			return nil, fmt.Errorf("%s: %w", dir, err)
		}
	}
	return b, nil
}

func newBuilt(name string) *built {
	return &built{
		name:            name,
		deployments:     map[string]*appsv1.Deployment{},
		services:        map[string]*corev1.Service{},
		configMaps:      map[string]*corev1.ConfigMap{},
		hpas:            map[string]*autoscalingv2.HorizontalPodAutoscaler{},
		pdbs:            map[string]*policyv1.PodDisruptionBudget{},
		netpols:         map[string]*networkingv1.NetworkPolicy{},
		serviceMonitors: map[string]*monitoringv1.ServiceMonitor{},
	}
}

// add decodes one object's JSON strictly into its Kubernetes type and
// files it under its kind.
func (b *built) add(kind, apiVersion, name string, data []byte) error {
	k, ok := kinds[kind]
	if !ok {
		return fmt.Errorf("%s %s: a kind this test does not know; add it to kinds with its Go type", kind, name)
	}
	if apiVersion != k.apiVersion {
		return fmt.Errorf("%s %s: apiVersion %q, want %q", kind, name, apiVersion, k.apiVersion)
	}
	v := k.new()
	if err := decodeStrict(data, v); err != nil {
		return fmt.Errorf("%s %s: strict decode into %T: %w", kind, name, v, err)
	}
	b.objs = append(b.objs, v)
	switch o := v.(type) {
	case *appsv1.Deployment:
		b.deployments[name] = o
	case *corev1.Service:
		b.services[name] = o
	case *corev1.ConfigMap:
		b.configMaps[name] = o
	case *autoscalingv2.HorizontalPodAutoscaler:
		b.hpas[name] = o
	case *policyv1.PodDisruptionBudget:
		b.pdbs[name] = o
	case *networkingv1.NetworkPolicy:
		b.netpols[name] = o
	case *monitoringv1.ServiceMonitor:
		b.serviceMonitors[name] = o
	}
	return nil
}

// overlayDirs lists the overlays; there must be at least two regions.
func overlayDirs(t *testing.T) []string {
	t.Helper()
	dirs, err := filepath.Glob(filepath.Join(k8sDir, "overlays", "*", "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for i, d := range dirs {
		dirs[i] = filepath.Dir(d)
	}
	if len(dirs) < 2 {
		t.Fatalf("found %d overlays under %s/overlays, want one per region (at least 2)", len(dirs), k8sDir)
	}
	return dirs
}

// buildOverlays builds every overlay once per test binary.
var overlayCache = map[string]*built{}

func buildOverlay(t *testing.T, dir string) *built {
	t.Helper()
	if b, ok := overlayCache[dir]; ok {
		return b
	}
	b, err := kustomizeBuild(dir)
	if err != nil {
		t.Fatal(err)
	}
	overlayCache[dir] = b
	return b
}

// TestKustomizeBuild builds the base and every overlay with the kustomize
// API and decodes every object strictly into its Kubernetes type; each
// overlay must hold the full set of objects a region runs.
func TestKustomizeBuild(t *testing.T) {
	t.Run("base", func(t *testing.T) {
		if _, err := kustomizeBuild(filepath.Join(k8sDir, "base")); err != nil {
			t.Fatal(err)
		}
	})
	for _, dir := range overlayDirs(t) {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			b := buildOverlay(t, dir)
			counts := map[string]int{}
			for _, o := range b.objs {
				counts[fmt.Sprintf("%T", o)]++
			}
			want := map[string]int{
				"*v1.Deployment":              2, // limiterd, reconciler
				"*v2.HorizontalPodAutoscaler": 1,
				"*v1.PodDisruptionBudget":     2,
				"*v1.NetworkPolicy":           2,
				"*v1.ServiceMonitor":          2,
			}
			for k, n := range want {
				if counts[k] != n {
					t.Errorf("%d objects of type %s, want %d", counts[k], k, n)
				}
			}
			headless := 0
			for _, s := range b.services {
				if s.Spec.ClusterIP == corev1.ClusterIPNone {
					headless++
				}
				if s.Namespace != "limiterd" {
					t.Errorf("Service %s in namespace %q, want limiterd", s.Name, s.Namespace)
				}
			}
			if headless != 1 {
				t.Errorf("%d headless Services, want 1 (client-side gRPC load balancing)", headless)
			}
		})
	}
}

// daemon is one daemon container of an overlay, its args resolved and
// parsed by the daemon's own flag set.
type daemon struct {
	kind      string // limiterdContainer or reconcilerContainer
	deploy    *appsv1.Deployment
	container corev1.Container
	env       map[string]string
	args      []string // after $(VAR) expansion
	lim       limiterd.Options
	rec       reconciler.Options
	log       logging.Options
	// files maps each file flag's value, as parsed (a copy in a temporary
	// directory), to its content, for the files from a ConfigMap of the build.
	files map[string][]byte
}

func (d *daemon) httpAddress() string {
	if d.kind == limiterdContainer {
		return d.lim.Server.HTTPAddress
	}
	return d.rec.HTTPAddress
}

func (d *daemon) region() string {
	if d.kind == limiterdContainer {
		return d.lim.Region.Name
	}
	return d.rec.Region
}

func (d *daemon) redisAddrs() []string {
	if d.kind == limiterdContainer {
		return d.lim.Redis.Addrs
	}
	return d.rec.Redis.Addrs
}

func (d *daemon) natsURL() string {
	if d.kind == limiterdContainer {
		return d.lim.NATS.URL
	}
	return d.rec.NATSURL
}

// flagSet returns the flag set the daemon's main builds, writing into d.
func (d *daemon) flagSet() (*flag.FlagSet, error) {
	fs := flag.NewFlagSet(d.kind, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	switch d.kind {
	case limiterdContainer:
		d.lim.RegisterFlags(fs)
	case reconcilerContainer:
		d.rec.RegisterFlags(fs)
	default:
		return nil, fmt.Errorf("container %q is neither %q nor %q", d.kind, limiterdContainer, reconcilerContainer)
	}
	d.log.RegisterFlags(fs)
	return fs, nil
}

var envRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// containerEnv resolves a container's environment as the kubelet would,
// from the ConfigMaps of the build. Secrets are not in a build: an env
// variable from a Secret is an error here (the manifests mount the one
// Secret they use as a file).
func containerEnv(b *built, c corev1.Container) (map[string]string, error) {
	env := map[string]string{}
	for _, from := range c.EnvFrom {
		if from.ConfigMapRef == nil {
			return nil, fmt.Errorf("envFrom other than a ConfigMap")
		}
		cm, ok := b.configMaps[from.ConfigMapRef.Name]
		if !ok {
			return nil, fmt.Errorf("envFrom: no ConfigMap %s in the build", from.ConfigMapRef.Name)
		}
		for k, v := range cm.Data {
			env[from.Prefix+k] = v
		}
	}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = e.Value
		case e.ValueFrom.ConfigMapKeyRef != nil:
			ref := e.ValueFrom.ConfigMapKeyRef
			cm, ok := b.configMaps[ref.Name]
			if !ok {
				return nil, fmt.Errorf("env %s: no ConfigMap %s in the build", e.Name, ref.Name)
			}
			v, ok := cm.Data[ref.Key]
			if !ok {
				return nil, fmt.Errorf("env %s: ConfigMap %s has no key %s", e.Name, ref.Name, ref.Key)
			}
			env[e.Name] = v
		case e.ValueFrom.FieldRef != nil:
			samples := map[string]string{"metadata.name": "limiterd-5d8c7b9f4-x2x7q", "metadata.namespace": "limiterd", "status.podIP": "10.1.2.3"}
			v, ok := samples[e.ValueFrom.FieldRef.FieldPath]
			if !ok {
				return nil, fmt.Errorf("env %s: field %s has no sample value in this test", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
			env[e.Name] = v
		default:
			return nil, fmt.Errorf("env %s: only values, ConfigMap keys and fields are resolved by this test", e.Name)
		}
	}
	return env, nil
}

// expand replaces $(VAR) as the kubelet does; an undefined variable is an
// error here (the kubelet would pass it on literally).
func expand(s string, env map[string]string) (string, error) {
	var missing []string
	out := envRef.ReplaceAllStringFunc(s, func(m string) string {
		name := envRef.FindStringSubmatch(m)[1]
		v, ok := env[name]
		if !ok {
			missing = append(missing, name)
		}
		return v
	})
	if len(missing) > 0 {
		return "", fmt.Errorf("%q refers to undefined env %s", s, strings.Join(missing, ", "))
	}
	return out, nil
}

// mountedFile finds the volume behind an absolute path in the container:
// for a ConfigMap of the build, its content; for a Secret (never in a
// build), nil after checking that the path is one of the items it mounts.
func mountedFile(b *built, spec corev1.PodSpec, c corev1.Container, p string) ([]byte, error) {
	for _, m := range c.VolumeMounts {
		rel, ok := strings.CutPrefix(p, strings.TrimSuffix(m.MountPath, "/")+"/")
		if !ok {
			continue
		}
		i := slices.IndexFunc(spec.Volumes, func(v corev1.Volume) bool { return v.Name == m.Name })
		if i < 0 {
			return nil, fmt.Errorf("%s: volume %s is not in the pod", p, m.Name)
		}
		v := spec.Volumes[i]
		items := func(its []corev1.KeyToPath) (string, bool) {
			if len(its) == 0 {
				return rel, true
			}
			for _, it := range its {
				if it.Path == rel {
					return it.Key, true
				}
			}
			return "", false
		}
		switch {
		case v.ConfigMap != nil:
			cm, ok := b.configMaps[v.ConfigMap.Name]
			if !ok {
				return nil, fmt.Errorf("%s: ConfigMap %s is not in the build", p, v.ConfigMap.Name)
			}
			key, ok := items(v.ConfigMap.Items)
			if !ok {
				return nil, fmt.Errorf("%s: volume %s mounts no item at %s", p, v.Name, rel)
			}
			data, ok := cm.Data[key]
			if !ok {
				return nil, fmt.Errorf("%s: ConfigMap %s has no key %s", p, cm.Name, key)
			}
			return []byte(data), nil
		case v.Secret != nil:
			if _, ok := items(v.Secret.Items); !ok || len(v.Secret.Items) == 0 {
				return nil, fmt.Errorf("%s: Secret volume %s must list its items, with one at %s", p, v.Name, rel)
			}
			return nil, nil
		default:
			return nil, fmt.Errorf("%s: volume %s is neither a ConfigMap nor a Secret", p, v.Name)
		}
	}
	return nil, fmt.Errorf("%s: no volume is mounted there", p)
}

// loadDaemon resolves, parses and loads one container: its args parse with
// the daemon's flag set, every file flag names a mounted file, and the
// daemon's own New accepts the options (rules and topology loaded from the
// ConfigMaps, options validated) without connecting to anything.
func loadDaemon(t *testing.T, b *built, dep *appsv1.Deployment, c corev1.Container) (*daemon, error) {
	d := &daemon{kind: c.Name, deploy: dep, container: c, files: map[string][]byte{}}
	fs, err := d.flagSet()
	if err != nil {
		return nil, err
	}
	if d.env, err = containerEnv(b, c); err != nil {
		return nil, err
	}
	if len(c.Command) != 1 || path.Base(c.Command[0]) != c.Name {
		return nil, fmt.Errorf("command %q: want the %s binary alone (args carry the flags)", c.Command, c.Name)
	}
	tmp := t.TempDir()
	var parsed []string
	for _, a := range c.Args {
		a, err := expand(a, d.env)
		if err != nil {
			return nil, err
		}
		d.args = append(d.args, a)
		name, value, ok := strings.Cut(a, "=")
		if ok && strings.HasPrefix(value, "/") {
			data, err := mountedFile(b, dep.Spec.Template.Spec, c, value)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
			if data != nil {
				local := filepath.Join(tmp, strings.NewReplacer("/", "_").Replace(value))
				d.files[local] = data
				if err := os.WriteFile(local, data, 0o644); err != nil {
					return nil, err
				}
				a = name + "=" + local
			}
		}
		parsed = append(parsed, a)
	}
	if err := fs.Parse(parsed); err != nil {
		return nil, fmt.Errorf("%w (args %q)", err, d.args)
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("args %q: positional arguments %q, which the daemon refuses", d.args, fs.Args())
	}
	if _, err := logging.New(io.Discard, d.log); err != nil {
		return nil, fmt.Errorf("%w (args %q)", err, d.args)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	switch d.kind {
	case limiterdContainer:
		o := d.lim
		o.Logger = quiet
		if _, err := limiterd.New(o); err != nil {
			return nil, fmt.Errorf("limiterd.New: %w (args %q)", err, d.args)
		}
	case reconcilerContainer:
		o := d.rec
		o.Logger = quiet
		if _, err := reconciler.New(o); err != nil {
			return nil, fmt.Errorf("reconciler.New: %w (args %q)", err, d.args)
		}
	}
	return d, nil
}

// overlayDaemons loads the limiterd and reconciler containers of an overlay.
func overlayDaemons(t *testing.T, b *built) map[string]*daemon {
	t.Helper()
	out := map[string]*daemon{}
	for _, dep := range b.deployments {
		for _, c := range dep.Spec.Template.Spec.Containers {
			d, err := loadDaemon(t, b, dep, c)
			if err != nil {
				t.Fatalf("Deployment %s, container %s: %v", dep.Name, c.Name, err)
			}
			if out[d.kind] != nil {
				t.Fatalf("two %s containers (Deployments %s and %s)", d.kind, out[d.kind].deploy.Name, dep.Name)
			}
			out[d.kind] = d
		}
	}
	for _, k := range []string{limiterdContainer, reconcilerContainer} {
		if out[k] == nil {
			t.Fatalf("no %s container in any Deployment", k)
		}
	}
	return out
}

// TestManifestFlags parses every container's args with the daemon's own
// flag set (its RegisterFlags and logging's), after expanding $(VAR) from
// the env the kubelet would give it, and loads the options with the
// daemon's New: unknown flags, bad values, missing files, a region not in
// the topology or rules that do not load all fail here.
func TestManifestFlags(t *testing.T) {
	for _, dir := range overlayDirs(t) {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			b := buildOverlay(t, dir)
			ds := overlayDaemons(t, b)
			lim, rec := ds[limiterdContainer], ds[reconcilerContainer]
			if lim.region() != rec.region() || lim.region() != filepath.Base(dir) {
				t.Errorf("--region: limiterd %q, reconciler %q, want both %q (the overlay's name)", lim.region(), rec.region(), filepath.Base(dir))
			}
			if !slices.Equal(lim.redisAddrs(), rec.redisAddrs()) || len(lim.redisAddrs()) == 0 {
				t.Errorf("--redis.addrs: limiterd %q, reconciler %q: want the same, non-empty", lim.redisAddrs(), rec.redisAddrs())
			}
			if lim.natsURL() != rec.natsURL() || lim.natsURL() == "" {
				t.Errorf("--nats.url: limiterd %q, reconciler %q: want the same, non-empty", lim.natsURL(), rec.natsURL())
			}
			if lim.lim.Redis.PasswordFile == "" || lim.lim.Redis.PasswordFile != rec.rec.Redis.PasswordFile {
				t.Errorf("--redis.password-file: limiterd %q, reconciler %q: ElastiCache has an auth token, both need it", lim.lim.Redis.PasswordFile, rec.rec.Redis.PasswordFile)
			}
			if !lim.lim.Redis.TLS {
				t.Error("limiterd: --redis.tls not set, but ElastiCache requires TLS (transit encryption)")
			}
			if lim.lim.Rules.File == "" || !bytes.Equal(lim.files[lim.lim.Rules.File], rec.files[rec.rec.RulesFile]) {
				t.Error("limiterd and the reconciler load different rules files")
			}
			if !bytes.Equal(lim.files[lim.lim.Region.TopologyFile], rec.files[rec.rec.TopologyFile]) || lim.lim.Region.TopologyFile == "" {
				t.Error("limiterd and the reconciler load different topology files")
			}
			for _, u := range strings.Split(rec.natsURL(), ",") {
				if pu, err := url.Parse(u); err != nil || pu.Scheme != "nats" || pu.Port() == "" {
					t.Errorf("--nats.url: %q is not nats://host:port", u)
				}
			}
			if n := len(strings.Split(rec.natsURL(), ",")); rec.rec.StreamReplicas > n {
				t.Errorf("--stream.replicas=%d but --nats.url names %d servers", rec.rec.StreamReplicas, n)
			}
		})
	}
}

// portOf returns the port of a host:port listen address, which must listen
// on every interface of the pod: the daemons' defaults are loopback
// (127.0.0.1:8081), where probes and Services cannot reach them.
func portOf(addr string) (int32, error) {
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, err
	}
	if ip := net.ParseIP(host); host != "" && (ip == nil || !ip.IsUnspecified()) {
		return 0, fmt.Errorf("listen address %q: listen on all interfaces (:port), not %s, in a pod", addr, host)
	}
	n, err := strconv.ParseUint(p, 10, 16)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("listen address %q: a fixed port is needed in a pod", addr)
	}
	return int32(n), nil
}

// containerPort resolves a named or numbered port of a container.
func containerPort(c corev1.Container, p intstr.IntOrString) (corev1.ContainerPort, bool) {
	for _, cp := range c.Ports {
		if (p.Type == intstr.String && cp.Name == p.StrVal) || (p.Type == intstr.Int && cp.ContainerPort == p.IntVal) {
			return cp, true
		}
	}
	return corev1.ContainerPort{}, false
}

// TestManifestPortsAndProbes checks every containerPort and probe against the
// listen addresses in the container's own flags and the paths the daemons
// serve: gRPC and HTTP ports exposed under the names grpc and http, no
// other port, readiness on /readyz and liveness on /healthz of the HTTP
// port, and limiterd's drain: not ready well inside --shutdown.delay, and a
// termination grace period above delay + grace period + the last flush.
func TestManifestPortsAndProbes(t *testing.T) {
	for _, dir := range overlayDirs(t) {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			b := buildOverlay(t, dir)
			for _, d := range overlayDaemons(t, b) {
				want := map[string]int32{}
				hp, err := portOf(d.httpAddress())
				if err != nil {
					t.Fatalf("%s: --http.listen-address: %v", d.kind, err)
				}
				want["http"] = hp
				if d.kind == limiterdContainer {
					gp, err := portOf(d.lim.Server.GRPCAddress)
					if err != nil {
						t.Fatalf("%s: --grpc.listen-address: %v", d.kind, err)
					}
					want["grpc"] = gp
				}
				got := map[string]int32{}
				for _, cp := range d.container.Ports {
					got[cp.Name] = cp.ContainerPort
					if cp.Protocol != "" && cp.Protocol != corev1.ProtocolTCP {
						t.Errorf("%s: port %s: protocol %s, want TCP", d.kind, cp.Name, cp.Protocol)
					}
				}
				if !maps.Equal(got, want) {
					t.Errorf("%s: containerPorts %v, want %v (from the listen-address flags)", d.kind, got, want)
				}
				probes := map[string]*corev1.Probe{"readinessProbe": d.container.ReadinessProbe, "livenessProbe": d.container.LivenessProbe}
				wantPath := map[string]string{"readinessProbe": "/readyz", "livenessProbe": "/healthz"}
				for name, p := range probes {
					if p == nil || p.HTTPGet == nil {
						t.Errorf("%s: %s: want an httpGet probe", d.kind, name)
						continue
					}
					cp, ok := containerPort(d.container, p.HTTPGet.Port)
					if !ok || cp.ContainerPort != hp {
						t.Errorf("%s: %s: port %s is not the HTTP listen port %d", d.kind, name, p.HTTPGet.Port.String(), hp)
					}
					if !slices.Contains(servedPaths[d.kind], p.HTTPGet.Path) || p.HTTPGet.Path != wantPath[name] {
						t.Errorf("%s: %s: path %q, want %q (served: %q)", d.kind, name, p.HTTPGet.Path, wantPath[name], servedPaths[d.kind])
					}
				}
				if d.kind != limiterdContainer {
					continue
				}
				spec := d.deploy.Spec.Template.Spec
				drain := d.lim.Server.ShutdownDelay + d.lim.Server.GracePeriod + 2*time.Second // + the last spend flush
				if d.lim.Server.ShutdownDelay < 2*time.Second || d.lim.Server.ShutdownDelay > 30*time.Second {
					t.Errorf("--shutdown.delay=%v: want a few seconds, for the endpoints to drain", d.lim.Server.ShutdownDelay)
				}
				if tgp := spec.TerminationGracePeriodSeconds; tgp == nil || time.Duration(*tgp)*time.Second <= drain {
					t.Errorf("terminationGracePeriodSeconds: want above --shutdown.delay + --shutdown.grace-period + 2s of last flush = %v", drain)
				}
				if rp := d.container.ReadinessProbe; rp != nil {
					notReady := time.Duration(rp.PeriodSeconds*max(rp.FailureThreshold, 1)) * time.Second
					if notReady > d.lim.Server.ShutdownDelay {
						t.Errorf("readiness turns false only after %v, above --shutdown.delay=%v", notReady, d.lim.Server.ShutdownDelay)
					}
				}
			}
		})
	}
}

// selects reports whether a label selector selects labels; an empty
// selector selects nothing here (the manifests never mean "everything").
func selects(sel map[string]string, labels map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// selected returns the Deployments whose pods a selector selects.
func selected(b *built, sel map[string]string) []*appsv1.Deployment {
	var out []*appsv1.Deployment
	for _, name := range slices.Sorted(maps.Keys(b.deployments)) {
		d := b.deployments[name]
		if selects(sel, d.Spec.Template.Labels) {
			out = append(out, d)
		}
	}
	return out
}

func exactlyOne(t *testing.T, what string, ds []*appsv1.Deployment) *appsv1.Deployment {
	t.Helper()
	if len(ds) != 1 {
		t.Errorf("%s selects %d Deployments, want 1", what, len(ds))
		return nil
	}
	return ds[0]
}

// TestManifestReferences checks what refers to what: each Deployment's
// selector matches its own pods; each Service, PDB, HPA, NetworkPolicy and
// ServiceMonitor reaches exactly the pods and ports it means; and every
// port a NetworkPolicy allows exists, every container port is allowed in,
// and the egress rules let the daemons reach the Redis and NATS ports of
// their flags, DNS, and the other regions' limiterd.
func TestManifestReferences(t *testing.T) {
	for _, dir := range overlayDirs(t) {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			b := buildOverlay(t, dir)
			ds := overlayDaemons(t, b)
			for _, dep := range b.deployments {
				if dep.Spec.Selector == nil || !selects(dep.Spec.Selector.MatchLabels, dep.Spec.Template.Labels) {
					t.Errorf("Deployment %s: selector does not select its own pods", dep.Name)
				}
			}
			for _, s := range b.services {
				dep := exactlyOne(t, "Service "+s.Name, selected(b, s.Spec.Selector))
				if dep == nil {
					continue
				}
				c := dep.Spec.Template.Spec.Containers[0]
				for _, p := range s.Spec.Ports {
					if cp, ok := containerPort(c, p.TargetPort); !ok || cp.Name != p.Name {
						t.Errorf("Service %s: port %s: targetPort %s is not the container port of that name", s.Name, p.Name, p.TargetPort.String())
					}
				}
			}
			for _, sm := range b.serviceMonitors {
				var svcs []*corev1.Service
				for _, s := range b.services {
					if selects(sm.Spec.Selector.MatchLabels, s.Labels) && len(sm.Spec.Selector.MatchExpressions) == 0 {
						svcs = append(svcs, s)
					}
				}
				if len(svcs) != 1 {
					t.Errorf("ServiceMonitor %s selects %d Services, want 1 (more would scrape each pod twice)", sm.Name, len(svcs))
					continue
				}
				dep := exactlyOne(t, "Service "+svcs[0].Name, selected(b, svcs[0].Spec.Selector))
				if dep == nil {
					continue
				}
				kind := dep.Spec.Template.Spec.Containers[0].Name
				for _, ep := range sm.Spec.Endpoints {
					if !slices.ContainsFunc(svcs[0].Spec.Ports, func(p corev1.ServicePort) bool { return p.Name == ep.Port }) {
						t.Errorf("ServiceMonitor %s: port %q is not a port of Service %s", sm.Name, ep.Port, svcs[0].Name)
					}
					if ep.Path != "/metrics" || !slices.Contains(servedPaths[kind], ep.Path) {
						t.Errorf("ServiceMonitor %s: path %q, want /metrics", sm.Name, ep.Path)
					}
				}
			}
			for _, p := range b.pdbs {
				dep := exactlyOne(t, "PodDisruptionBudget "+p.Name, selected(b, p.Spec.Selector.MatchLabels))
				if dep == nil {
					continue
				}
				if p.Spec.MaxUnavailable == nil || p.Spec.MaxUnavailable.Type != intstr.Int || p.Spec.MaxUnavailable.IntVal < 1 ||
					p.Spec.MaxUnavailable.IntVal >= *dep.Spec.Replicas {
					t.Errorf("PodDisruptionBudget %s: maxUnavailable %v: want a number from 1 to below the %d replicas", p.Name, p.Spec.MaxUnavailable, *dep.Spec.Replicas)
				}
			}
			for _, h := range b.hpas {
				ref := h.Spec.ScaleTargetRef
				if ref.Kind != "Deployment" || ref.APIVersion != "apps/v1" || b.deployments[ref.Name] == nil {
					t.Errorf("HorizontalPodAutoscaler %s: target %s %s %s is not a Deployment of the build", h.Name, ref.APIVersion, ref.Kind, ref.Name)
				}
			}
			for _, np := range b.netpols {
				dep := exactlyOne(t, "NetworkPolicy "+np.Name, selected(b, np.Spec.PodSelector.MatchLabels))
				if dep == nil {
					continue
				}
				c := dep.Spec.Template.Spec.Containers[0]
				if !slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeIngress) || !slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeEgress) {
					t.Errorf("NetworkPolicy %s: policyTypes %v, want Ingress and Egress", np.Name, np.Spec.PolicyTypes)
				}
				allowedIn := map[int32]bool{}
				for _, r := range np.Spec.Ingress {
					for _, p := range r.Ports {
						if p.Port == nil {
							t.Errorf("NetworkPolicy %s: an ingress rule allows every port", np.Name)
							continue
						}
						cp, ok := containerPort(c, *p.Port)
						if !ok {
							t.Errorf("NetworkPolicy %s: ingress port %s is not a port of container %s", np.Name, p.Port.String(), c.Name)
							continue
						}
						allowedIn[cp.ContainerPort] = true
					}
				}
				for _, cp := range c.Ports {
					if !allowedIn[cp.ContainerPort] {
						t.Errorf("NetworkPolicy %s: container port %s (%d) is never allowed in", np.Name, cp.Name, cp.ContainerPort)
					}
				}
				allowedOut := map[string]bool{}
				for _, r := range np.Spec.Egress {
					for _, p := range r.Ports {
						if p.Port == nil || p.Port.Type != intstr.Int {
							t.Errorf("NetworkPolicy %s: egress ports must be numbers", np.Name)
							continue
						}
						proto := corev1.ProtocolTCP
						if p.Protocol != nil {
							proto = *p.Protocol
						}
						allowedOut[fmt.Sprintf("%s/%d", proto, p.Port.IntVal)] = true
					}
				}
				d := ds[c.Name]
				if d == nil {
					t.Errorf("NetworkPolicy %s: selects container %s, not a daemon", np.Name, c.Name)
					continue
				}
				need := map[string]string{"UDP/53": "DNS", "TCP/53": "DNS"}
				for _, a := range d.redisAddrs() {
					_, p, _ := net.SplitHostPort(a)
					need["TCP/"+p] = "Redis " + a
				}
				for _, u := range strings.Split(d.natsURL(), ",") {
					if pu, err := url.Parse(u); err == nil {
						need["TCP/"+pu.Port()] = "NATS " + u
					}
				}
				if d.kind == limiterdContainer {
					topo, err := region.Parse("topology.yml", d.files[d.lim.Region.TopologyFile])
					if err != nil {
						t.Fatal(err)
					}
					for _, r := range topo.Regions() {
						if r.Name != d.region() {
							_, p, _ := net.SplitHostPort(r.LimiterAddress)
							need["TCP/"+p] = "limiterd of " + r.Name
						}
					}
				}
				for port, what := range need {
					if !allowedOut[port] {
						t.Errorf("NetworkPolicy %s: egress to %s (%s) is not allowed", np.Name, port, what)
					}
				}
			}
		})
	}
}

// TestRegionConfig checks what makes each overlay its region: the topology
// parses with pkg/region, names the overlay's region and is the same in
// every overlay, and this region's address is the name and port of its
// limiterd-regional Service; the rules parse with internal/rules and are
// examples/rules.yml; --fleet.size is the Deployment's replicas and the HPA's
// floor; and the reconcilers are as many as their concurrency model uses.
func TestRegionConfig(t *testing.T) {
	var first *region.Topology
	for _, dir := range overlayDirs(t) {
		name := filepath.Base(dir)
		t.Run(name, func(t *testing.T) {
			b := buildOverlay(t, dir)
			ds := overlayDaemons(t, b)
			lim, rec := ds[limiterdContainer], ds[reconcilerContainer]

			topo, err := region.Parse("topology.yml", lim.files[lim.lim.Region.TopologyFile])
			if err != nil {
				t.Fatalf("topology ConfigMap: %v", err)
			}
			if !topo.Has(name) || lim.region() != name {
				t.Errorf("topology %q and --region %q: want both to name the overlay's region %q", topo.Names(), lim.region(), name)
			}
			if first == nil {
				first = topo
			} else if !slices.Equal(first.Regions(), topo.Regions()) {
				t.Errorf("topology %v differs from another overlay's %v", topo.Regions(), first.Regions())
			}
			own, _ := topo.Region(name)
			host, port, _ := net.SplitHostPort(own.LimiterAddress)
			svc := b.services["limiterd-regional"]
			if svc == nil {
				t.Fatal("no Service limiterd-regional, the address other regions forward to")
			}
			if got := svc.Annotations["external-dns.alpha.kubernetes.io/hostname"]; got != host {
				t.Errorf("Service limiterd-regional is published as %q, but the topology names %q for %s", got, host, name)
			}
			if !slices.ContainsFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return strconv.Itoa(int(p.Port)) == port }) {
				t.Errorf("Service limiterd-regional has no port %s (the topology's %s)", port, own.LimiterAddress)
			}

			set, err := rules.Parse("rules.yml", lim.files[lim.lim.Rules.File])
			if err != nil {
				t.Fatalf("rules ConfigMap: %v", err)
			}
			if len(set.Rules()) == 0 {
				t.Error("rules ConfigMap holds no rule")
			}
			example, err := os.ReadFile(filepath.Join("..", "examples", "rules.yml"))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(lim.files[lim.lim.Rules.File], example) {
				t.Error("the rules ConfigMap is not examples/rules.yml")
			}

			replicas := *lim.deploy.Spec.Replicas
			if int32(lim.lim.Region.FleetSize) != replicas {
				t.Errorf("--fleet.size=%d but limiterd has %d replicas", lim.lim.Region.FleetSize, replicas)
			}
			var hpa *autoscalingv2.HorizontalPodAutoscaler
			for _, h := range b.hpas {
				if h.Spec.ScaleTargetRef.Name == lim.deploy.Name {
					hpa = h
				}
			}
			if hpa == nil {
				t.Fatal("no HorizontalPodAutoscaler for limiterd")
			}
			if hpa.Spec.MinReplicas == nil || *hpa.Spec.MinReplicas != replicas || hpa.Spec.MaxReplicas < replicas {
				t.Errorf("HPA %v..%d: want minReplicas = replicas = --fleet.size = %d and maxReplicas above", hpa.Spec.MinReplicas, hpa.Spec.MaxReplicas, replicas)
			}

			// (regions - 1) apply loops + 1 relay loop are all a region's
			// reconcilers can keep busy; two are needed to survive one.
			busy := int32(len(topo.Names()) - 1 + 1)
			if n := *rec.deploy.Spec.Replicas; n < 2 || n > busy {
				t.Errorf("%d reconcilers: want from 2 (one may die) to %d ((regions-1)+1: more add no throughput)", n, busy)
			}
		})
	}
}

// TestRulesCopy keeps deploy/k8s/base/rules.yml identical to
// examples/rules.yml.
func TestRulesCopy(t *testing.T) {
	example, err := os.ReadFile(filepath.Join("..", "examples", "rules.yml"))
	if err != nil {
		t.Fatal(err)
	}
	copied, err := os.ReadFile(filepath.Join(k8sDir, "base", "rules.yml"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(example, copied) {
		t.Error("deploy/k8s/base/rules.yml differs from examples/rules.yml: cp examples/rules.yml deploy/k8s/base/rules.yml")
	}
}

// TestManifestSecretModes: every secret a daemon mounts is readable by the
// daemon (its pod's fsGroup) and by no other user: the daemons refuse a
// secret file open to others, and Kubernetes mounts secrets 0644 unless
// told otherwise.
func TestManifestSecretModes(t *testing.T) {
	for _, dir := range overlayDirs(t) {
		b := buildOverlay(t, dir)
		for name, dep := range b.deployments {
			spec := dep.Spec.Template.Spec
			for _, v := range spec.Volumes {
				if v.Secret == nil {
					continue
				}
				if v.Secret.DefaultMode == nil || *v.Secret.DefaultMode&0o007 != 0 {
					t.Errorf("%s: %s: secret volume %s has no defaultMode closed to others (got %v)", dir, name, v.Name, v.Secret.DefaultMode)
				}
				for _, it := range v.Secret.Items {
					if it.Mode != nil && *it.Mode&0o007 != 0 {
						t.Errorf("%s: %s: secret volume %s item %s has mode %o", dir, name, v.Name, it.Key, *it.Mode)
					}
				}
				if sc := spec.SecurityContext; sc == nil || sc.FSGroup == nil || sc.RunAsGroup == nil || *sc.FSGroup != *sc.RunAsGroup {
					t.Errorf("%s: %s: mounts secret %s without an fsGroup equal to its runAsGroup: a 0440 secret would be unreadable", dir, name, v.Name)
				}
			}
		}
	}
}
