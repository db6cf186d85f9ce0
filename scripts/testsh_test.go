package scripts

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestAloneTestsExist holds test.sh's limiterd_alone and reconciler_alone
// to the tests of internal/limiterd and internal/reconciler: a test
// renamed or removed there would otherwise leave phase 2 by the -run
// pattern and its new name run in phase 1, under another package's load,
// without a word.
func TestAloneTestsExist(t *testing.T) {
	sh, err := os.ReadFile("test.sh")
	if err != nil {
		t.Fatal(err)
	}
	for list, pkg := range map[string]string{"limiterd_alone": "limiterd", "reconciler_alone": "reconciler"} {
		m := regexp.MustCompile(`(?s)\n` + list + `=\((.*?)\)\n`).FindSubmatch(sh)
		if m == nil {
			t.Fatalf("test.sh has no %s=(...) list", list)
		}
		names := strings.Fields(string(m[1]))
		if len(names) == 0 {
			t.Fatalf("%s is empty", list)
		}
		files, err := filepath.Glob(filepath.Join("..", "internal", pkg, "*_test.go"))
		if err != nil || len(files) == 0 {
			t.Fatalf("internal/%s's tests: %v %v", pkg, files, err)
		}
		var src strings.Builder
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			src.Write(b)
		}
		seen := map[string]bool{}
		for _, name := range names {
			if seen[name] {
				t.Errorf("%s names %s twice", list, name)
			}
			seen[name] = true
			if !regexp.MustCompile(`\nfunc ` + regexp.QuoteMeta(name) + `\(t \*testing\.T\) \{`).MatchString(src.String()) {
				t.Errorf("%s names %s, which is not a test of internal/%s", list, name, pkg)
			}
		}
	}
}
