package rules

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Error is an error about the content of a rules file or of one rule: it
// names the file, the rule and the field, so an operator can find the
// mistake. It wraps ErrInvalid and its cause; callers get at its parts with
// errors.As. Errors are made by Parse, Load, ParseRule and Build.
type Error struct {
	// File is the rules file's name; empty for a rule given alone
	// (ParseRule) and for Build.
	File string
	// Index is the rule's place in the file's rules (or in Build's list),
	// from 0; -1 for a rule given alone and for an error about the whole
	// file.
	Index int
	// ID is the rule's id as written; empty when it has none.
	ID string
	// Field is the field at fault, dotted below the rule ("window",
	// "match.path"), or a key of the file ("rules") for an error about the
	// whole file; empty when the error is about no one field.
	Field string
	// Line is the line of the field in the file (of the rule when the
	// field is not written), from 1; 0 when unknown.
	Line int
	// Err is the cause.
	Err error
}

func (e *Error) Error() string {
	var b strings.Builder
	if e.File != "" {
		b.WriteString(e.File + ": ")
	}
	b.WriteString(ErrInvalid.Error() + ": ")
	var where string
	switch {
	case e.Index >= 0 && e.ID != "":
		where = fmt.Sprintf("rules[%d] (id %q)", e.Index, e.ID)
	case e.Index >= 0:
		where = fmt.Sprintf("rules[%d]", e.Index)
	case e.ID != "":
		where = fmt.Sprintf("rule %q", e.ID)
	}
	if e.Line > 0 {
		if where != "" {
			where += ", "
		}
		where += fmt.Sprintf("line %d", e.Line)
	}
	if where != "" {
		b.WriteString(where + ": ")
	}
	if e.Field != "" {
		b.WriteString(e.Field + ": ")
	}
	if e.Err != nil {
		b.WriteString(e.Err.Error())
	}
	return strings.TrimSuffix(b.String(), ": ")
}

// Unwrap returns ErrInvalid and the cause.
func (e *Error) Unwrap() []error {
	if e.Err == nil {
		return []error{ErrInvalid}
	}
	return []error{ErrInvalid, e.Err}
}

// fieldError is an error about field of a rule, which the caller places in
// its file and rule with at.
func fieldError(field string, err error) error {
	return &Error{Index: -1, Field: field, Err: err}
}

func fieldErrorf(field, format string, args ...any) error {
	return fieldError(field, fmt.Errorf(format, args...))
}

// at places err, an error about the rule of node n (nil when unknown), at
// index of file: the file, the rule's index and id, and the field's line.
func at(err error, file string, index int, id string, n *yaml.Node) error {
	var e *Error
	if !errors.As(err, &e) {
		e = &Error{Index: -1, Err: err}
	}
	e.File, e.Index = file, index
	if e.ID == "" {
		e.ID = id
	}
	if e.Line == 0 && n != nil {
		e.Line = fieldLine(n, e.Field)
	}
	return e
}

// resolve follows an alias to the node it names.
func resolve(n *yaml.Node) *yaml.Node {
	for n != nil && n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	return n
}

// lookup returns the key and value nodes of key in the mapping n, or nils.
func lookup(n *yaml.Node, key string) (k, v *yaml.Node) {
	n = resolve(n)
	if n == nil || n.Kind != yaml.MappingNode {
		return nil, nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			return n.Content[i], n.Content[i+1]
		}
	}
	return nil, nil
}

// fieldLine is the line of the dotted field in the mapping n, or of the
// deepest part of it that is written, or of n.
func fieldLine(n *yaml.Node, field string) int {
	line := n.Line
	if field == "" {
		return line
	}
	for name := range strings.SplitSeq(field, ".") {
		k, v := lookup(n, name)
		if k == nil {
			break
		}
		line, n = k.Line, v
	}
	return line
}

// idOf is the id written in the rule of mapping n, or "".
func idOf(n *yaml.Node) string {
	if _, v := lookup(n, "id"); v != nil && resolve(v).Kind == yaml.ScalarNode {
		return resolve(v).Value
	}
	return ""
}

// ChoiceError is the cause of an Error about a field that takes one of a
// few names (algorithm, on_failure, home) and got another, or none.
type ChoiceError struct {
	// Got is the value as written; empty when the field is written empty.
	Got string
	// Valid lists the names the field takes, in order.
	Valid []string
}

func (e *ChoiceError) Error() string {
	valid := strings.Join(e.Valid, ", ")
	if i := strings.LastIndex(valid, ", "); i >= 0 {
		valid = valid[:i] + " or " + valid[i+2:]
	}
	if e.Got == "" {
		return "empty: must be " + valid
	}
	return fmt.Sprintf("must be %s, got %q", valid, e.Got)
}

// choice checks got against valid; an empty got is left to the caller's
// default.
func choice[T ~string](field string, got T, valid ...T) error {
	if got == "" || slices.Contains(valid, got) {
		return nil
	}
	names := make([]string, len(valid))
	for i, v := range valid {
		names[i] = string(v)
	}
	return fieldError(field, &ChoiceError{Got: string(got), Valid: names})
}

// writtenEmpty reports whether the mapping n has key with an empty or null
// value: written, so meant, and not the same as leaving the key out.
func writtenEmpty(n *yaml.Node, key string) bool {
	k, v := lookup(n, key)
	if k == nil {
		return false
	}
	v = resolve(v)
	return v.Kind == yaml.ScalarNode && (v.Value == "" || v.ShortTag() == "!!null")
}

// DuplicateIDError is the cause of an Error about a rule whose id an
// earlier rule has; the Error is about the later one.
type DuplicateIDError struct {
	ID string
	// First and Second are the two rules with the id.
	First, Second Place
}

func (e *DuplicateIDError) Error() string {
	return fmt.Sprintf("%q is used twice: %v and %v", e.ID, e.First, e.Second)
}

// Place is where a rule of a list is.
type Place struct {
	// Index is the rule's place in the list, from 0.
	Index int
	// Line is its line in its file, 0 when unknown.
	Line int
	// Source is where it comes from: SourceFile or SourceAdmin.
	Source string
}

func (p Place) String() string {
	s := fmt.Sprintf("rules[%d]", p.Index)
	switch {
	case p.Line > 0:
		s += fmt.Sprintf(" at line %d", p.Line)
	case p.Source != "":
		s += " (" + p.Source + ")"
	}
	return s
}
