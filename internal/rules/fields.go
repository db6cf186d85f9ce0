package rules

import (
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"

	"github.com/agext/levenshtein"
	"go.yaml.in/yaml/v3"
)

// UnknownFieldError is the cause of an Error about a key that is no field in
// its place: rules are decoded strictly, so a typo is an error, not a
// setting silently left at its default.
type UnknownFieldError struct {
	// Key is the key as written.
	Key string
	// Suggestion is the field Key is most likely a typo of, or empty when
	// none is near enough.
	Suggestion string
	// Known lists the fields of Key's place, in order.
	Known []string
}

func (e *UnknownFieldError) Error() string {
	if e.Suggestion != "" {
		return fmt.Sprintf("unknown field, did you mean %s?", e.Suggestion)
	}
	return "unknown field; the fields here are " + strings.Join(e.Known, ", ")
}

// synonyms are names of other rate limiters for a field of a rule.
var synonyms = map[string]string{
	"burst": "capacity",
	"rate":  "refill_per_second",
}

// suggest returns the field of known that key is most likely a typo of: the
// nearest by edit distance when it is within a third of key's length (at
// least 1), else the one field key is a prefix of, else a synonym; or "".
func suggest(key string, known []string) string {
	k := strings.ToLower(key)
	best, bestDist := "", -1
	for _, f := range known {
		if d := levenshtein.Distance(k, f, nil); bestDist < 0 || d < bestDist {
			best, bestDist = f, d
		}
	}
	if bestDist >= 0 && bestDist <= max(1, len([]rune(k))/3) {
		return best
	}
	var prefixOf []string
	for _, f := range known {
		if len(k) >= 3 && strings.HasPrefix(f, k) {
			prefixOf = append(prefixOf, f)
		}
	}
	if len(prefixOf) == 1 {
		return prefixOf[0]
	}
	for _, f := range known {
		if synonyms[k] == f {
			return f
		}
	}
	return ""
}

// yamlFields returns the YAML names of struct type t's fields, in order,
// and each one's type.
func yamlFields(t reflect.Type) ([]string, map[string]reflect.Type) {
	var names []string
	types := make(map[string]reflect.Type)
	for f := range t.Fields() {
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == "-" {
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		names = append(names, name)
		types[name] = f.Type
	}
	return names, types
}

// checkFields checks the mapping n against t, the struct type it decodes
// into, before it is decoded: the first key that is no field of t (an
// *UnknownFieldError naming the field it is likely a typo of) or whose value
// does not decode into its field is an *Error with its Field, dotted below
// prefix, and Line. The rules of a list are checked one by one, and the
// error of one names its index and id.
func checkFields(n *yaml.Node, t reflect.Type, prefix string) error {
	c := checker{open: make(map[*yaml.Node]bool), passed: make(map[checked]bool)}
	return c.mapping(n, t, prefix)
}

// checker remembers the mappings it is in, which an alias may name again
// ("&a {<<: *a}" merges a mapping into itself), and those that passed, which
// aliases may name any number of times (merges of merges: 2^n visits).
type checker struct {
	open   map[*yaml.Node]bool
	passed map[checked]bool
}

type checked struct {
	n *yaml.Node
	t reflect.Type
}

func (c *checker) mapping(n *yaml.Node, t reflect.Type, prefix string) error {
	n = resolve(n)
	if n == nil || n.Kind != yaml.MappingNode {
		return nil // not a mapping: the caller's decode says so
	}
	if c.passed[checked{n, t}] {
		return nil
	}
	if c.open[n] {
		return &Error{Index: -1, Field: strings.TrimSuffix(prefix, "."), Line: n.Line, Err: errors.New("an alias names the mapping it is in")}
	}
	c.open[n] = true
	defer delete(c.open, n)
	if err := c.fields(n, t, prefix); err != nil {
		return err
	}
	c.passed[checked{n, t}] = true
	return nil
}

func (c *checker) fields(n *yaml.Node, t reflect.Type, prefix string) error {
	names, types := yamlFields(t)
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.ShortTag() == "!!merge" {
			// "<<: *base": the keys of base are this mapping's.
			merged := []*yaml.Node{resolve(v)}
			if merged[0].Kind == yaml.SequenceNode {
				merged = merged[0].Content
			}
			for _, m := range merged {
				if err := c.mapping(m, t, prefix); err != nil {
					return err
				}
			}
			continue
		}
		ft, ok := types[k.Value]
		if !ok {
			key := k.Value
			if key == "" {
				// An empty key ("": 1, or an anchor and no name: &a: 1)
				// still has to be named.
				key = `""`
			}
			return &Error{Index: -1, Field: prefix + key, Line: k.Line,
				Err: &UnknownFieldError{Key: k.Value, Suggestion: suggest(k.Value, names), Known: names}}
		}
		if err := c.value(v, ft, prefix+k.Value, k.Line); err != nil {
			return err
		}
	}
	return nil
}

// value checks the value v of field (written at line) against its type t:
// the fields of a struct, the rules of a list, and then that v decodes into
// t at all.
func (c *checker) value(v *yaml.Node, t reflect.Type, field string, line int) error {
	v = resolve(v)
	et := t
	for et.Kind() == reflect.Pointer {
		et = et.Elem()
	}
	switch {
	case et.Kind() == reflect.Struct:
		if err := c.mapping(v, et, field+"."); err != nil {
			return err
		}
	case et.Kind() == reflect.Map && et.Elem().Kind() == reflect.Struct && v.Kind == yaml.MappingNode:
		// A mapping of keys to structs (overrides): each value's fields,
		// named by its key: overrides["tenant-a"].capacity.
		for i := 0; i+1 < len(v.Content); i += 2 {
			k := resolve(v.Content[i])
			prefix := field + "[" + strconv.Quote(k.Value) + "]"
			item := resolve(v.Content[i+1])
			if item.Kind != yaml.MappingNode {
				return &Error{Index: -1, Field: prefix, Line: k.Line, Err: fmt.Errorf("want a mapping, got %s", describe(item))}
			}
			if err := c.mapping(item, et.Elem(), prefix+"."); err != nil {
				return err
			}
		}
	case et.Kind() == reflect.Slice && et.Elem().Kind() == reflect.Struct && v.Kind == yaml.SequenceNode:
		for i, item := range v.Content {
			item = resolve(item)
			var err error
			if item.Kind != yaml.MappingNode {
				err = &Error{Line: item.Line, Err: fmt.Errorf("want a mapping, got %s", describe(item))}
			} else {
				err = c.mapping(item, et.Elem(), "")
			}
			var e *Error
			if errors.As(err, &e) {
				e.Index, e.ID = i, idOf(item)
				return e
			}
		}
	}
	if err := v.Decode(reflect.New(t).Interface()); err != nil {
		var te *yaml.TypeError
		if errors.As(err, &te) {
			if got := describe(v); got != shape(t) {
				err = fmt.Errorf("want %s, got %s", want(t), got)
			} else {
				err = fmt.Errorf("want %s", want(t)) // the shape is right, a value in it is not
			}
		}
		return &Error{Index: -1, Field: field, Line: line, Err: err}
	}
	return nil
}

// want says what a value of type t is written as.
func want(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == reflect.TypeFor[Duration]() {
		return "a duration such as 90s or 24h"
	}
	switch t.Kind() {
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "a whole number"
	case reflect.Bool:
		return "true or false"
	case reflect.String:
		return "a string"
	case reflect.Slice:
		return "a list of " + plural(t.Elem())
	case reflect.Map:
		return "a mapping of " + plural(t.Elem())
	case reflect.Struct:
		return "a mapping"
	}
	return t.String()
}

func plural(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "strings"
	case reflect.Float32, reflect.Float64:
		return "numbers"
	}
	return t.String() + " values"
}

// shape is describe's word for a node that type t decodes from, when t is
// a list or a mapping.
func shape(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Slice:
		return "a list"
	case reflect.Map, reflect.Struct:
		return "a mapping"
	}
	return ""
}

// describe says what the node n is, for an error.
func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	return strconv.Quote(n.Value)
}
