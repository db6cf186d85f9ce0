package main

import (
	"maps"
	"testing"
	"time"
)

func TestParseRoute(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		gateway bool
		want    route
		wantErr bool
	}{
		{name: "tcp", in: "127.0.0.1:18182=127.0.0.1:8082,40ms", want: route{listen: "127.0.0.1:18182", target: "127.0.0.1:8082", delay: 40 * time.Millisecond}},
		{name: "tcp zero", in: "127.0.0.1:1=127.0.0.1:2,0", want: route{listen: "127.0.0.1:1", target: "127.0.0.1:2"}},
		{name: "gateway", in: "127.0.0.1:17222=127.0.0.1:7222,eu-west:40ms,ap-south:110ms", gateway: true,
			want: route{listen: "127.0.0.1:17222", target: "127.0.0.1:7222", clusters: map[string]time.Duration{"eu-west": 40 * time.Millisecond, "ap-south": 110 * time.Millisecond}}},
		{name: "tcp without delay", in: "127.0.0.1:1=127.0.0.1:2", wantErr: true},
		{name: "no target", in: "127.0.0.1:1", wantErr: true},
		{name: "bad delay", in: "127.0.0.1:1=127.0.0.1:2,soon", wantErr: true},
		{name: "negative delay", in: "127.0.0.1:1=127.0.0.1:2,-1ms", wantErr: true},
		{name: "bad target", in: "127.0.0.1:1=nowhere,1ms", wantErr: true},
		{name: "gateway without cluster", in: "127.0.0.1:1=127.0.0.1:2,40ms", gateway: true, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseRoute(tt.in, tt.gateway)
			if (err != nil) != tt.wantErr {
				t.Fatalf("parseRoute(%q) error %v, want error %v", tt.in, err, tt.wantErr)
			}
			if err != nil {
				return
			}
			if got.listen != tt.want.listen || got.target != tt.want.target || got.delay != tt.want.delay || !maps.Equal(got.clusters, tt.want.clusters) {
				t.Errorf("parseRoute(%q) = %+v, want %+v", tt.in, got, tt.want)
			}
		})
	}
}

func TestRunRefusesBadRoutes(t *testing.T) {
	for _, args := range [][]string{nil, {"--tcp", "x"}, {"--nats-gateway", "127.0.0.1:1=127.0.0.1:2,eu-west"}} {
		if code := run(args); code != 2 {
			t.Errorf("run(%q) = %d, want 2", args, code)
		}
	}
}
