package soak

import (
	"strings"
	"testing"
	"time"
)

// TestAuditCatches holds the audit to what it must catch, on records made
// up for the purpose: each broken invariant fails it, and the clean
// records and the excused cases do not. (TestSoak -soak.break=replay shows
// the ledger catching a real double apply on the real stack.)
func TestAuditCatches(t *testing.T) {
	const s = int64(time.Second)
	us, eu := 0, 1
	// clean: us-east admits 10 tokens of its ledger key, publishes them,
	// and both other regions count them; one slow key within its bound;
	// a pinned key at its capacity; a fail-closed key its store counted.
	clean := func() auditInput {
		in := auditInput{interval: 250 * time.Millisecond, home: func(string) string { return "eu-west" }}
		for i := range 10 {
			in.answers = append(in.answers,
				answer{sent: int64(i) * s / 10, done: int64(i)*s/10 + 1e6, region: uint8(us), rule: ruleLedger, key: 1, cost: 1, allowed: true})
		}
		for i := range 50 {
			in.answers = append(in.answers,
				answer{sent: int64(i) * 1e6, done: int64(i)*1e6 + 1e5, region: uint8(i % 3), rule: ruleSlow, key: 2, cost: 1, allowed: true},
				answer{sent: int64(i) * 1e6, done: int64(i)*1e6 + 1e5, region: uint8(i % 3), rule: ruleClosed, key: 3, cost: 1, allowed: i < 5},
			)
		}
		for i := range 20 {
			in.answers = append(in.answers,
				answer{sent: int64(i) * 1e6, done: int64(i)*1e6 + 1e5, region: uint8(i % 3), rule: rulePinned, key: 4, cost: 1, allowed: true})
		}
		k := keyName(ruleLedger, "us-east", 1)
		in.published = map[string]map[string]float64{"us-east": {k: 10}}
		in.flushes = map[string]int{"us-east": 3}
		in.counts = map[string]map[string]float64{"us-east": {k: 10}, "eu-west": {k: 10}, "ap-south": {k: 10}}
		c := keyName(ruleClosed, "", 3)
		in.closedCounts = map[string]map[string]float64{"us-east": {c: 2}, "eu-west": {c: 2}, "ap-south": {c: 1}}
		return in
	}
	ledgerKey := keyName(ruleLedger, "us-east", 1)
	tests := []struct {
		name   string
		change func(*auditInput)
		want   string // in a failure; "" for none
	}{
		{"clean", func(*auditInput) {}, ""},
		{"ledger applied twice", func(in *auditInput) { in.counts["eu-west"][ledgerKey] = 13 }, "applied twice"},
		{"ledger spend lost", func(in *auditInput) { in.counts["ap-south"][ledgerKey] = 7 }, "a spend lost"},
		{"ledger short within a failover of the destination", func(in *auditInput) {
			in.counts["ap-south"][ledgerKey] = 9
			in.faults = []*fault{{kind: faultPrimary, region: "ap-south", thirds: []int{0, 1, 2}, start: s, end: 5 * s}}
		}, ""},
		{"ledger short beyond what a failover may lose", func(in *auditInput) {
			in.counts["ap-south"][ledgerKey] = 0
			in.faults = []*fault{{kind: faultPrimary, region: "ap-south", thirds: []int{0, 1, 2}, start: 30 * s, end: 35 * s}}
		}, "a spend lost"},
		{"never published, no limiterd killed", func(in *auditInput) { in.published["us-east"][ledgerKey] = 8 }, "never published"},
		{"never published, its limiterd killed", func(in *auditInput) {
			in.published["us-east"][ledgerKey] = 8
			in.counts["eu-west"][ledgerKey], in.counts["ap-south"][ledgerKey] = 8, 8
			in.faults = []*fault{{kind: faultLimiterd, region: "us-east", killedAt: s, start: s, end: 2 * s}}
		}, ""},
		{"bound exceeded", func(in *auditInput) {
			for i := range 200 {
				in.answers = append(in.answers, answer{sent: 60e6, done: 60e6 + int64(i), region: uint8(eu), rule: ruleSlow, key: 2, cost: 1, allowed: true})
			}
		}, "bound: slow/k002"},
		{"bound excused by a blind region", func(in *auditInput) {
			// ap-south is blind to eu-west for the whole run, and
			// eu-west admits 200 tokens of spending ap-south never sees
			// (as in a cut): the slack counts them.
			for i := range 200 {
				in.answers = append(in.answers, answer{sent: 60e6, done: 60e6 + int64(i), region: uint8(eu), rule: ruleSlow, key: 2, cost: 1, allowed: true})
			}
			in.probes = newProbes(time.Now())
			for th := range 3 {
				in.probes.seen[2][eu][th] = []probeSample{{at: 10 * s, upTo: -1, next: 0}}
			}
		}, ""},
		{"pinned over its limit", func(in *auditInput) {
			in.answers = append(in.answers, answer{sent: 30e6, done: 30e6 + 1, region: 2, rule: rulePinned, key: 4, cost: 1, allowed: true})
		}, "pinned: k004"},
		{"fail-closed admitted above its store", func(in *auditInput) {
			in.closedCounts["ap-south"][keyName(ruleClosed, "", 3)] = 0
		}, "fail-closed: ap-south"},
		{"fail-closed decided by the fallback", func(in *auditInput) { in.closedUnstored = 1 }, "decided without the store"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in := clean()
			tc.change(&in)
			res := audit(in)
			got := strings.Join(res.failures, "\n")
			switch {
			case tc.want == "" && got != "":
				t.Errorf("failures:\n%s\nwant none", got)
			case tc.want != "" && !strings.Contains(got, tc.want):
				t.Errorf("failures:\n%s\nwant one with %q", got, tc.want)
			}
		})
	}
}
