package scripts

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestDocsAdminExample: the admin calls `make up` prints (stack.sh
// admin-example) are the admin example of docs/rules.md, line for line, so that
// pasting the page's runs against the stack.
func TestDocsAdminExample(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	out, err := exec.Command(bash, "stack.sh", "admin-example").Output()
	if err != nil {
		t.Fatalf("stack.sh admin-example: %v", err)
	}
	example := string(out)
	if !strings.Contains(example, "/admin/rules/") || !strings.Contains(example, ".stack/admin-token") {
		t.Fatalf("stack.sh admin-example prints no admin call with the stack's token:\n%s", example)
	}
	readme, err := os.ReadFile("../docs/rules.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "```sh\n"+example+"```\n") {
		t.Errorf("docs/rules.md has no sh block that is exactly what make up prints:\n%s", example)
	}
}

// TestStackWAN holds WAN to what `make up` puts between the regions: by
// default a proxy in front of each region's gateway and one per ordered
// pair of regions for the Peer links, none with WAN=0, and a refusal of a
// WAN it cannot read.
func TestStackWAN(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	proxies := func(wan string) (gateways, peers int, ok bool, out string) {
		t.Helper()
		cmd := exec.Command(bash, "stack.sh", "ports")
		cmd.Env = append(os.Environ(), "WAN="+wan)
		b, err := cmd.CombinedOutput()
		for line := range strings.Lines(string(b)) {
			_, what, _ := strings.Cut(strings.TrimSpace(line), " ")
			switch {
			case strings.HasPrefix(what, "wanproxy-nats-"):
				gateways++
			case strings.HasPrefix(what, "wanproxy-peer-"):
				peers++
			}
		}
		return gateways, peers, err == nil, string(b)
	}
	for _, tt := range []struct {
		name, wan       string
		gateways, peers int
		ok              bool
	}{
		{name: "default", wan: "", gateways: 3, peers: 6, ok: true},
		{name: "one delay", wan: "50ms", gateways: 3, peers: 6, ok: true},
		{name: "pairs", wan: "us-east/eu-west=10ms,ap-south/eu-west=1.5s", gateways: 3, peers: 6, ok: true},
		{name: "none", wan: "0", ok: true},
		{name: "not a delay", wan: "soon"},
		{name: "unknown region", wan: "us-east/mars=1ms"},
		{name: "pair without a delay", wan: "us-east/eu-west="},
	} {
		t.Run(tt.name, func(t *testing.T) {
			g, p, ok, out := proxies(tt.wan)
			if ok != tt.ok || g != tt.gateways || p != tt.peers {
				t.Errorf("WAN=%q stack.sh ports: ok %v, %d gateway and %d Peer proxies; want ok %v, %d and %d\n%s", tt.wan, ok, g, p, tt.ok, tt.gateways, tt.peers, out)
			}
		})
	}
}
