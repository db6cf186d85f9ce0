package natstest

import "testing"

func TestConnectingGateway(t *testing.T) {
	tests := []struct {
		name, line, want string
	}{
		{name: "gateway connect", line: `CONNECT {"echo":false,"verbose":false,"pedantic":false,"tls_required":false,"name":"NABC","gateway":"eu-west"}` + "\r\n", want: "eu-west"},
		{name: "client connect", line: `CONNECT {"verbose":false,"name":"x"}` + "\r\n"},
		{name: "not a connect", line: "PING\r\n"},
		{name: "bad json", line: "CONNECT {\r\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := connectingGateway(tt.line); got != tt.want {
				t.Errorf("connectingGateway(%q) = %q, want %q", tt.line, got, tt.want)
			}
		})
	}
}
