package rules

import (
	"errors"
	"fmt"
	"net/netip"
	"path"
	"slices"
	"strings"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// Attributes describe a request for attribute-based checks: every rule
// whose match they satisfy is checked, and each counts against the key its
// key_by picks from them. They must come from the authenticated identity,
// never from values the client chooses.
type Attributes struct {
	APIKey, User, IP, Path, Method, Plan, Domain string
	// Extra holds named attributes, for key_by attr:NAME and match.attributes.
	Extra map[string]string
}

// Match selects the requests a rule applies to. Empty fields match
// anything; a rule without a match block applies only to checks naming it.
type Match struct {
	// Path is an exact path, a path.Match pattern ("/users/*/orders"), or a
	// prefix ending in "/**" ("/api/**" matches /api and all below it),
	// matched regardless of case: /API/x is counted under /api/** whether
	// or not the backend routes it there, so no spelling of a path escapes
	// its rule.
	Path string `yaml:"path"`
	// Methods, Plans: any of these (case-insensitive for methods).
	Methods []string `yaml:"methods"`
	Plans   []string `yaml:"plans"`
	// Domain is the Envoy rate limit domain.
	Domain string `yaml:"domain"`
	// Attributes must all be present with these values.
	Attributes map[string]string `yaml:"attributes"`
}

// Key sources of key_by.
const (
	KeyByAPIKey = "api_key"
	KeyByUser   = "user"
	KeyByIP     = "ip"
	KeyByGlobal = "global"
	keyByAttr   = "attr:"
)

func (m *Match) validate() error {
	if m.Path != "" {
		if !strings.HasPrefix(m.Path, "/") {
			return fieldErrorf("match.path", "must start with /, got %q", m.Path)
		}
		if _, err := path.Match(strings.TrimSuffix(m.Path, "/**"), "/"); err != nil {
			return fieldErrorf("match.path", "%q: %w", m.Path, err)
		}
	}
	for _, meth := range m.Methods {
		if meth == "" || strings.ContainsAny(meth, " \t") {
			return fieldErrorf("match.methods", "%q is not a method", meth)
		}
	}
	for k := range m.Attributes {
		if k == "" {
			return fieldError("match.attributes", errors.New("empty name"))
		}
	}
	return nil
}

// Matches reports whether a satisfies m.
func (m *Match) Matches(a *Attributes) bool {
	if m.Domain != "" && a.Domain != m.Domain {
		return false
	}
	if m.Path != "" && !matchPath(m.Path, a.Path) {
		return false
	}
	if len(m.Methods) > 0 && !slices.ContainsFunc(m.Methods, func(x string) bool { return strings.EqualFold(x, a.Method) }) {
		return false
	}
	if len(m.Plans) > 0 && !slices.Contains(m.Plans, a.Plan) {
		return false
	}
	for k, v := range m.Attributes {
		if got, ok := a.Extra[k]; !ok || got != v {
			return false
		}
	}
	return true
}

func matchPath(pattern, p string) bool {
	// ToLower returns its argument, without allocating, when it is lower
	// case already, as rule paths and request paths mostly are.
	pattern, p = strings.ToLower(pattern), strings.ToLower(p)
	if prefix, ok := strings.CutSuffix(pattern, "/**"); ok {
		return p == prefix || strings.HasPrefix(p, prefix+"/") || prefix == ""
	}
	ok, _ := path.Match(pattern, p)
	return ok
}

func validKeyBy(k string) bool {
	switch k {
	case KeyByAPIKey, KeyByUser, KeyByIP, KeyByGlobal:
		return true
	}
	name, ok := strings.CutPrefix(k, keyByAttr)
	return ok && name != ""
}

// ErrBadAttribute is matched (errors.Is) by every AttributeError.
var ErrBadAttribute = errors.New("bad attribute")

// AttributeError is an attribute that cannot be used as a key: its name
// (as in the API's Attributes, "ip") and why.
type AttributeError struct{ Name, Reason string }

func (e *AttributeError) Error() string { return e.Name + ": " + e.Reason }

// Is makes an AttributeError match ErrBadAttribute.
func (e *AttributeError) Is(target error) bool { return target == ErrBadAttribute }

// KeyOf is the client key a attributes count against under r: the key_by
// attribute, prefixed with its kind so keys of different kinds never meet,
// IPv6 addresses reduced to their /64. ok is false when the attribute is
// absent: the rule does not apply to the request.
func (r *Rule) KeyOf(a *Attributes) (key string, ok bool, err error) {
	var v string
	switch r.KeyBy {
	case KeyByGlobal:
		return "global", true, nil
	case KeyByAPIKey:
		v = a.APIKey
	case KeyByUser:
		v = a.User
	case KeyByIP:
		if a.IP == "" {
			return "", false, nil
		}
		ip, err := netip.ParseAddr(a.IP)
		if err != nil {
			return "", false, &AttributeError{Name: "ip", Reason: fmt.Sprintf("%q is not an IP address", a.IP)}
		}
		return "ip:" + ipKey(ip), true, nil
	default:
		name := strings.TrimPrefix(r.KeyBy, keyByAttr)
		v = a.Extra[name]
		if v == "" {
			return "", false, nil
		}
		return "attr:" + name + ":" + v, true, nil
	}
	if v == "" {
		return "", false, nil
	}
	return r.KeyBy + ":" + v, true, nil
}

// ipKey is an IPv4 address as is, an IPv6 address as its /64: one client
// holds a whole /64.
func ipKey(ip netip.Addr) string {
	ip = ip.Unmap().WithZone("")
	if ip.Is4() {
		return ip.String()
	}
	return netip.PrefixFrom(ip, 64).Masked().String()
}

// Matching returns the rules whose match a satisfies, in file order.
func (s *Set) Matching(a *Attributes) []*Rule {
	var out []*Rule
	for _, r := range s.matchable {
		if r.Match.Matches(a) {
			out = append(out, r)
		}
	}
	return out
}

// costOf validates a rule's cost against its limit.
func (r *Rule) validateCost(l bucket.Limit) error {
	if r.Cost == 0 {
		r.Cost = 1
	}
	if _, err := l.NormalizeCost(r.Cost); err != nil {
		return fieldError("cost", err)
	}
	return nil
}
