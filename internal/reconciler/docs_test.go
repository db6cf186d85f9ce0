package reconciler

import (
	"flag"
	"os"
	"strings"
	"testing"

	"github.com/limiterd/limiterd/internal/logging"
)

// TestDocsListEveryFlag keeps the flag tables of docs/operations.md true.
func TestDocsListEveryFlag(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	fs := flag.NewFlagSet("reconciler", flag.ContinueOnError)
	var o Options
	o.RegisterFlags(fs)
	var l logging.Options
	l.RegisterFlags(fs)
	fs.VisitAll(func(f *flag.Flag) {
		if !strings.Contains(string(readme), "--"+f.Name) {
			t.Errorf("docs/operations.md does not document --%s", f.Name)
		}
	})
}
