package reconciler

import (
	"flag"
	"os"
	"strings"
	"testing"

	"github.com/limiterd/limiterd/internal/logging"
)

// TestREADMEListsEveryFlag keeps the README's flag tables true.
func TestREADMEListsEveryFlag(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../../README.md")
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
			t.Errorf("README.md does not document --%s", f.Name)
		}
	})
}
