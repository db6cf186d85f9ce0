package rules

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/limiterd/limiterd/pkg/bucket"
)

func TestTestdata(t *testing.T) {
	files, err := filepath.Glob("testdata/*.yml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			s, err := Load(f)
			switch {
			case strings.HasSuffix(f, ".good.yml"):
				if err != nil {
					t.Fatalf("Load: %v", err)
				}
				if len(s.Rules()) == 0 {
					t.Fatal("no rules loaded")
				}
			case strings.HasSuffix(f, ".bad.yml"):
				if !errors.Is(err, ErrInvalid) {
					t.Fatalf("Load = %v, want an error wrapping ErrInvalid", err)
				}
				if !strings.HasPrefix(err.Error(), f+": ") {
					t.Fatalf("error %q does not name the file", err)
				}
			default:
				t.Fatalf("testdata file %s is neither .good.yml nor .bad.yml", f)
			}
		})
	}
}

// Errors name the rule and the field, so an operator can find the mistake.
func TestErrorsNameRuleAndField(t *testing.T) {
	tests := []struct{ file, want string }{
		{"testdata/zero-refill.bad.yml", `rules[0] (id "a"): refill_per_second:`},
		{"testdata/negative-capacity.bad.yml", `rules[0] (id "a"): capacity:`},
		{"testdata/bad-window.bad.yml", `window`},
		{"testdata/missing-window.bad.yml", `rules[0] (id "a"): window:`},
		{"testdata/log-too-large.bad.yml", `rules[0] (id "a"): limit:`},
		{"testdata/unknown-algorithm.bad.yml", `rules[0] (id "a"): algorithm:`},
		{"testdata/bad-on-failure.bad.yml", `on_failure:`},
		{"testdata/unknown-field.bad.yml", `field burst not found`},
		{"testdata/duplicate-id.bad.yml", `rules[1]: id: "a" is used twice`},
	}
	for _, tt := range tests {
		t.Run(filepath.Base(tt.file), func(t *testing.T) {
			_, err := Load(tt.file)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Load = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}

func TestDefaultsAndLimits(t *testing.T) {
	s, err := Load("testdata/example.good.yml")
	if err != nil {
		t.Fatal(err)
	}
	api := s.Get("api")
	if api == nil || api.OnFailure != FailOpen {
		t.Fatalf("api = %+v, want on_failure open", api)
	}
	want := bucket.Limit{Algorithm: bucket.TokenBucket, Capacity: 100, RefillPerSecond: 10}
	if api.Bucket() != want {
		t.Fatalf("api limit = %+v, want %+v", api.Bucket(), want)
	}
	reset := s.Get("password-reset")
	if reset.OnFailure != FailClosed || reset.Bucket().Window != time.Hour || reset.Bucket().Capacity != 5 {
		t.Fatalf("password-reset = %+v", reset.Bucket())
	}
	m, err := Parse("m.yml", []byte("rules:\n  - id: m\n    capacity: 2\n    refill_per_second: 1\n"))
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Get("m").Algorithm; got != bucket.TokenBucket {
		t.Fatalf("default algorithm = %q", got)
	}
	if s.Get("nope") != nil {
		t.Fatal("Get of an unknown id returned a rule")
	}
}

func TestExampleRulesFileIsValid(t *testing.T) {
	if _, err := Load("../../examples/rules.yml"); err != nil {
		t.Fatal(err)
	}
}

// FuzzParse: any input is either a valid set whose limits validate, or an
// error wrapping ErrInvalid; never a panic.
func FuzzParse(f *testing.F) {
	files, _ := filepath.Glob("testdata/*.yml")
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := Parse("fuzz.yml", data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		for _, r := range s.Rules() {
			if err := r.Bucket().Validate(); err != nil {
				t.Fatalf("rule %q accepted with an invalid limit: %v", r.ID, err)
			}
		}
	})
}
