package deploy

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/hclsyntax"
	"github.com/zclconf/go-cty/cty"
	corev1 "k8s.io/api/core/v1"

	"github.com/limiterd/limiterd/internal/ociimage"
)

// imageDaemons are the images `make image` builds, by container name, and
// the version it tags them with.
func imageDaemons(t *testing.T) (map[string]ociimage.Daemon, string) {
	t.Helper()
	ds, err := ociimage.Daemons()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]ociimage.Daemon{}
	for _, d := range ds {
		out[d.Name] = d
	}
	version, err := ociimage.ReadVersion("..")
	if err != nil {
		t.Fatal(err)
	}
	return out, version
}

// checkImages holds every container of b to the image of its name: the
// image `make image` builds, its binary as the command, its user, and only
// ports the image exposes.
func checkImages(t *testing.T, b *built, image func(ociimage.Daemon) string) {
	t.Helper()
	images, _ := imageDaemons(t)
	seen := map[string]bool{}
	for _, dep := range b.deployments {
		pod := dep.Spec.Template.Spec
		for _, c := range pod.Containers {
			d, ok := images[c.Name]
			if !ok {
				t.Errorf("Deployment %s: container %s has no image of its name (make image builds %v)", dep.Name, c.Name, slices.Sorted(maps.Keys(images)))
				continue
			}
			seen[c.Name] = true
			if want := image(d); c.Image != want {
				t.Errorf("Deployment %s: container %s runs %q, want %q", dep.Name, c.Name, c.Image, want)
			}
			if !slices.Equal(c.Command, d.Entrypoint()) {
				t.Errorf("Deployment %s: container %s command %q, want the image's binary %q", dep.Name, c.Name, c.Command, d.Entrypoint())
			}
			if got := podUser(pod.SecurityContext, c.SecurityContext); got != ociimage.User {
				t.Errorf("Deployment %s: container %s runs as %s, the image as %s", dep.Name, c.Name, got, ociimage.User)
			}
			for _, p := range c.Ports {
				if port := fmt.Sprintf("%d/%s", p.ContainerPort, strings.ToLower(string(p.Protocol))); !slices.Contains(d.Ports, port) {
					t.Errorf("Deployment %s: container %s port %s is not one the image exposes (%q)", dep.Name, c.Name, port, d.Ports)
				}
			}
		}
	}
	for n := range images {
		if !seen[n] {
			t.Errorf("no container runs the %s image", n)
		}
	}
}

// podUser is the uid:gid a container runs as, its own securityContext over
// the pod's.
func podUser(pod *corev1.PodSecurityContext, c *corev1.SecurityContext) string {
	var uid, gid *int64
	if pod != nil {
		uid, gid = pod.RunAsUser, pod.RunAsGroup
	}
	if c != nil && c.RunAsUser != nil {
		uid = c.RunAsUser
	}
	if c != nil && c.RunAsGroup != nil {
		gid = c.RunAsGroup
	}
	if uid == nil || gid == nil {
		return "unset"
	}
	return strconv.FormatInt(*uid, 10) + ":" + strconv.FormatInt(*gid, 10)
}

// TestManifestImages checks that the base and every overlay run the images
// `make image` builds, by name and by the VERSION tag, and that an overlay
// can pin a digest over the base's tag.
func TestManifestImages(t *testing.T) {
	_, version := imageDaemons(t)
	tagged := func(d ociimage.Daemon) string { return d.Ref(version) }
	t.Run("base", func(t *testing.T) {
		b, err := kustomizeBuild(filepath.Join(k8sDir, "base"))
		if err != nil {
			t.Fatal(err)
		}
		checkImages(t, b, tagged)
	})
	for _, dir := range overlayDirs(t) {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			checkImages(t, buildOverlay(t, dir), tagged)
		})
	}
	t.Run("pinned by digest", func(t *testing.T) {
		base, err := filepath.Abs(filepath.Join(k8sDir, "base"))
		if err != nil {
			t.Fatal(err)
		}
		const digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
		dir := t.TempDir()
		// A relative path, as overlays name the base (kustomize refuses an
		// absolute one).
		rel, err := filepath.Rel(dir, base)
		if err != nil {
			t.Fatal(err)
		}
		kust := "resources:\n  - " + rel + "\nimages:\n" +
			"  - name: " + ociimage.Registry + "/limiterd\n    digest: " + digest + "\n" +
			"  - name: " + ociimage.Registry + "/reconciler\n    newName: registry.example.com/mirror/reconciler\n    digest: " + digest + "\n"
		if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(kust), 0o644); err != nil {
			t.Fatal(err)
		}
		b, err := kustomizeBuild(dir)
		if err != nil {
			t.Fatal(err)
		}
		checkImages(t, b, func(d ociimage.Daemon) string {
			if d.Name == "reconciler" {
				return "registry.example.com/mirror/reconciler@" + digest
			}
			return d.Repository() + "@" + digest
		})
	})
}

// TestTerraformImages checks that the region module's image variables
// default to what `make image` builds, and that its images output names
// the same images as the manifests.
func TestTerraformImages(t *testing.T) {
	images, version := imageDaemons(t)
	dir := filepath.Join("terraform", "modules", "region")
	defaults := map[string]cty.Value{}
	var output hcl.Expression
	files, err := filepath.Glob(filepath.Join(dir, "*.tf"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		file, diags := hclsyntax.ParseConfig(src, f, hcl.InitialPos)
		if diags.HasErrors() {
			t.Fatal(diags)
		}
		for _, b := range file.Body.(*hclsyntax.Body).Blocks {
			switch {
			case b.Type == "variable" && strings.HasPrefix(b.Labels[0], "image_"):
				a := b.Body.Attributes["default"]
				if a == nil {
					t.Errorf("variable %s has no default", b.Labels[0])
					continue
				}
				v, diags := a.Expr.Value(nil)
				if diags.HasErrors() {
					t.Fatalf("variable %s default: %v", b.Labels[0], diags)
				}
				defaults[b.Labels[0]] = v
			case b.Type == "output" && b.Labels[0] == "images":
				output = b.Body.Attributes["value"].Expr
			}
		}
	}
	for name, want := range map[string]string{"image_registry": ociimage.Registry, "image_version": version} {
		if v, ok := defaults[name]; !ok || v.Type() != cty.String || v.AsString() != want {
			t.Errorf("variable %s defaults to %#v, want %q (make image)", name, v, want)
		}
	}
	if output == nil {
		t.Fatalf("%s has no output images", dir)
	}
	got, diags := output.Value(&hcl.EvalContext{Variables: map[string]cty.Value{"var": cty.ObjectVal(defaults)}})
	if diags.HasErrors() {
		t.Fatalf("output images: %v", diags)
	}
	if !got.Type().IsObjectType() || got.LengthInt() != len(images) {
		t.Fatalf("output images = %#v, want one per image (%d)", got, len(images))
	}
	for name, d := range images {
		if !got.Type().HasAttribute(name) {
			t.Errorf("output images has no %s", name)
			continue
		}
		if v := got.GetAttr(name); v.AsString() != d.Ref(version) {
			t.Errorf("output images.%s = %q, want %q", name, v.AsString(), d.Ref(version))
		}
	}
}
