package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	"helm.sh/helm/v3/pkg/releaseutil"
	"sigs.k8s.io/yaml"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"

	"github.com/limiterd/limiterd/pkg/region"
)

// The chart, and the values of each region (one per kustomize overlay).
const (
	chartDir   = "helm/limiterd"
	regionsDir = "helm/regions"
	namespace  = "limiterd"
)

// helmLabels are the labels the chart adds to what deploy/k8s/base sets.
var helmLabels = []string{
	"app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
	"app.kubernetes.io/version", "helm.sh/chart",
}

// renderChart renders the chart as `helm template -n limiterd -f
// valuesFile` would, with set merged over the file (nil: nothing), and
// decodes every object strictly into its Kubernetes type. The values are
// checked against the chart's values.schema.json first, as helm does.
func renderChart(valuesFile string, set map[string]any) (*built, error) {
	ch, err := loader.Load(chartDir)
	if err != nil {
		return nil, err
	}
	vals := map[string]any{}
	if valuesFile != "" {
		if vals, err = chartutil.ReadValuesFile(valuesFile); err != nil {
			return nil, err
		}
	}
	vals = chartutil.CoalesceTables(set, vals)
	rv, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{
		Name: "limiterd", Namespace: namespace, Revision: 1, IsInstall: true,
	}, chartutil.DefaultCapabilities)
	if err != nil {
		return nil, err
	}
	out, err := engine.Render(ch, rv)
	if err != nil {
		return nil, err
	}
	b := newBuilt("helm " + filepath.Base(valuesFile))
	for _, tpl := range slices.Sorted(maps.Keys(out)) {
		if !strings.HasSuffix(tpl, ".yaml") {
			continue // NOTES.txt, _helpers.tpl
		}
		docs := releaseutil.SplitManifests(out[tpl])
		for _, k := range slices.Sorted(maps.Keys(docs)) {
			data, err := yaml.YAMLToJSON([]byte(docs[k]))
			if err != nil {
				return nil, fmt.Errorf("%s: %w", tpl, err)
			}
			var head struct {
				APIVersion string `json:"apiVersion"`
				Kind       string `json:"kind"`
				Metadata   struct {
					Name      string `json:"name"`
					Namespace string `json:"namespace"`
				} `json:"metadata"`
			}
			if err := json.Unmarshal(data, &head); err != nil || head.Kind == "" {
				continue // a document of comments only
			}
			if head.Metadata.Namespace != namespace {
				return nil, fmt.Errorf("%s: %s %s: namespace %q, want the release's %q", tpl, head.Kind, head.Metadata.Name, head.Metadata.Namespace, namespace)
			}
			if err := b.add(head.Kind, head.APIVersion, head.Metadata.Name, data); err != nil {
				return nil, fmt.Errorf("%s: %w", tpl, err)
			}
		}
	}
	return b, nil
}

// regionValues is the chart's values file for an overlay's region.
func regionValues(t *testing.T, overlay string) string {
	t.Helper()
	f := filepath.Join(regionsDir, filepath.Base(overlay)+".yaml")
	if _, err := os.Stat(f); err != nil {
		t.Fatalf("overlay %s has no chart values %s: each region the overlays deploy must be deployable with the chart too", overlay, f)
	}
	return f
}

// TestHelmLint lints the chart as `helm lint --strict` would, with each
// region's values: no warning, no error.
func TestHelmLint(t *testing.T) {
	for _, dir := range overlayDirs(t) {
		vals, err := chartutil.ReadValuesFile(regionValues(t, dir))
		if err != nil {
			t.Fatal(err)
		}
		l := lint.All(chartDir, vals, namespace, true)
		for _, m := range l.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("%s: helm lint: %s", dir, m)
			}
		}
	}
}

// TestHelmMatchesKustomize renders the chart with each region's values and
// holds every object to the same region's kustomize overlay, field by
// field: the chart and the overlays cannot drift. Only these differ: the
// overlay's Namespace (helm install --create-namespace makes it), Helm's
// own labels and the pods' checksum annotation, the hash suffix kustomize
// gives generated ConfigMaps, and the topology file's comments (both
// files are compared parsed). The overlay tests (flags, ports, secret
// modes) then hold for the chart as well; TestHelmFlags runs the flag test
// on the chart's output directly.
func TestHelmMatchesKustomize(t *testing.T) {
	for _, dir := range overlayDirs(t) {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			kb := buildOverlay(t, dir)
			hb, err := renderChart(regionValues(t, dir), nil)
			if err != nil {
				t.Fatal(err)
			}
			want := normalizedObjects(t, kb, false)
			got := normalizedObjects(t, hb, true)
			for _, k := range slices.Sorted(maps.Keys(want)) {
				g, ok := got[k]
				if !ok {
					t.Errorf("%s: in the overlay, not in the chart", k)
					continue
				}
				if d := firstDiff(want[k], g); d != "" {
					t.Errorf("%s differs from the overlay's: %s", k, d)
				}
			}
			for _, k := range slices.Sorted(maps.Keys(got)) {
				if _, ok := want[k]; !ok {
					t.Errorf("%s: in the chart, not in the overlay", k)
				}
			}
		})
	}
}

// kustomizeSuffix is the hash kustomize appends to a generated name.
var kustomizeSuffix = regexp.MustCompile(`^(.*)-[a-z0-9]{10}$`)

// normalizedObjects returns b's objects as indented JSON by "Kind/name",
// with what may differ between the chart and the overlays taken out.
func normalizedObjects(t *testing.T, b *built, helm bool) map[string]string {
	t.Helper()
	// Generated names, to replace by their base names everywhere.
	renames := map[string]string{}
	for name := range b.configMaps {
		if m := kustomizeSuffix.FindStringSubmatch(name); m != nil && !helm {
			renames[name] = m[1]
		}
	}
	out := map[string]string{}
	for _, o := range b.objs {
		data, err := json.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		for from, to := range renames {
			data = bytes.ReplaceAll(data, []byte(`"`+from+`"`), []byte(`"`+to+`"`))
		}
		var m map[string]any
		if err := json.Unmarshal(data, &m); err != nil {
			t.Fatal(err)
		}
		kind, _ := m["kind"].(string)
		if kind == "Namespace" {
			continue
		}
		meta, _ := m["metadata"].(map[string]any)
		name, _ := meta["name"].(string)
		if labels, ok := meta["labels"].(map[string]any); ok && helm {
			for _, l := range helmLabels {
				if _, ok := labels[l]; !ok {
					t.Errorf("%s/%s: no label %s", kind, name, l)
				}
				delete(labels, l)
			}
		}
		// The overlays' own ConfigMaps do not get the base's part-of label.
		if labels, ok := meta["labels"].(map[string]any); ok && kind == "ConfigMap" {
			delete(labels, "app.kubernetes.io/part-of")
			if len(labels) == 0 {
				delete(meta, "labels")
			}
		}
		if spec, ok := m["spec"].(map[string]any); ok && helm {
			if tpl, ok := spec["template"].(map[string]any); ok {
				tm, _ := tpl["metadata"].(map[string]any)
				if ann, ok := tm["annotations"].(map[string]any); ok {
					if _, ok := ann["checksum/region"]; !ok {
						t.Errorf("%s/%s: pod template without its checksum/region annotation", kind, name)
					}
					delete(ann, "checksum/region")
					if len(ann) == 0 {
						delete(tm, "annotations")
					}
				}
			}
		}
		if kind == "ConfigMap" && name == "limiterd-topology" {
			d, _ := m["data"].(map[string]any)
			s, _ := d["topology.yml"].(string)
			topo, err := region.Parse("topology.yml", []byte(s))
			if err != nil {
				t.Fatalf("%s: limiterd-topology: %v", b.name, err)
			}
			d["topology.yml"] = fmt.Sprintf("generation %d, %+v", topo.Generation(), topo.Regions())
		}
		j, err := json.MarshalIndent(m, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		out[kind+"/"+name] = string(j)
	}
	return out
}

// firstDiff describes the first line where want and got differ, with the
// lines before it for context; "" when they are equal.
func firstDiff(want, got string) string {
	if want == got {
		return ""
	}
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	for i := range max(len(w), len(g)) {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			ctx := strings.Join(w[max(0, i-3):i], "\n")
			return fmt.Sprintf("after\n%s\nthe overlay has\n%s\nthe chart has\n%s", ctx, wl, gl)
		}
	}
	return "they differ"
}

// TestHelmFlags parses the chart's containers' args with the daemons' own
// flag sets and loads them with their New, as TestManifestFlags does for
// the overlays.
func TestHelmFlags(t *testing.T) {
	for _, dir := range overlayDirs(t) {
		hb, err := renderChart(regionValues(t, dir), nil)
		if err != nil {
			t.Fatal(err)
		}
		ds := overlayDaemons(t, hb)
		if got, want := ds[limiterdContainer].region(), filepath.Base(dir); got != want {
			t.Errorf("%s: limiterd --region=%s, want %s", dir, got, want)
		}
	}
}

// TestHelmOptionalObjects: the PrometheusRule holds deploy/prometheus's
// alert groups and the dashboard ConfigMap deploy/grafana's dashboard, when
// asked for; the ServiceMonitors go when turned off; the images follow the
// values.
func TestHelmOptionalObjects(t *testing.T) {
	vals := regionValues(t, overlayDirs(t)[0])
	hb, err := renderChart(vals, map[string]any{
		"prometheusRule": map[string]any{"enabled": true},
		"dashboard":      map[string]any{"enabled": true},
		"images": map[string]any{"limiterd": map[string]any{
			"repository": "registry.example.com/limiterd", "digest": "sha256:" + strings.Repeat("ab", 32),
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	var rule *monitoringv1.PrometheusRule
	for _, o := range hb.objs {
		if r, ok := o.(*monitoringv1.PrometheusRule); ok {
			rule = r
		}
	}
	if rule == nil {
		t.Fatal("prometheusRule.enabled: no PrometheusRule rendered")
	}
	alerts, err := os.ReadFile(filepath.Join("prometheus", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Groups []struct {
			Name  string `json:"name"`
			Rules []struct {
				Alert string `json:"alert"`
				Expr  string `json:"expr"`
			} `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.Unmarshal(alerts, &file); err != nil {
		t.Fatal(err)
	}
	if len(rule.Spec.Groups) != len(file.Groups) || len(file.Groups) == 0 {
		t.Fatalf("PrometheusRule has %d groups, alerts.yml %d", len(rule.Spec.Groups), len(file.Groups))
	}
	for i, g := range file.Groups {
		rg := rule.Spec.Groups[i]
		if rg.Name != g.Name || len(rg.Rules) != len(g.Rules) {
			t.Fatalf("group %d: PrometheusRule %s with %d rules, alerts.yml %s with %d", i, rg.Name, len(rg.Rules), g.Name, len(g.Rules))
		}
		for j, r := range g.Rules {
			if rg.Rules[j].Alert != r.Alert || rg.Rules[j].Expr.String() != r.Expr {
				t.Errorf("group %s rule %d: PrometheusRule %s %q, alerts.yml %s %q", g.Name, j, rg.Rules[j].Alert, rg.Rules[j].Expr.String(), r.Alert, r.Expr)
			}
		}
	}
	dash, err := os.ReadFile(filepath.Join("grafana", "limiterd.json"))
	if err != nil {
		t.Fatal(err)
	}
	cm := hb.configMaps["limiterd-dashboard"]
	if cm == nil || cm.Data["limiterd.json"] != string(dash) || cm.Labels["grafana_dashboard"] != "1" {
		t.Error("dashboard.enabled: no ConfigMap limiterd-dashboard holding grafana/limiterd.json, labelled grafana_dashboard")
	}
	img := hb.deployments["limiterd"].Spec.Template.Spec.Containers[0].Image
	if want := "registry.example.com/limiterd@sha256:" + strings.Repeat("ab", 32); img != want {
		t.Errorf("limiterd image %s, want %s", img, want)
	}

	off, err := renderChart(vals, map[string]any{"serviceMonitor": map[string]any{"enabled": false}})
	if err != nil {
		t.Fatal(err)
	}
	if len(off.serviceMonitors) != 0 {
		t.Errorf("serviceMonitor.enabled false: %d ServiceMonitors rendered", len(off.serviceMonitors))
	}
}

// TestHelmBadValues: values the chart cannot deploy are refused at render
// (helm install and helm template alike), naming the value.
func TestHelmBadValues(t *testing.T) {
	vals := regionValues(t, overlayDirs(t)[0])
	for _, c := range []struct {
		name string
		file string
		set  map[string]any
		want string
	}{
		{"no values", "", nil, "region is required"},
		{"region outside the topology", vals, map[string]any{"region": "ap-south"}, `region "ap-south" is not in topology.regions`},
		{"region not a name", vals, map[string]any{"region": "US East"}, "region"},
		{"no Redis", vals, map[string]any{"redis": map[string]any{"addrs": ""}}, "redis.addrs is required"},
		{"unknown value", vals, map[string]any{"fleet": map[string]any{"sise": 3}}, "sise"},
		{"fleet of zero", vals, map[string]any{"fleet": map[string]any{"size": 0}}, "size"},
		{"max below the fleet", vals, map[string]any{"fleet": map[string]any{"size": 9, "maxReplicas": 4}}, "fleet.maxReplicas (4) is below fleet.size (9)"},
		{"stream replicas", vals, map[string]any{"reconciler": map[string]any{"streamReplicas": 7}}, "streamReplicas"},
		{"bad digest", vals, map[string]any{"images": map[string]any{"limiterd": map[string]any{"digest": "latest"}}}, "digest"},
		{"address without port", vals, map[string]any{"topology": map[string]any{"regions": []any{map[string]any{"name": "us-east", "limiter_address": "limiterd"}}}}, "limiter_address"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := renderChart(c.file, c.set)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("got %v, want an error naming %q", err, c.want)
			}
		})
	}
}

// TestHelmCopies: the files the chart carries (Helm reads only its own
// directory) are the repository's, and the chart's version its VERSION.
func TestHelmCopies(t *testing.T) {
	for copy, orig := range map[string]string{
		"files/rules.yml":     filepath.Join(k8sDir, "base", "rules.yml"),
		"files/alerts.yml":    filepath.Join("prometheus", "alerts.yml"),
		"files/limiterd.json": filepath.Join("grafana", "limiterd.json"),
	} {
		a, err := os.ReadFile(filepath.Join(chartDir, copy))
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(orig)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(a, b) {
			t.Errorf("%s/%s differs from %s: copy it again (cp deploy/%s deploy/%s/%s)", chartDir, copy, orig, orig, chartDir, copy)
		}
	}
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	v, err := os.ReadFile(filepath.Join("..", "VERSION"))
	if err != nil {
		t.Fatal(err)
	}
	want := strings.TrimSpace(string(v))
	if ch.Metadata.Version != want || ch.Metadata.AppVersion != want {
		t.Errorf("Chart.yaml version %s, appVersion %s; VERSION %s", ch.Metadata.Version, ch.Metadata.AppVersion, want)
	}
}
