package main

import (
	"bytes"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/limiterd/limiterd/internal/frontdoor/forwardauth"
)

const apiFile = "../../../docs/api.md"

// TestAPIDocCurrent fails when docs/api.md is not what `make docs` writes
// from proto/ and the hand-written sections.
func TestAPIDocCurrent(t *testing.T) {
	want, err := render("../../../proto")
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(apiFile)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("docs/api.md is not current: run make docs")
	}
}

// TestAPIDocEveryRPC: every RPC of the generated code has its section.
func TestAPIDocEveryRPC(t *testing.T) {
	text, err := render("../../../proto")
	if err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob("../../../proto/*/v1/*_grpc.pb.go")
	if err != nil || len(files) == 0 {
		t.Fatalf("no generated gRPC code: %v", err)
	}
	rpc := regexp.MustCompile(`FullMethodName\s*=\s*"/([\w.]+)\.(\w+)/(\w+)"`)
	n := 0
	for _, f := range files {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range rpc.FindAllStringSubmatch(string(src), -1) {
			n++
			if h := "#### `" + m[2] + "/" + m[3] + "`"; !bytes.Contains(text, []byte(h)) {
				t.Errorf("%s.%s/%s: no %q in docs/api.md", m[1], m[2], m[3], h)
			}
		}
	}
	if n < 10 {
		t.Errorf("found %d RPCs in the generated code, want the dozen or so of proto/", n)
	}
}

// TestHTTPEndpointsDocumented holds the HTTP table to the muxes: every
// pattern limiterd and the reconciler register has a row, and every row
// is a pattern they register.
func TestHTTPEndpointsDocumented(t *testing.T) {
	registered := []string{forwardauth.Path}
	for _, dir := range []string{"../../opshttp", "../../admin", "../../limiterd", "../../reconciler"} {
		registered = append(registered, patterns(t, dir)...)
	}
	row := regexp.MustCompile("(?m)^\\| `([^`]+)` \\|")
	var documented []string
	for _, m := range row.FindAllStringSubmatch(httpSection, -1) {
		documented = append(documented, m[1])
	}
	for _, p := range registered {
		if !slices.Contains(documented, p) {
			t.Errorf("%q is served but has no row in internal/tools/apidoc/http.md", p)
		}
	}
	for _, p := range documented {
		if !slices.Contains(registered, p) {
			t.Errorf("http.md documents %q, which no mux registers", p)
		}
	}
	if len(registered) < 10 {
		t.Errorf("found %d patterns: %q", len(registered), registered)
	}
}

// patterns returns the string literals given to Handle and HandleFunc by
// the non-test files of the package in dir.
func patterns(t *testing.T, dir string) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	fset := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		af, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(af, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) != 2 {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || (sel.Sel.Name != "Handle" && sel.Sel.Name != "HandleFunc") {
				return true
			}
			if lit, ok := call.Args[0].(*ast.BasicLit); ok && lit.Kind == token.STRING {
				p, err := strconv.Unquote(lit.Value)
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Contains(found, p) {
					found = append(found, p)
				}
			}
			return true
		})
	}
	return found
}
