package rules

import (
	"errors"
	"fmt"
	"math"
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
		{name: "max_wait on a window", file: "max-wait-window.bad.yml", index: 0, id: "a", field: "max_wait", line: 6},
		{name: "max_wait too long", file: "max-wait-too-long.bad.yml", index: 0, id: "a", field: "max_wait", line: 6},
		{name: "settle_within too long", file: "settle-within-too-long.bad.yml", index: 0, id: "a", field: "settle_within", line: 6},
		{name: "negative capacity", file: "negative-capacity.bad.yml", index: 0, id: "a", field: "capacity", line: 3},
		{name: "missing window", file: "missing-window.bad.yml", index: 0, id: "a", field: "window", line: 2},
		{name: "sliding log too large", file: "log-too-large.bad.yml", index: 0, id: "a", field: "limit", line: 4},
		{name: "unknown algorithm", file: "unknown-algorithm.bad.yml", index: 0, id: "a", field: "algorithm", line: 3},
		{name: "bad on_failure", file: "bad-on-failure.bad.yml", index: 0, id: "a", field: "on_failure", line: 5},
		{name: "bad match path", file: "bad-match-path.bad.yml", index: 0, id: "a", field: "match.path", line: 6},
		{name: "capacity and limit", file: "both-capacity-limit.bad.yml", index: 0, id: "a", field: "limit", line: 4},
		{name: "cost above capacity", file: "cost-above-capacity.bad.yml", index: 0, id: "a", field: "cost", line: 5},
		{name: "duplicate id", file: "duplicate-id.bad.yml", index: 1, id: "a", field: "id", line: 5},
		{name: "no rules", file: "no-rules.bad.yml", index: -1, field: "rules", line: 1},
		{name: "unknown field", file: "unknown-field.bad.yml", index: 0, id: "a", field: "burst", line: 5},
		{name: "unknown match field", file: "match-unknown-field.bad.yml", index: 0, id: "a", field: "match.host", line: 7},
		{name: "unknown top-level key", file: "unknown-top.bad.yml", index: -1, field: "rule", line: 1},
		{name: "wrong type", file: "wrong-type.bad.yml", index: 0, id: "a", field: "capacity", line: 3},
		{name: "bad window", file: "bad-window.bad.yml", index: 0, id: "a", field: "window", line: 5},
		{name: "concurrency limit 0", file: "concurrency-zero-limit.bad.yml", index: 0, id: "a", field: "limit", line: 4},
		{name: "concurrency limit not whole", file: "concurrency-fractional-limit.bad.yml", index: 0, id: "a", field: "limit", line: 4},
		{name: "concurrency limit too large", file: "concurrency-limit-too-large.bad.yml", index: 0, id: "a", field: "limit", line: 4},
		{name: "concurrency lease too short", file: "concurrency-lease-short.bad.yml", index: 0, id: "a", field: "lease_ttl", line: 5},
		{name: "concurrency lease too long", file: "concurrency-lease-long.bad.yml", index: 0, id: "a", field: "lease_ttl", line: 5},
		{name: "concurrency with a token lease", file: "concurrency-token-lease.bad.yml", index: 0, id: "a", field: "lease", line: 5},
		{name: "concurrency window", file: "concurrency-window.bad.yml", index: 0, id: "a", field: "window", line: 5},
		{name: "adaptive min 0", file: "concurrency-adaptive-min-zero.bad.yml", index: 0, id: "a", field: "adaptive.min", line: 7},
		{name: "adaptive max under min", file: "concurrency-adaptive-max-under-min.bad.yml", index: 0, id: "a", field: "adaptive.max", line: 8},
		{name: "adaptive max too large", file: "concurrency-adaptive-max-too-large.bad.yml", index: 0, id: "a", field: "adaptive.max", line: 8},
		{name: "adaptive target 0", file: "concurrency-adaptive-target-zero.bad.yml", index: 0, id: "a", field: "adaptive.target_latency", line: 9},
		{name: "adaptive target over lease_ttl", file: "concurrency-adaptive-target-long.bad.yml", index: 0, id: "a", field: "adaptive.target_latency", line: 9},
		{name: "adaptive limit outside its range", file: "concurrency-adaptive-limit-outside.bad.yml", index: 0, id: "a", field: "limit", line: 4},
		{name: "adaptive empty", file: "concurrency-adaptive-empty.bad.yml", index: 0, id: "a", field: "adaptive.max", line: 5},
		{name: "adaptive on a token bucket", file: "adaptive-token-bucket.bad.yml", index: 0, id: "a", field: "adaptive", line: 5},
		{name: "lease_ttl on a token bucket", file: "lease-ttl-on-bucket.bad.yml", index: 0, id: "a", field: "lease_ttl", line: 5},
		{name: "max_overshoot 0", file: "max-overshoot-zero.bad.yml", index: 0, id: "a", field: "max_overshoot", line: 5},
		{name: "max_overshoot above 1", file: "max-overshoot-above-one.bad.yml", index: 0, id: "a", field: "max_overshoot", line: 5},
		{name: "max_overshoot NaN", file: "max-overshoot-nan.bad.yml", index: 0, id: "a", field: "max_overshoot", line: 5},
		{name: "max_overshoot infinite", file: "max-overshoot-inf.bad.yml", index: 0, id: "a", field: "max_overshoot", line: 5},
		{name: "reserve on a window", file: "reserve-window.bad.yml", index: 0, id: "a", field: "reserve", line: 6},
		{name: "reserve adding up to 1", file: "reserve-sum.bad.yml", index: 0, id: "a", field: "reserve", line: 5},
		{name: "reserve negative", file: "reserve-negative.bad.yml", index: 0, id: "a", field: "reserve.default", line: 7},
		{name: "reserve of a bad class name", file: "reserve-bad-class.bad.yml", index: 0, id: "a", field: "reserve", line: 5},
		{name: "reserve with a lease", file: "reserve-lease.bad.yml", index: 0, id: "a", field: "reserve", line: 6},
		{name: "reserve on a pinned rule", file: "reserve-pinned.bad.yml", index: 0, id: "a", field: "reserve", line: 6},
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
		{name: "bad max_overshoot", rule: "id: r\ncapacity: 1\nrefill_per_second: 1\nmax_overshoot: -0.1\n", id: "r", field: "max_overshoot", line: 4},
		{name: "reserve of 1", rule: "id: r\ncapacity: 1\nrefill_per_second: 1\nreserve: {critical: 1}\n", id: "r", field: "reserve.critical", line: 4},
		{name: "reserve NaN", rule: "id: r\ncapacity: 1\nrefill_per_second: 1\nreserve: {critical: .nan}\n", id: "r", field: "reserve.critical", line: 4},
		{name: "reserve on a window", rule: "id: r\nalgorithm: sliding_window\nlimit: 1\nwindow: 1s\nreserve: {critical: 0.1}\n", id: "r", field: "reserve", line: 5},
		{name: "reserve of 1 on concurrency", rule: "id: r\nalgorithm: concurrency\nlimit: 10\nreserve: {critical: 1}\n", id: "r", field: "reserve.critical", line: 4},
		{name: "reserve adding to 1 on concurrency", rule: "id: r\nalgorithm: concurrency\nlimit: 10\nreserve: {critical: 0.5, default: 0.5}\n", id: "r", field: "reserve", line: 4},
		{name: "reserve on pinned concurrency", rule: "id: r\nalgorithm: concurrency\nlimit: 10\nhome: pinned\nreserve: {critical: 0.1}\n", id: "r", field: "reserve", line: 5},
		{name: "reserve empty", rule: "id: r\ncapacity: 1\nrefill_per_second: 1\nreserve: {}\n", id: "r", field: "reserve", line: 4},
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
			if r.Concurrent() {
				if err := r.Leases().Validate(); err != nil {
					t.Fatalf("rule %q accepted with an invalid concurrency limit: %v", r.ID, err)
				}
				continue
			}
			if err := r.Bucket().Validate(); err != nil {
				t.Fatalf("rule %q accepted with an invalid limit: %v", r.ID, err)
			}
		}
	})
}

// An error reads file, rule, line, field, cause: docs/rules.md shows one.
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
	for _, a := range append(bucket.Algorithms, bucket.Concurrency) {
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

// An unknown key names the field it is likely a typo of.
func TestUnknownFieldSuggestsTheNearest(t *testing.T) {
	ruleFields := []string{"id", "algorithm", "capacity", "limit", "refill_per_second", "window", "on_failure",
		"reconcile", "home", "match", "key_by", "cost", "shadow", "lease", "lease_ttl", "home_keys", "max_wait", "settle_within", "max_overshoot", "overrides", "allow_request_limit", "request_limit_max", "reserve", "adaptive"}
	matchFields := []string{"path", "methods", "plans", "domain", "attributes"}
	tests := []struct {
		name       string
		file       string
		index      int
		field      string
		suggestion string
		known      []string
	}{
		{name: "typo", file: "typo-refill.bad.yml", index: 0, field: "refil_per_second", suggestion: "refill_per_second", known: ruleFields},
		{name: "typo in match", file: "typo-match.bad.yml", index: 1, field: "match.methds", suggestion: "methods", known: matchFields},
		{name: "another limiter's name", file: "unknown-field.bad.yml", index: 0, field: "burst", suggestion: "capacity", known: ruleFields},
		{name: "top level", file: "unknown-top.bad.yml", index: -1, field: "rule", suggestion: "rules", known: []string{"rules"}},
		{name: "nothing near", file: "match-unknown-field.bad.yml", index: 0, field: "match.host", suggestion: "", known: matchFields},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Load(filepath.Join("testdata", tt.file))
			var e *Error
			var ue *UnknownFieldError
			if !errors.As(err, &e) || !errors.As(err, &ue) {
				t.Fatalf("Load = %v, want an *Error caused by an *UnknownFieldError", err)
			}
			if e.Index != tt.index || e.Field != tt.field {
				t.Fatalf("Load = %v: rules[%d] field %q, want rules[%d] field %q", err, e.Index, e.Field, tt.index, tt.field)
			}
			if ue.Suggestion != tt.suggestion || !slices.Equal(ue.Known, tt.known) {
				t.Fatalf("Load = %v: suggestion %q, known %q; want %q, %q", err, ue.Suggestion, ue.Known, tt.suggestion, tt.known)
			}
		})
	}
}

// The admin API's rules get the same suggestions.
func TestParseRuleSuggests(t *testing.T) {
	tests := []struct {
		name, key, suggestion string
	}{
		{name: "missing letter", key: "capacty", suggestion: "capacity"},
		{name: "dashes", key: "refill-per-second", suggestion: "refill_per_second"},
		{name: "capitals", key: "Window", suggestion: "window"},
		{name: "prefix", key: "refill", suggestion: "refill_per_second"},
		{name: "plural", key: "home_key", suggestion: "home_keys"},
		{name: "synonym", key: "rate", suggestion: "refill_per_second"},
		{name: "unrelated", key: "colour", suggestion: ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseRule([]byte("id: r\ncapacity: 1\nrefill_per_second: 1\n"+tt.key+": 1\n"), SourceAdmin)
			var e *Error
			var ue *UnknownFieldError
			if !errors.As(err, &e) || !errors.As(err, &ue) {
				t.Fatalf("ParseRule = %v, want an *Error caused by an *UnknownFieldError", err)
			}
			if e.ID != "r" || e.Field != tt.key || e.Line != 4 || ue.Key != tt.key || ue.Suggestion != tt.suggestion {
				t.Fatalf("ParseRule = %v: id %q field %q line %d suggestion %q; want id r, field %q, line 4, suggestion %q",
					err, e.ID, e.Field, e.Line, ue.Suggestion, tt.key, tt.suggestion)
			}
		})
	}
}

// Aliases can make a YAML graph with a loop; an error, never a hang or a
// stack overflow.
func TestAliasLoops(t *testing.T) {
	tests := []struct{ name, yaml string }{
		{name: "rule merges itself", yaml: "rules:\n  - &a\n    id: a\n    <<: *a\n"},
		{name: "match merges itself", yaml: "rules:\n  - id: a\n    capacity: 1\n    refill_per_second: 1\n    match: &m\n      <<: *m\n"},
		{name: "list holds itself", yaml: "rules: &r [*r]\n"},
		{name: "attributes hold their match", yaml: "rules:\n  - id: a\n    capacity: 1\n    refill_per_second: 1\n    match: &m\n      attributes: *m\n"},
		{name: "home keys hold themselves", yaml: "rules:\n  - id: a\n    capacity: 1\n    refill_per_second: 1\n    home: pinned\n    home_keys: &h {k: *h}\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := Parse("loop.yml", []byte(tt.yaml)); !errors.Is(err, ErrInvalid) {
				t.Fatalf("Parse = %v, want an error wrapping ErrInvalid", err)
			}
			rule := strings.TrimPrefix(strings.ReplaceAll(tt.yaml, "\n    ", "\n"), "rules:\n  - ")
			if _, err := ParseRule([]byte(rule), SourceAdmin); !errors.Is(err, ErrInvalid) {
				t.Fatalf("ParseRule(%q) = %v, want an error wrapping ErrInvalid", rule, err)
			}
		})
	}
}

// Merges of merges name the first rule 2^n times; checking them is linear.
func TestMergeBomb(t *testing.T) {
	var b strings.Builder
	b.WriteString("rules:\n  - &x0 {id: r0, capacity: 1, refill_per_second: 1}\n")
	for i := 1; i <= 40; i++ {
		fmt.Fprintf(&b, "  - &x%d {<<: [*x%d, *x%d], id: r%d}\n", i, i-1, i-1, i)
	}
	done := make(chan error, 1)
	go func() {
		_, err := Parse("bomb.yml", []byte(b.String()))
		done <- err
	}()
	select {
	case <-done: //nolint:errcheck // valid or refused for its aliases: either way, decided
	case <-time.After(10 * time.Second):
		t.Fatal("Parse still checking after 10s")
	}
}

// A duplicate id names both rules, with their lines in the file.
func TestDuplicateIDNamesBothPlaces(t *testing.T) {
	tests := []struct {
		name          string
		file          string
		first, second Place
	}{
		{name: "next to each other", file: "duplicate-id.bad.yml", first: Place{Index: 0, Line: 2, Source: SourceFile}, second: Place{Index: 1, Line: 5, Source: SourceFile}},
		{name: "apart, id last", file: "duplicate-id-apart.bad.yml", first: Place{Index: 0, Line: 2, Source: SourceFile}, second: Place{Index: 2, Line: 10, Source: SourceFile}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			file := filepath.Join("testdata", tt.file)
			_, err := Load(file)
			var e *Error
			var de *DuplicateIDError
			if !errors.As(err, &e) || !errors.As(err, &de) {
				t.Fatalf("Load = %v, want an *Error caused by a *DuplicateIDError", err)
			}
			if e.File != file || e.Index != tt.second.Index || e.Field != "id" || e.Line != tt.second.Line {
				t.Fatalf("Load = %v: at %s rules[%d] field %q line %d, want the second rule's id", err, e.File, e.Index, e.Field, e.Line)
			}
			if de.ID != "a" || de.First != tt.first || de.Second != tt.second {
				t.Fatalf("Load = %v: %+v, want id a at %+v and %+v", err, *de, tt.first, tt.second)
			}
		})
	}
}

// Build, which joins the file's rules and the admin API's, names both
// rules' places and sources.
func TestBuildDuplicateID(t *testing.T) {
	rule := []byte("id: a\ncapacity: 1\nrefill_per_second: 1\n")
	var list []*Rule
	for _, src := range []string{SourceFile, SourceFile, SourceAdmin} {
		r, err := ParseRule(rule, src)
		if err != nil {
			t.Fatal(err)
		}
		list = append(list, r)
	}
	list[1].ID = "b"
	_, err := Build(list)
	var e *Error
	var de *DuplicateIDError
	if !errors.As(err, &e) || !errors.As(err, &de) {
		t.Fatalf("Build = %v, want an *Error caused by a *DuplicateIDError", err)
	}
	want := DuplicateIDError{ID: "a", First: Place{Index: 0, Source: SourceFile}, Second: Place{Index: 2, Source: SourceAdmin}}
	if e.Index != 2 || e.Field != "id" || de.ID != want.ID || de.First != want.First || de.Second != want.Second {
		t.Fatalf("Build = %v: rules[%d] %q, %+v; want rules[2] id, %+v", err, e.Index, e.Field, *de, want)
	}
}

// A concurrency rule reads its limit and lease length, defaults lease_ttl,
// and is never reconciled.
func TestConcurrencyRules(t *testing.T) {
	s, err := Load("testdata/concurrency.good.yml")
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		id   string
		want bucket.LeaseLimit
	}{
		{"reports", bucket.LeaseLimit{Limit: 10, TTL: 30 * time.Second}},
		{"search", bucket.LeaseLimit{Limit: 1, TTL: DefaultLeaseTTL}},
		{"llm", bucket.LeaseLimit{Limit: bucket.MaxConcurrency, TTL: time.Hour}},
	} {
		r := s.Get(tt.id)
		if !r.Concurrent() || r.Leases() != tt.want || r.Reconciled() || r.Cost != 1 {
			t.Errorf("rule %s: concurrent %v, leases %+v, reconciled %v, cost %v; want leases %+v", tt.id, r.Concurrent(), r.Leases(), r.Reconciled(), r.Cost, tt.want)
		}
	}
}

// TestCheckID: an id is letters, digits, '_', '-' and '.', with a dot only
// between two others (so it is also a key of the admin rules bucket), at
// most MaxIDLen long; a refusal names the id and the field.
func TestCheckID(t *testing.T) {
	for _, tt := range []struct {
		name, id string
		ok       bool
	}{
		{"plain", "api", true},
		{"dotted", "api.v1.read", true},
		{"dash and underscore", "a-b_c", true},
		{"longest", strings.Repeat("a", MaxIDLen), true},
		{"empty", "", false},
		{"trailing dot", "api.", false},
		{"leading dot", ".api", false},
		{"two dots", "a..b", false},
		{"space", "api ", false},
		{"leading dash", "-api", false},
		{"too long", strings.Repeat("a", MaxIDLen+1), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := CheckID(tt.id)
			if (err == nil) != tt.ok {
				t.Fatalf("CheckID(%q) = %v, want ok %v", tt.id, err, tt.ok)
			}
			var e *Error
			if err != nil && (!errors.Is(err, ErrInvalid) || !errors.As(err, &e) || e.ID != tt.id || e.Field != "id") {
				t.Fatalf("CheckID(%q) = %v, want an *Error naming the id and the field id", tt.id, err)
			}
		})
	}
}

// max_overshoot defaults to a tenth of the capacity and is a budget in
// tokens of the rule's capacity; a rule that does not state it marshals as
// before (its set's version unchanged).
func TestMaxOvershoot(t *testing.T) {
	s, err := Load("testdata/max-overshoot.good.yml")
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		id               string
		overshoot, spend float64
	}{{"tight", 0.05, 5}, {"whole", 1, 10}, {"default", DefaultMaxOvershoot, 1}} {
		r := s.Get(tt.id)
		if got := r.Overshoot(); got != tt.overshoot {
			t.Errorf("%s: Overshoot() = %v, want %v", tt.id, got, tt.overshoot)
		}
		if got := r.SpendBudget(); math.Abs(got-tt.spend) > 1e-9 {
			t.Errorf("%s: SpendBudget() = %v, want %v", tt.id, got, tt.spend)
		}
	}
	if y := string(s.Get("default").YAML()); strings.Contains(y, "max_overshoot") {
		t.Errorf("a rule without max_overshoot marshals it:\n%s", y)
	}
	if y := string(s.Get("tight").YAML()); !strings.Contains(y, "max_overshoot: 0.05") {
		t.Errorf("a rule with max_overshoot 0.05 marshals as:\n%s", y)
	}
}
