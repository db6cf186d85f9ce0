package rules

import (
	"errors"
	"slices"
	"testing"
)

func TestMatching(t *testing.T) {
	s, err := Load("testdata/full.good.yml")
	if err != nil {
		t.Fatal(err)
	}
	ids := func(rs []*Rule) []string {
		var out []string
		for _, r := range rs {
			out = append(out, r.ID)
		}
		return out
	}
	tests := []struct {
		name string
		a    Attributes
		want []string
	}{
		{"api path", Attributes{Path: "/api/orders", Method: "GET"}, []string{"api-per-key", "anonymous", "everyone"}},
		{"api root", Attributes{Path: "/api"}, []string{"api-per-key", "anonymous", "everyone"}},
		{"api in capitals", Attributes{Path: "/API/Orders", Method: "GET"}, []string{"api-per-key", "anonymous", "everyone"}},
		{"search in capitals", Attributes{Path: "/Api/SEARCH", Method: "GET"}, []string{"api-per-key", "search", "anonymous", "everyone"}},
		{"not a prefix", Attributes{Path: "/apiary"}, []string{"anonymous", "everyone"}},
		{"search by GET", Attributes{Path: "/api/search", Method: "get"}, []string{"api-per-key", "search", "anonymous", "everyone"}},
		{"search by DELETE", Attributes{Path: "/api/search", Method: "DELETE"}, []string{"api-per-key", "anonymous", "everyone"}},
		{"free plan", Attributes{Path: "/x", Plan: "free"}, []string{"anonymous", "free-plan-daily", "everyone"}},
		{"envoy domain", Attributes{Domain: "edge", Extra: map[string]string{"generic_key": "slow-backend"}}, []string{"anonymous", "everyone", "envoy-domain"}},
		{"envoy other value", Attributes{Domain: "edge", Extra: map[string]string{"generic_key": "other"}}, []string{"anonymous", "everyone"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := ids(s.Matching(&tt.a)); !slices.Equal(got, tt.want) {
				t.Fatalf("Matching = %v, want %v", got, tt.want)
			}
		})
	}
	if got := s.Get("search").Cost; got != 10 {
		t.Fatalf("search cost = %v", got)
	}
	if got := s.Get("api-per-key").Cost; got != 1 {
		t.Fatalf("default cost = %v", got)
	}
}

func TestKeyOf(t *testing.T) {
	rule := func(keyBy string) *Rule { return &Rule{KeyBy: keyBy} }
	tests := []struct {
		name  string
		r     *Rule
		a     Attributes
		want  string
		ok    bool
		isErr bool
	}{
		{"api key", rule(KeyByAPIKey), Attributes{APIKey: "k1"}, "api_key:k1", true, false},
		{"no api key", rule(KeyByAPIKey), Attributes{User: "u"}, "", false, false},
		{"user", rule(KeyByUser), Attributes{User: "bob"}, "user:bob", true, false},
		{"ipv4", rule(KeyByIP), Attributes{IP: "192.0.2.7"}, "ip:192.0.2.7", true, false},
		{"ipv4-mapped", rule(KeyByIP), Attributes{IP: "::ffff:192.0.2.7"}, "ip:192.0.2.7", true, false},
		{"ipv6 by /64", rule(KeyByIP), Attributes{IP: "2001:db8:1:2:aaaa:bbbb:cccc:dddd"}, "ip:2001:db8:1:2::/64", true, false},
		{"same /64", rule(KeyByIP), Attributes{IP: "2001:db8:1:2::1"}, "ip:2001:db8:1:2::/64", true, false},
		{"ipv6 zone", rule(KeyByIP), Attributes{IP: "fe80::1%eth0"}, "ip:fe80::/64", true, false},
		{"bad ip", rule(KeyByIP), Attributes{IP: "not-an-ip"}, "", false, true},
		{"global", rule(KeyByGlobal), Attributes{}, "global", true, false},
		{"named attribute", rule("attr:tenant"), Attributes{Extra: map[string]string{"tenant": "acme"}}, "attr:tenant:acme", true, false},
		{"missing named", rule("attr:tenant"), Attributes{}, "", false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok, err := tt.r.KeyOf(&tt.a)
			if got != tt.want || ok != tt.ok || (err != nil) != tt.isErr {
				t.Fatalf("KeyOf = %q, %v, %v; want %q, %v, error %v", got, ok, err, tt.want, tt.ok, tt.isErr)
			}
			if err == nil {
				return
			}
			if !errors.Is(err, ErrBadAttribute) {
				t.Fatalf("error %v does not wrap ErrBadAttribute", err)
			}
			// The error names the attribute as the API does, first.
			var ae *AttributeError
			if !errors.As(err, &ae) || ae.Name != "ip" || err.Error() != `ip: "not-an-ip" is not an IP address` {
				t.Fatalf("error %q (%#v), want the attribute ip named first, then why", err, ae)
			}
		})
	}
}
