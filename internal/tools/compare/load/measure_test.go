package load

import "testing"

func TestDecisionsMoved(t *testing.T) {
	before := map[[2]string]float64{{"compare", "allowed"}: 10, {"compare", "fallback_allowed"}: 2}
	tests := []struct {
		name    string
		after   map[[2]string]float64
		decides bool
		calls   uint64
		ok      bool
	}{
		{"all allowed", map[[2]string]float64{{"compare", "allowed"}: 110, {"compare", "fallback_allowed"}: 2}, true, 100, true},
		{"one more decided than counted", map[[2]string]float64{{"compare", "allowed"}: 111, {"compare", "fallback_allowed"}: 2}, true, 100, true},
		{"fallback", map[[2]string]float64{{"compare", "allowed"}: 110, {"compare", "fallback_allowed"}: 3}, true, 100, false},
		{"limited", map[[2]string]float64{{"compare", "allowed"}: 110, {"compare", "fallback_allowed"}: 2, {"compare", "limited"}: 1}, true, 100, false},
		{"fewer decided than OK calls", map[[2]string]float64{{"compare", "allowed"}: 100, {"compare", "fallback_allowed"}: 2}, true, 100, false},
		{"health decides nothing", map[[2]string]float64{{"compare", "allowed"}: 10, {"compare", "fallback_allowed"}: 2}, false, 100, true},
		{"health with decisions", map[[2]string]float64{{"compare", "allowed"}: 11, {"compare", "fallback_allowed"}: 2}, false, 100, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if msg := decisionsMoved(before, tt.after, tt.decides, tt.calls); (msg == "") != tt.ok {
				t.Errorf("decisionsMoved: %q, want ok %v", msg, tt.ok)
			}
		})
	}
}

func TestNotOK(t *testing.T) {
	tests := []struct {
		name string
		rep  ghzReport
		ok   bool
	}{
		{"all OK", ghzReport{Count: 5, StatusCodeDist: map[string]int{"OK": 5}}, true},
		{"one unavailable", ghzReport{Count: 5, StatusCodeDist: map[string]int{"OK": 4, "Unavailable": 1}, ErrorDist: map[string]int{"transport is closing": 1}}, false},
		{"no calls", ghzReport{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if msg := tt.rep.notOK(); (msg == "") != tt.ok {
				t.Errorf("notOK: %q, want ok %v", msg, tt.ok)
			}
		})
	}
}

func TestCommandStats(t *testing.T) {
	info := "# Commandstats\r\ncmdstat_evalsha:calls=300,usec=2700,usec_per_call=9.00,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_config|resetstat:calls=1,usec=10,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n"
	got := commandStats(info)
	if c := got["evalsha"]; c.Calls != 300 || c.Usec != 2700 {
		t.Errorf("evalsha: %+v", c)
	}
	if c := got["config|resetstat"]; c.Calls != 1 || c.Usec != 10 {
		t.Errorf("config|resetstat: %+v", c)
	}
	if len(got) != 2 {
		t.Errorf("%d commands, want 2: %v", len(got), got)
	}
}
