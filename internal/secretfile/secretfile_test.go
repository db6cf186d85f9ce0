package secretfile

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func write(t *testing.T, content string, mode os.FileMode) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(p, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil { // umask
		t.Fatal(err)
	}
	return p
}

func TestRead(t *testing.T) {
	const good = "0123456789abcdef"
	cases := []struct {
		name    string
		content string
		mode    os.FileMode
		want    string // "" = accepted
		warns   bool
	}{
		{"owner only", good + "\n", 0o600, "", false},
		{"read only", good, 0o400, "", false},
		{"group may read", good, 0o640, "", true},
		{"world may read", good, 0o644, "open to other users", false},
		{"world may write", good, 0o602, "open to other users", false},
		{"group may write", good, 0o660, "open to other users", false},
		{"too short", "short", 0o600, "at least 16 characters, it has 5", false},
		{"blanks only", "   \n", 0o600, "at least 16 characters, it has 0", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var logs bytes.Buffer
			log := slog.New(slog.NewTextHandler(&logs, nil))
			got, err := Read("--x.secret-file", write(t, c.content, c.mode), 16, log)
			if c.want == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				if string(got) != good {
					t.Fatalf("read %q, want %q", got, good)
				}
			} else {
				if err == nil || !strings.Contains(err.Error(), c.want) || !strings.HasPrefix(err.Error(), "--x.secret-file: ") {
					t.Fatalf("err = %v, want one naming the flag and %q", err, c.want)
				}
			}
			if warned := strings.Contains(logs.String(), "readable by its group"); warned != c.warns {
				t.Fatalf("warned = %v, want %v (log %q)", warned, c.warns, logs.String())
			}
		})
	}
}

func TestMissingAndNotRegular(t *testing.T) {
	if _, err := Read("--f", filepath.Join(t.TempDir(), "none"), 1, nil); err == nil || !strings.HasPrefix(err.Error(), "--f: ") {
		t.Fatalf("missing file: %v", err)
	}
	if err := Check("--f", t.TempDir(), nil); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("directory: %v", err)
	}
}
