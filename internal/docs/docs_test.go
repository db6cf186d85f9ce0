package docs

import (
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

func TestAnchor(t *testing.T) {
	for _, tt := range []struct{ heading, want string }{
		{"Multi-region", "multi-region"},
		{"Chaos soak (`make soak`)", "chaos-soak-make-soak"},
		{"HTTP: middleware, nginx, Traefik", "http-middleware-nginx-traefik"},
		{"Distance between the regions (`WAN`)", "distance-between-the-regions-wan"},
		{"`limiter.v1.Limiter`", "limiterv1limiter"},
		{"The attacks, replayed", "the-attacks-replayed"},
		{"max_wait_ms and [pacing](pacing.md)", "max_wait_ms-and-pacing"},
	} {
		if got := Anchor(tt.heading); got != tt.want {
			t.Errorf("Anchor(%q) = %q, want %q", tt.heading, got, tt.want)
		}
	}
}

func TestAnchors(t *testing.T) {
	text := "# A\n\n## Flags\n\n```sh\n# not a heading\n```\n\n### Flags\n\n## Flags ##\n"
	got := slices.Sorted(maps.Keys(Anchors(text)))
	want := []string{"a", "flags", "flags-1", "flags-2"}
	if !slices.Equal(got, want) {
		t.Errorf("Anchors = %q, want %q", got, want)
	}
}

func TestLinks(t *testing.T) {
	text := "See [a](a.md#x) and ![pic](p.svg).\n`[not](a link)`\n```\n[no](link)\n```\n[b](https://example.com)\n"
	var got []string
	for _, l := range Links(text) {
		got = append(got, l.Target)
	}
	want := []string{"a.md#x", "p.svg", "https://example.com"}
	if !slices.Equal(got, want) {
		t.Errorf("Links = %q, want %q", got, want)
	}
}

// TestLinksResolve: every relative link of the README, CONTRIBUTING.md,
// deploy/README.md and the pages of docs/ names a file that exists, and
// every #anchor a heading of its page.
func TestLinksResolve(t *testing.T) {
	pages, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	if len(pages) < 10 {
		t.Fatalf("docs/ has %d pages: %q", len(pages), pages)
	}
	pages = append(pages, "../../README.md", "../../CONTRIBUTING.md", "../../deploy/README.md")
	for _, p := range pages {
		broken, err := Broken(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range broken {
			t.Error(b)
		}
	}
}

// TestRaggedTables finds the rows of every page's tables with more or
// fewer cells than their header, and holds Ragged to a case of each.
func TestRaggedTables(t *testing.T) {
	text := "| a | b |\n|---|---|\n| 1 | 2 |\n| 1 | 2 | 3 |\n| `x|y` | 2 |\n| 1 |\n\n```\n| a |\n|---|\n| 1 | 2 |\n```\n"
	want := []string{"line 4: 3 cells, its header 2", "line 6: 1 cells, its header 2"}
	if got := Ragged(text); !slices.Equal(got, want) {
		t.Errorf("Ragged: %q, want %q", got, want)
	}
	pages, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	pages = append(pages, "../../README.md", "../../CONTRIBUTING.md", "../../deploy/README.md")
	for _, p := range pages {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range Ragged(string(b)) {
			t.Errorf("%s: %s", p, r)
		}
	}
}

// TestPackageMap holds the package map of docs/architecture.md to the
// code: every package of the module has a row, every row is a package,
// and each row's imports are the package's imports of this module, as
// `go list` reports them.
func TestPackageMap(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go on PATH")
	}
	const module = "github.com/limiterd/limiterd/"
	cmd := exec.Command(goBin, "list", "-f", "{{.ImportPath}} {{join .Imports \" \"}}", "./cmd/...", "./pkg/...", "./internal/...", "./lua", "./proto/...")
	cmd.Dir = "../.."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	want := map[string][]string{}
	for line := range strings.Lines(string(out)) {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		pkg := strings.TrimPrefix(f[0], module)
		want[pkg] = []string{}
		for _, imp := range f[1:] {
			if p, ok := strings.CutPrefix(imp, module); ok {
				want[pkg] = append(want[pkg], p)
			}
		}
	}
	doc, err := os.ReadFile("../../docs/architecture.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(doc), "\n## Package map\n")
	if !ok {
		t.Fatal("docs/architecture.md has no \"## Package map\" section")
	}
	row := regexp.MustCompile("(?m)^\\| `([^`]+)` \\| [^|]+ \\| ([^|]+) \\|$")
	got := map[string][]string{}
	for _, m := range row.FindAllStringSubmatch(section, -1) {
		imps := []string{}
		if s := strings.TrimSpace(m[2]); s != "none" {
			for i := range strings.SplitSeq(s, ",") {
				imps = append(imps, strings.Trim(strings.TrimSpace(i), "`"))
			}
		}
		got[m[1]] = imps
	}
	for pkg, imps := range want {
		doc, ok := got[pkg]
		switch {
		case !ok:
			t.Errorf("docs/architecture.md: no row for %s", pkg)
		case !slices.Equal(slices.Sorted(slices.Values(doc)), slices.Sorted(slices.Values(imps))):
			t.Errorf("docs/architecture.md: %s imports %q, go list says %q", pkg, doc, imps)
		}
	}
	for pkg := range got {
		if _, ok := want[pkg]; !ok {
			t.Errorf("docs/architecture.md: a row for %s, which is no package", pkg)
		}
	}
}
