package deploy

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// TestCheckersCatchMistakes feeds each checker the mistake it exists to
// catch, so that a checker that stopped checking (and let every manifest,
// module or expression through) fails here.
func TestCheckersCatchMistakes(t *testing.T) {
	writeModule := func(t *testing.T, files map[string]string) []*tfModule {
		t.Helper()
		dir := t.TempDir()
		for name, content := range files {
			p := filepath.Join(dir, name)
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		mods, err := parseTerraform(dir)
		if err != nil {
			t.Fatal(err)
		}
		return mods
	}
	const goodVar = `variable "name" {
  description = "A name."
  type        = string
  validation {
    condition     = length(var.name) > 0
    error_message = "name must not be empty."
  }
}
`
	tests := []struct {
		name  string
		catch func(t *testing.T) (caught bool, detail string)
	}{
		{"strict decoding rejects an unknown field", func(t *testing.T) (bool, string) {
			err := decodeStrict([]byte(`{"apiVersion":"apps/v1","kind":"Deployment","spec":{"replica":3}}`), new(appsv1.Deployment))
			return err != nil && strings.Contains(err.Error(), "replica"), "decodeStrict accepted spec.replica"
		}},
		{"strict decoding accepts a known field", func(t *testing.T) (bool, string) {
			var d appsv1.Deployment
			err := decodeStrict([]byte(`{"apiVersion":"apps/v1","kind":"Deployment","spec":{"replicas":3}}`), &d)
			return err == nil && *d.Spec.Replicas == 3, "decodeStrict refused spec.replicas"
		}},
		{"an undefined $(VAR) in args", func(t *testing.T) (bool, string) {
			_, err := expand("--nats.url=$(NATS_URLS)", map[string]string{"NATS_URL": "nats://x:4222"})
			return err != nil, "expand accepted an undefined variable"
		}},
		{"an env from a missing ConfigMap key", func(t *testing.T) (bool, string) {
			b := &built{configMaps: map[string]*corev1.ConfigMap{"cm": {Data: map[string]string{"A": "1"}}}}
			_, err := containerEnv(b, corev1.Container{Env: []corev1.EnvVar{{Name: "B", ValueFrom: &corev1.EnvVarSource{
				ConfigMapKeyRef: &corev1.ConfigMapKeySelector{LocalObjectReference: corev1.LocalObjectReference{Name: "cm"}, Key: "B"}}}}})
			return err != nil, "containerEnv resolved a missing key"
		}},
		{"an unknown flag of limiterd", func(t *testing.T) (bool, string) {
			d := &daemon{kind: limiterdContainer}
			fs, err := d.flagSet()
			if err != nil {
				t.Fatal(err)
			}
			return fs.Parse([]string{"--redis.adrs=x:6379"}) != nil, "limiterd's flag set accepted --redis.adrs"
		}},
		{"a limiterd flag the reconciler lacks", func(t *testing.T) (bool, string) {
			d := &daemon{kind: reconcilerContainer}
			fs, err := d.flagSet()
			if err != nil {
				t.Fatal(err)
			}
			return fs.Parse([]string{"--fleet.size=3"}) != nil, "the reconciler's flag set accepted --fleet.size"
		}},
		{"a selector without a metric name", func(t *testing.T) (bool, string) {
			_, err := metricNames(`sum(rate({job="limiterd"}[5m]))`)
			return err != nil, "metricNames accepted a nameless selector"
		}},
		{"the metric names of an expression", func(t *testing.T) (bool, string) {
			names, err := metricNames(`histogram_quantile(0.99, sum by (le) (rate(a_bucket[5m]))) / on () b`)
			return err == nil && strings.Join(names, ",") == "a_bucket,b", "metricNames: " + strings.Join(names, ",")
		}},
		{"a histogram is exported as _bucket, _sum and _count only", func(t *testing.T) (bool, string) {
			reg := prometheus.NewRegistry()
			reg.MustRegister(prometheus.NewHistogram(prometheus.HistogramOpts{Name: "h_seconds", Help: "h"}))
			got := map[string]bool{}
			exportedNames(t, reg, got)
			return got["h_seconds_bucket"] && got["h_seconds_sum"] && got["h_seconds_count"] && !got["h_seconds"], "exportedNames of a histogram"
		}},
		{"an undeclared var in Terraform", func(t *testing.T) (bool, string) {
			mods := writeModule(t, map[string]string{"main.tf": goodVar + `output "o" {
  description = "o"
  value       = var.nmae
}
`})
			return len(mods[0].checkReferences()) == 1, "checkReferences missed var.nmae"
		}},
		{"a Terraform variable without validation", func(t *testing.T) (bool, string) {
			mods := writeModule(t, map[string]string{"main.tf": `variable "v" {
  description = "v"
  type        = string
}
`})
			return len(mods[0].checkDocumented()) == 1, "checkDocumented missed the validation"
		}},
		{"a module call with an unknown argument and a missing one", func(t *testing.T) (bool, string) {
			mods := writeModule(t, map[string]string{
				"mod/main.tf":  goodVar,
				"root/main.tf": "module \"m\" {\n  source = \"../mod\"\n  nmae   = \"x\"\n}\n", //nolint:misspell // the misspelt argument is the input
			})
			var errs []error
			for _, m := range mods {
				errs = append(errs, m.checkCalls(mods)...)
			}
			return len(errs) == 2, fmt.Sprintf("checkCalls found %v, want the unknown nmae and the missing name", errs) //nolint:misspell // names the input
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if ok, detail := tc.catch(t); !ok {
				t.Error(detail)
			}
		})
	}
}
