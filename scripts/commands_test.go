package scripts

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestCommandsHelp: every command of cmd/ prints its usage to stdout and
// exits 0 when asked for it with -h or --help, and exits 2 with the error on
// stderr for a flag it does not know.
func TestCommandsHelp(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		if ci, _ := strconv.ParseBool(os.Getenv("CI")); ci {
			t.Fatalf("go not on PATH and CI=true: %v", err)
		}
		t.Skipf("go not on PATH: %v", err)
	}
	mains, err := filepath.Glob("../cmd/*/main.go")
	if err != nil || len(mains) == 0 {
		t.Fatalf("no commands under cmd/: %v", err)
	}
	bin := t.TempDir()
	build := exec.Command(goBin, "build", "-o", bin+string(filepath.Separator), "./cmd/...")
	build.Dir = ".."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/...: %v\n%s", err, out)
	}
	tests := []struct {
		name string
		args []string
		code int
		help bool // the usage on stdout, nothing on stderr; else the error on stderr, nothing on stdout
	}{
		{name: "-h", args: []string{"-h"}, code: 0, help: true},
		{name: "--help", args: []string{"--help"}, code: 0, help: true},
		{name: "-help", args: []string{"-help"}, code: 0, help: true},
		{name: "unknown flag", args: []string{"--no-such-flag"}, code: 2, help: false},
	}
	for _, main := range mains {
		cmdName := filepath.Base(filepath.Dir(main))
		for _, tt := range tests {
			t.Run(cmdName+"/"+tt.name, func(t *testing.T) {
				cmd := exec.Command(filepath.Join(bin, cmdName), tt.args...)
				var stdout, stderr bytes.Buffer
				cmd.Stdout, cmd.Stderr = &stdout, &stderr
				err := cmd.Run()
				code := 0
				if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
					code = ee.ExitCode()
				} else if err != nil {
					t.Fatal(err)
				}
				if code != tt.code {
					t.Fatalf("%s %s: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", cmdName, strings.Join(tt.args, " "), code, tt.code, &stdout, &stderr)
				}
				usage, other, usageName, otherName := &stdout, &stderr, "stdout", "stderr"
				if !tt.help {
					usage, other, usageName, otherName = &stderr, &stdout, "stderr", "stdout"
				}
				if !strings.Contains(usage.String(), "Usage of "+cmdName) {
					t.Errorf("%s %s: no usage on %s:\n%s", cmdName, strings.Join(tt.args, " "), usageName, usage)
				}
				if other.Len() > 0 {
					t.Errorf("%s %s: unexpected output on %s:\n%s", cmdName, strings.Join(tt.args, " "), otherName, other)
				}
			})
		}
	}
}
