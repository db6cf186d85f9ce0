package redistest_test

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/limiterd/limiterd/internal/testenv/redistest"
)

// recordingTB records Skipf and Fatalf and ends the goroutine, as the real
// ones do; everything else goes to the real test.
type recordingTB struct {
	testing.TB
	skipped, failed string
}

func (r *recordingTB) Helper() {}

func (r *recordingTB) Skipf(format string, args ...any) {
	r.skipped = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func (r *recordingTB) Fatalf(format string, args ...any) {
	r.failed = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func TestMissingBinary(t *testing.T) {
	helpers := map[string]func(testing.TB){
		"NewNode":    func(tb testing.TB) { redistest.NewNode(tb) },
		"NewCluster": func(tb testing.TB) { redistest.NewCluster(tb, 3, 0) },
	}
	tests := []struct {
		name     string
		ci       string
		wantSkip bool
	}{
		{name: "local", ci: "", wantSkip: true},
		{name: "ci", ci: "true", wantSkip: false},
	}
	for _, tc := range tests {
		for helper, start := range helpers {
			t.Run(tc.name+"/"+helper, func(t *testing.T) {
				t.Setenv("PATH", t.TempDir())
				t.Setenv("CI", tc.ci)
				rec := &recordingTB{TB: t}
				done := make(chan struct{})
				go func() {
					defer close(done)
					start(rec)
				}()
				<-done

				msg := rec.failed
				if tc.wantSkip {
					msg = rec.skipped
					if rec.failed != "" {
						t.Fatalf("failed, want a skip: %s", rec.failed)
					}
				} else if rec.skipped != "" {
					t.Fatalf("skipped, want a failure: %s", rec.skipped)
				}
				if msg == "" {
					t.Fatal("neither skipped nor failed")
				}
				for _, want := range []string{"redis-server", "apt-get install -y redis-server redis-tools", "make deps"} {
					if !strings.Contains(msg, want) {
						t.Errorf("message %q does not mention %q", msg, want)
					}
				}
			})
		}
	}
}
