package admin

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/rulesource"
)

// testSource is a rules source of a file holding yaml (at most 2 rules),
// with a file of fuzzToken beside it: the source, the token file and a
// logger that discards.
func testSource(t testing.TB, yaml string) (*rulesource.Source, string, *slog.Logger) {
	t.Helper()
	dir := t.TempDir()
	file := filepath.Join(dir, "rules.yml")
	if err := os.WriteFile(file, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	tok := filepath.Join(dir, "token")
	if err := os.WriteFile(tok, []byte(fuzzToken), 0o600); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	src, err := rulesource.New(rulesource.Options{File: file, MaxRules: 2, Logger: log}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return src, tok, log
}
