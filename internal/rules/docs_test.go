package rules

import (
	"os"
	"reflect"
	"strings"
	"testing"
)

// TestDocsListEveryField keeps the field tables of docs/rules.md true:
// every key a rule or its match block may have is a row there.
func TestDocsListEveryField(t *testing.T) {
	doc, err := os.ReadFile("../../docs/rules.md")
	if err != nil {
		t.Fatal(err)
	}
	check := func(typ reflect.Type, prefix string) {
		for f := range typ.Fields() {
			name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
			if name == "" || name == "-" {
				continue
			}
			if row := "\n| `" + prefix + name + "` |"; !strings.Contains(string(doc), row) {
				t.Errorf("docs/rules.md has no row for %s%s", prefix, name)
			}
		}
	}
	check(reflect.TypeFor[Rule](), "")
	check(reflect.TypeFor[Match](), "match.")
}
