package rules

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strings"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// Priority classes: a check or an Acquire names the class of its request,
// and a token bucket or GCRA rule's reserve keeps part of its capacity for
// the classes above it, a concurrency rule's part of its limit.
const (
	// DefaultClass is the class of a check that names none, or a class
	// that is not configured.
	DefaultClass = "default"
	// MaxClassLen bounds a class name, in bytes: a check naming a longer
	// one is invalid.
	MaxClassLen = 32
	// MaxClasses bounds the classes configured: each is a label value of
	// limiter_priority_decisions_total.
	MaxClasses = 16
)

// DefaultClasses are the classes, most important first, when none are
// configured.
var DefaultClasses = []string{"critical", DefaultClass, "sheddable"}

var classPattern = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]*$`)

// CheckClass reports whether name may be a configured class: 1 to
// MaxClassLen of [a-z0-9_-], a letter or digit first.
func CheckClass(name string) error {
	if len(name) > MaxClassLen || !classPattern.MatchString(name) {
		return fmt.Errorf("a class name is 1 to %d of [a-z0-9_-], a letter or digit first, got %q", MaxClassLen, cut(name))
	}
	return nil
}

func cut(s string) string {
	if len(s) > MaxClassLen+8 {
		return s[:MaxClassLen+8] + "..."
	}
	return s
}

// Classes are the configured priority classes, most important first. The
// zero value is not valid: use NewClasses. It is immutable and safe for
// concurrent use.
type Classes struct {
	names []string
	index map[string]int
	def   int
}

// NewClasses validates names, most important first: 1 to MaxClasses
// valid, distinct names (CheckClass), DefaultClass among them.
func NewClasses(names []string) (*Classes, error) {
	if len(names) == 0 || len(names) > MaxClasses {
		return nil, fmt.Errorf("1 to %d priority classes, got %d", MaxClasses, len(names))
	}
	c := &Classes{names: slices.Clone(names), index: make(map[string]int, len(names)), def: -1}
	for i, n := range names {
		if err := CheckClass(n); err != nil {
			return nil, err
		}
		if _, dup := c.index[n]; dup {
			return nil, fmt.Errorf("class %q is named twice", n)
		}
		c.index[n] = i
	}
	var ok bool
	if c.def, ok = c.index[DefaultClass]; !ok {
		return nil, fmt.Errorf("the classes must include %q, the class of a check that names none", DefaultClass)
	}
	return c, nil
}

// ParseClasses is NewClasses of a comma-separated list.
func ParseClasses(s string) (*Classes, error) {
	names := strings.Split(s, ",")
	for i := range names {
		names[i] = strings.TrimSpace(names[i])
	}
	return NewClasses(names)
}

// DefaultClassList are the DefaultClasses.
func DefaultClassList() *Classes {
	c, err := NewClasses(DefaultClasses)
	if err != nil {
		panic("rules: the default classes are invalid: " + err.Error())
	}
	return c
}

// Names are the classes, most important first.
func (c *Classes) Names() []string { return c.names }

// String is the classes as a flag writes them.
func (c *Classes) String() string { return strings.Join(c.names, ",") }

// Index is the position of the class name, most important first: that of
// DefaultClass for an empty or unknown name.
func (c *Classes) Index(name string) int {
	if i, ok := c.index[name]; ok {
		return i
	}
	return c.def
}

// Keeps are what a check of each class (in order) keeps of r's capacity:
// the sum of r's reserves for the classes above it. Nil when r keeps no
// reserve.
func (c *Classes) Keeps(r *Rule) []float64 {
	if len(r.Reserve) == 0 {
		return nil
	}
	keeps := make([]float64, len(c.names))
	sum := 0.0
	for i, n := range c.names {
		keeps[i] = sum
		sum += r.Reserve[n]
	}
	if sum == 0 {
		return nil
	}
	return keeps
}

// CheckRule reports a reserve of r for a class that is not configured: an
// *Error naming reserve.<class>.
func (c *Classes) CheckRule(r *Rule) error {
	for _, n := range sortedKeys(r.Reserve) {
		if _, ok := c.index[n]; !ok {
			return &Error{Index: -1, ID: r.ID, Field: "reserve." + n,
				Err: fmt.Errorf("no priority class %q (the classes are %s)", n, strings.Join(c.names, ", "))}
		}
	}
	return nil
}

// reserveOf is what r's reserve is a fraction of.
func (r *Rule) reserveOf() string {
	if r.Concurrent() {
		return "limit"
	}
	return "capacity"
}

func sortedKeys(m map[string]float64) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// validateReserve checks r's reserve: a token bucket, GCRA or concurrency
// rule's, decided in this region's store (not pinned, not leased), each
// fraction in [0, 1) of a valid class name, adding up to less than 1.
func (r *Rule) validateReserve() error {
	if r.Reserve == nil {
		return nil
	}
	switch {
	case r.Algorithm != bucket.TokenBucket && r.Algorithm != bucket.GCRA && !r.Concurrent():
		return fieldErrorf("reserve", "only token_bucket, gcra and concurrency rules keep a reserve, not %s", r.Algorithm)
	case r.Lease != 0:
		return fieldError("reserve", errors.New("a rule with lease hands out tokens from each limiterd, which keeps no reserve"))
	case r.Home == HomePinned:
		return fieldError("reserve", errors.New("a pinned rule is decided in its key's home region, which is not told the check's class"))
	case len(r.Reserve) == 0:
		return fieldError("reserve", errors.New("names no class: give at least one class and its fraction, or leave reserve out"))
	case len(r.Reserve) > MaxClasses:
		return fieldErrorf("reserve", "%d classes, the most is %d", len(r.Reserve), MaxClasses)
	}
	sum := 0.0
	for _, n := range sortedKeys(r.Reserve) {
		if err := CheckClass(n); err != nil {
			return fieldError("reserve", err)
		}
		if v := r.Reserve[n]; !(v >= 0 && v < 1) {
			return fieldErrorf("reserve."+n, "must be a fraction of the %s in [0, 1), got %v", r.reserveOf(), v)
		}
		sum += r.Reserve[n]
	}
	if !(sum < 1) {
		return fieldErrorf("reserve", "the fractions add up to %v: they must add up to less than 1, or the least important class could never spend", sum)
	}
	return nil
}
