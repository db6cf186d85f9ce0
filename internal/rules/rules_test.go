package rules

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
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
				var e *Error
				if !errors.As(err, &e) || e.File != f {
					t.Fatalf("Load = %v, want an *Error naming the file %s", err, f)
				}
			default:
				t.Fatalf("testdata file %s is neither .good.yml nor .bad.yml", f)
			}
		})
	}
}

// Errors name the rule and the field, so an operator can find the mistake.
func TestErrorsNameRuleAndField(t *testing.T) {
	tests := []struct {
		name  string
		file  string
		index int // -1: about the whole file
		id    string
		field string
		line  int
	}{
		{name: "zero refill", file: "zero-refill.bad.yml", index: 0, id: "a", field: "refill_per_second", line: 2},
		{name: "negative capacity", file: "negative-capacity.bad.yml", index: 0, id: "a", field: "capacity", line: 3},
		{name: "missing window", file: "missing-window.bad.yml", index: 0, id: "a", field: "window", line: 2},
		{name: "sliding log too large", file: "log-too-large.bad.yml", index: 0, id: "a", field: "limit", line: 4},
		{name: "unknown algorithm", file: "unknown-algorithm.bad.yml", index: 0, id: "a", field: "algorithm", line: 3},
		{name: "bad on_failure", file: "bad-on-failure.bad.yml", index: 0, id: "a", field: "on_failure", line: 5},
		{name: "bad match path", file: "bad-match-path.bad.yml", index: 0, id: "a", field: "match.path", line: 6},
		{name: "capacity and limit", file: "both-capacity-limit.bad.yml", index: 0, id: "a", field: "limit", line: 4},
		{name: "cost above capacity", file: "cost-above-capacity.bad.yml", index: 0, id: "a", field: "cost", line: 5},
		{name: "duplicate id", file: "duplicate-id.bad.yml", index: 1, id: "a", field: "id"},
		{name: "no rules", file: "no-rules.bad.yml", index: -1, field: "rules", line: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			file := filepath.Join("testdata", tt.file)
			_, err := Load(file)
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("Load = %v, want an *Error", err)
			}
			got := Error{File: e.File, Index: e.Index, ID: e.ID, Field: e.Field, Line: e.Line}
			want := Error{File: file, Index: tt.index, ID: tt.id, Field: tt.field, Line: tt.line}
			if tt.line == 0 {
				got.Line = 0 // not asserted
			}
			if got != want {
				t.Fatalf("Load = %v\n  at  %+v\n  want %+v", err, got, want)
			}
		})
	}
}

// A rule given alone (the admin API) names its id and field, at index -1.
func TestParseRuleErrors(t *testing.T) {
	tests := []struct {
		name  string
		rule  string
		id    string
		field string
		line  int
		cause error
	}{
		{name: "bad capacity", rule: "id: r\ncapacity: -1\nrefill_per_second: 1\n", id: "r", field: "capacity", line: 2, cause: bucket.ErrInvalidLimit},
		{name: "bad cost", rule: "id: r\ncapacity: 1\nrefill_per_second: 1\ncost: 2\n", id: "r", field: "cost", line: 4, cause: bucket.ErrInvalidCost},
		{name: "bad id", rule: "id: a b\ncapacity: 1\nrefill_per_second: 1\n", id: "a b", field: "id", line: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseRule([]byte(tt.rule), SourceAdmin)
			var e *Error
			if !errors.As(err, &e) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("ParseRule = %v, want an *Error wrapping ErrInvalid", err)
			}
			if e.File != "" || e.Index != -1 || e.ID != tt.id || e.Field != tt.field || e.Line != tt.line {
				t.Fatalf("ParseRule = %v: at %+v, want id %q, field %q, line %d, index -1, no file", err, *e, tt.id, tt.field, tt.line)
			}
			if tt.cause != nil && !errors.Is(err, tt.cause) {
				t.Fatalf("ParseRule = %v, want it to wrap %v", err, tt.cause)
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

// An error reads file, rule, line, field, cause: the README shows one.
func TestErrorMessage(t *testing.T) {
	cause := errors.New("cause")
	tests := []struct {
		name string
		err  *Error
		want string
	}{
		{name: "rule of a file", err: &Error{File: "rules.yml", Index: 3, ID: "r", Field: "window", Line: 24, Err: cause}, want: `rules.yml: invalid rules: rules[3] (id "r"), line 24: window: cause`},
		{name: "rule without id", err: &Error{File: "rules.yml", Index: 0, Field: "id", Line: 2, Err: cause}, want: `rules.yml: invalid rules: rules[0], line 2: id: cause`},
		{name: "whole file", err: &Error{File: "rules.yml", Index: -1, Field: "rules", Line: 1, Err: cause}, want: `rules.yml: invalid rules: line 1: rules: cause`},
		{name: "rule alone", err: &Error{Index: -1, ID: "r", Field: "cost", Line: 4, Err: cause}, want: `invalid rules: rule "r", line 4: cost: cause`},
		{name: "no cause", err: &Error{Index: -1, ID: "r"}, want: `invalid rules: rule "r"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.err.Error(); got != tt.want {
				t.Fatalf("Error() = %q, want %q", got, tt.want)
			}
		})
	}
}

// An unknown or empty algorithm lists the valid ones; a rule that leaves
// the algorithm out is a token bucket.
func TestAlgorithmErrorsListTheAlgorithms(t *testing.T) {
	var valid []string
	for _, a := range bucket.Algorithms {
		valid = append(valid, string(a))
	}
	tests := []struct {
		name  string
		file  string
		index int
		line  int
		got   string
	}{
		{name: "unknown", file: "unknown-algorithm.bad.yml", index: 0, line: 3, got: "leaky_bucket"},
		{name: "empty string", file: "empty-algorithm.bad.yml", index: 0, line: 3, got: ""},
		{name: "null", file: "null-algorithm.bad.yml", index: 1, line: 6, got: ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Load(filepath.Join("testdata", tt.file))
			var e *Error
			var ce *ChoiceError
			if !errors.As(err, &e) || !errors.As(err, &ce) {
				t.Fatalf("Load = %v, want an *Error caused by a *ChoiceError", err)
			}
			if e.Index != tt.index || e.Field != "algorithm" || e.Line != tt.line {
				t.Fatalf("Load = %v: rules[%d] field %q line %d, want rules[%d] field algorithm line %d", err, e.Index, e.Field, e.Line, tt.index, tt.line)
			}
			if ce.Got != tt.got || !slices.Equal(ce.Valid, valid) {
				t.Fatalf("Load = %v: got %q, valid %q; want got %q, valid %q", err, ce.Got, ce.Valid, tt.got, valid)
			}
		})
	}
}
