package scripts

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestAloneTestsExist holds test.sh's limiterd_alone to the tests of
// internal/limiterd: a test renamed or removed there would otherwise leave
// phase 2 by the -run pattern and its new name run in phase 1, under
// another package's load, without a word.
func TestAloneTestsExist(t *testing.T) {
	sh, err := os.ReadFile("test.sh")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?s)\nlimiterd_alone=\((.*?)\)\n`).FindSubmatch(sh)
	if m == nil {
		t.Fatal("test.sh has no limiterd_alone=(...) list")
	}
	names := strings.Fields(string(m[1]))
	if len(names) == 0 {
		t.Fatal("limiterd_alone is empty")
	}
	files, err := filepath.Glob(filepath.Join("..", "internal", "limiterd", "*_test.go"))
	if err != nil || len(files) == 0 {
		t.Fatalf("internal/limiterd's tests: %v %v", files, err)
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
			t.Errorf("limiterd_alone names %s twice", name)
		}
		seen[name] = true
		if !regexp.MustCompile(`\nfunc ` + regexp.QuoteMeta(name) + `\(t \*testing\.T\) \{`).MatchString(src.String()) {
			t.Errorf("limiterd_alone names %s, which is not a test of internal/limiterd", name)
		}
	}
}
