package request

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/internal/engine/metrics"
	"github.com/limiterd/limiterd/internal/rules"
)

// TestAttributeBounds: a check's attributes over their bounds are refused
// as invalid, naming the attribute, whatever the front door, and at the
// bounds they are decided.
func TestAttributeBounds(t *testing.T) {
	set, err := rules.Parse("r.yml", []byte("rules:\n  - id: r\n    capacity: 10\n    refill_per_second: 1\n    match: {path: /users/*/orders}\n    key_by: user\n"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := metrics.New(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	table := NewTable(set, 1, 1, nil, m, nil)
	extra := func(n int) map[string]string {
		m := map[string]string{}
		for i := range n {
			m[fmt.Sprint("a", i)] = "v"
		}
		return m
	}
	long := strings.Repeat("x", MaxAttributeBytes+1)
	for _, c := range []struct {
		name string
		a    rules.Attributes
		want string // "" = decided
	}{
		{"at the bounds", rules.Attributes{User: "u", Path: "/users/" + strings.Repeat("x", MaxAttributeBytes-14) + "/orders", Extra: extra(MaxExtraAttributes)}, ""},
		{"a long path", rules.Attributes{User: "u", Path: "/users/" + long + "/orders"}, "attributes.path: "},
		{"a long plan", rules.Attributes{User: "u", Plan: long}, "attributes.plan: "},
		{"too many extra", rules.Attributes{User: "u", Extra: extra(MaxExtraAttributes + 1)}, "attributes.extra: 33 entries"},
		{"a long extra value", rules.Attributes{User: "u", Extra: map[string]string{"k": long}}, `attributes.extra["k"]`},
		{"a long extra name", rules.Attributes{User: "u", Extra: map[string]string{long: "v"}}, `attributes.extra["xxxx`},
	} {
		t.Run(c.name, func(t *testing.T) {
			chk := NewCheck(table, m)
			_, _, err := chk.AddAttributes(&c.a, 1)
			var inv *InvalidError
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case c.want != "" && (!errors.As(err, &inv) || inv.Field != "attributes" || !strings.HasPrefix(err.Error(), c.want)):
				t.Fatalf("err = %v, want an invalid attributes error starting %q", err, c.want)
			}
		})
	}
}
