package reconciler

import (
	"flag"
	"testing"

	"github.com/limiterd/limiterd/internal/logging"
	"github.com/limiterd/limiterd/internal/testenv"
)

// TestDocsListEveryFlag keeps the flag tables of docs/operations.md true.
func TestDocsListEveryFlag(t *testing.T) {
	t.Parallel()
	fs := flag.NewFlagSet("reconciler", flag.ContinueOnError)
	var o Options
	o.RegisterFlags(fs)
	var l logging.Options
	l.RegisterFlags(fs)
	testenv.DocumentsFlags(t, "../../docs/operations.md", fs)
}
