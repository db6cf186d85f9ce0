package limiterd

import (
	"flag"
	"testing"

	"github.com/limiterd/limiterd/internal/logging"
	"github.com/limiterd/limiterd/internal/testenv"
)

// TestDocsListEveryFlag keeps the flag tables of docs/operations.md true: every flag
// limiterd defines is documented there.
func TestDocsListEveryFlag(t *testing.T) {
	fs := flag.NewFlagSet("limiterd", flag.ContinueOnError)
	var o Options
	o.RegisterFlags(fs)
	var l logging.Options
	l.RegisterFlags(fs)
	testenv.DocumentsFlags(t, "../../docs/operations.md", fs)
}
