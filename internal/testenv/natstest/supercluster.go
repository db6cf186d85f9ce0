package natstest

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/testenv"
	"github.com/limiterd/limiterd/internal/wanproxy"
	"github.com/limiterd/limiterd/internal/wanproxy/natsgateway"
)

// superReadyTimeout bounds the wait for a supercluster to be formed: every
// server healthy, every gateway connected, a JetStream meta leader.
const superReadyTimeout = 60 * time.Second

// Supercluster is a NATS supercluster of nats-server processes started by
// NewSupercluster on loopback: one NATS cluster per region (cluster and
// gateway name: the region), gateways between every pair of regions, one
// JetStream domain over all of them.
//
// Each server's gateway port sits behind a small TCP proxy of the test
// process, advertised to the other clusters, so that Cut can sever the
// gateways between two regions and Heal restore them while the servers
// run, and SetDelay put a one-way delay between them (a wanproxy.Link per
// ordered pair of regions, Link, for jitter, stalls and one-way cuts).
//
// Regions, Servers, URL, URLs, Cut, Heal, Severed, SetDelay and Link are
// safe for concurrent use; WaitReady fails the test it is given. A Supercluster is
// only made by this package.
type Supercluster struct {
	regions []string
	servers map[string][]*Server
	proxies []*natsgateway.Proxy
	links   map[[2]string]*wanproxy.Link // from, to: see Link

	mu  sync.Mutex
	cut map[[2]string]bool // both orders of every severed pair
}

// NewSupercluster starts serversPerRegion nats-server processes for each
// region, forms the supercluster and returns once WaitReady succeeds. Every
// server runs JetStream, stores in its own t.TempDir() (limits as
// NewServer's) and takes opts (Config: the same authorization block on
// every server). Everything is stopped when the test ends.
func NewSupercluster(t testing.TB, regions []string, serversPerRegion int, opts ...Option) *Supercluster {
	t.Helper()
	if len(regions) < 2 || serversPerRegion < 1 {
		t.Fatalf("natstest: a supercluster needs at least two regions and one server each, got %d and %d", len(regions), serversPerRegion)
	}
	bin := natsBinary(t)
	sc := &Supercluster{regions: slices.Clone(regions), servers: map[string][]*Server{}, cut: map[[2]string]bool{},
		links: map[[2]string]*wanproxy.Link{}}
	for _, a := range regions {
		for _, b := range regions {
			if a != b {
				sc.links[[2]string{a, b}] = wanproxy.NewLink(wanproxy.Shape{}, wanproxy.Shape{})
			}
		}
	}
	t.Cleanup(sc.closeProxies)
	var lastErr error
	for range 3 {
		err := sc.start(t, bin, serversPerRegion, opts)
		if err == nil {
			sc.WaitReady(t)
			return sc
		}
		sc.stopAll()
		lastErr = err
		if !errors.Is(err, errPortInUse) {
			break
		}
	}
	t.Fatalf("natstest: start nats supercluster: %v", lastErr)
	return nil
}

// start picks the ports, writes every configuration and starts every
// server at once (a clustered JetStream server waits for its peers).
func (sc *Supercluster) start(t testing.TB, bin string, perRegion int, opts []Option) error {
	sc.closeProxies()
	sc.proxies = nil
	type ports struct{ client, monitor, route, gateway int }
	all := map[string][]ports{}
	proxies := map[string][]*natsgateway.Proxy{}
	for _, r := range sc.regions {
		for range perRegion {
			var p ports
			for _, dst := range []*int{&p.client, &p.monitor, &p.route, &p.gateway} {
				var err error
				if *dst, err = testenv.ReservePort(); err != nil {
					return err
				}
			}
			all[r] = append(all[r], p)
			gp, err := newGatewayProxy(sc, r, p.gateway)
			if err != nil {
				return err
			}
			sc.proxies = append(sc.proxies, gp)
			proxies[r] = append(proxies[r], gp)
		}
	}
	sc.servers = map[string][]*Server{}
	for _, r := range sc.regions {
		for i, p := range all[r] {
			s := &Server{bin: bin, dir: t.TempDir(), name: fmt.Sprintf("%s-%d", r, i+1),
				port: p.client, monitor: p.monitor, healthPath: "/healthz?js-enabled-only=true"}
			for _, o := range opts {
				o(s)
			}
			advertise := proxies[r][i].Port()
			s.member = func(b *strings.Builder) {
				fmt.Fprintf(b, "cluster {\n  name: %q\n  listen: \"127.0.0.1:%d\"\n  routes: [\n", r, p.route)
				// Every server of the region, itself included: a server
				// ignores a route to itself, and a region of one server
				// still needs one for clustered JetStream.
				for _, q := range all[r] {
					fmt.Fprintf(b, "    \"nats-route://127.0.0.1:%d\"\n", q.route)
				}
				b.WriteString("  ]\n}\n")
				// The other clusters dial the proxy: advertise keeps them
				// from learning the gateway port itself.
				fmt.Fprintf(b, "gateway {\n  name: %q\n  listen: \"127.0.0.1:%d\"\n  advertise: \"127.0.0.1:%d\"\n  gateways: [\n", r, p.gateway, advertise)
				for _, other := range sc.regions {
					if other == r {
						continue
					}
					var urls []string
					for _, gp := range proxies[other] {
						urls = append(urls, strconv.Quote(fmt.Sprintf("nats://127.0.0.1:%d", gp.Port())))
					}
					fmt.Fprintf(b, "    { name: %q, urls: [%s] }\n", other, strings.Join(urls, ", "))
				}
				b.WriteString("  ]\n}\n")
			}
			sc.servers[r] = append(sc.servers[r], s)
		}
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	for _, r := range sc.regions {
		for _, s := range sc.servers[r] {
			wg.Go(func() {
				p, err := s.spawn()
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, fmt.Errorf("%s: %w", s.name, err))
					return
				}
				s.proc = p
			})
		}
	}
	wg.Wait()
	for _, r := range sc.regions {
		for _, s := range sc.servers[r] {
			t.Cleanup(s.Shutdown)
		}
	}
	return errors.Join(errs...)
}

func (sc *Supercluster) stopAll() {
	for _, r := range sc.regions {
		for _, s := range sc.servers[r] {
			s.Kill()
		}
	}
}

// Regions returns the regions, in the order given.
func (sc *Supercluster) Regions() []string { return slices.Clone(sc.regions) }

// Servers returns region's servers, to stop, kill and restart one by one
// (Shutdown, Kill, Restart). Their names are <region>-1, <region>-2, ...
func (sc *Supercluster) Servers(region string) []*Server {
	return slices.Clone(sc.servers[region])
}

// URLs returns the client URLs of region's servers.
func (sc *Supercluster) URLs(region string) []string {
	var urls []string
	for _, s := range sc.servers[region] {
		urls = append(urls, s.URL())
	}
	return urls
}

// URL returns region's client URLs joined by commas, as the clients'
// --nats.url takes them: a client fails over among its region's servers.
func (sc *Supercluster) URL(region string) string { return strings.Join(sc.URLs(region), ",") }

// Cut severs the gateways between regions a and b, both ways: their
// connections are dropped and new ones refused until Heal. Every other
// pair of regions stays connected.
func (sc *Supercluster) Cut(a, b string) {
	sc.mu.Lock()
	sc.cut[[2]string{a, b}], sc.cut[[2]string{b, a}] = true, true
	sc.mu.Unlock()
	sc.Link(a, b).SetDown(true)
	sc.Link(b, a).SetDown(true)
}

// Heal lets the gateways between a and b connect again; the servers dial
// again on their own (every second or so).
func (sc *Supercluster) Heal(a, b string) {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	delete(sc.cut, [2]string{a, b})
	delete(sc.cut, [2]string{b, a})
	sc.Link(a, b).SetDown(false)
	sc.Link(b, a).SetDown(false)
}

// SetDelay sets the one-way delay between regions a and b, both ways, on
// the gateway connections open now and those to come: a spend published
// in a reaches b's servers oneWay later (the gateways' connect handshake
// excepted: the INFO a server sends first goes at once).
func (sc *Supercluster) SetDelay(a, b string, oneWay time.Duration) {
	sc.Link(a, b).SetDelay(wanproxy.Both, oneWay)
	sc.Link(b, a).SetDelay(wanproxy.Both, oneWay)
}

// Link returns the link that carries the gateway connections the servers
// of from dial to those of to: its ClientToTarget direction carries what
// from sends to, TargetToClient the answers. The connections to dialed
// from to carry the rest (Link(to, from)); a one-way cut or a delay of
// one direction alone is set on both. It fails on a region not of the
// supercluster.
func (sc *Supercluster) Link(from, to string) *wanproxy.Link {
	l, ok := sc.links[[2]string{from, to}]
	if !ok {
		panic(fmt.Sprintf("natstest: no link from %q to %q", from, to))
	}
	return l
}

// Severed reports whether the gateways between a and b are cut.
func (sc *Supercluster) Severed(a, b string) bool {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	return sc.cut[[2]string{a, b}]
}

// WaitReady waits until every running server is healthy (JetStream
// current), has an outbound gateway to every other region that is not cut
// off from its own, and knows the JetStream meta leader.
func (sc *Supercluster) WaitReady(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(superReadyTimeout)
	for {
		err := sc.ready()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			var tails strings.Builder
			for _, r := range sc.regions {
				for _, s := range sc.servers[r] {
					tails.WriteString(s.logTail())
				}
			}
			t.Fatalf("natstest: nats supercluster not ready after %v: %v\n%s", superReadyTimeout, err, tails.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (sc *Supercluster) ready() error {
	client := &http.Client{Timeout: time.Second}
	get := func(s *Server, path string, v any) error {
		resp, err := client.Get(fmt.Sprintf("http://127.0.0.1:%d%s", s.monitor, path))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
			return fmt.Errorf("%s: %s %s", path, resp.Status, body)
		}
		if v == nil {
			return nil
		}
		return json.NewDecoder(resp.Body).Decode(v)
	}
	for _, r := range sc.regions {
		for _, s := range sc.servers[r] {
			if s.Pid() == 0 {
				continue
			}
			if err := get(s, "/healthz", nil); err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
			var gw struct {
				Outbound map[string]json.RawMessage `json:"outbound_gateways"`
			}
			if err := get(s, "/gatewayz", &gw); err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
			for _, other := range sc.regions {
				if _, ok := gw.Outbound[other]; other != r && !sc.Severed(r, other) && !ok {
					return fmt.Errorf("%s: no gateway to %s yet", s.name, other)
				}
			}
			var jsz struct {
				Meta struct {
					Leader string `json:"leader"`
				} `json:"meta_cluster"`
			}
			if err := get(s, "/jsz", &jsz); err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
			if jsz.Meta.Leader == "" {
				return fmt.Errorf("%s: no JetStream meta leader yet", s.name)
			}
		}
	}
	return nil
}

func (sc *Supercluster) closeProxies() {
	for _, gp := range sc.proxies {
		gp.Close()
	}
}

// newGatewayProxy puts the gateway port of a server of region behind a
// natsgateway.Proxy: each connection a server of another region dials is
// carried over that pair's link, which is down while the two are cut.
func newGatewayProxy(sc *Supercluster, region string, gatewayPort int) (*natsgateway.Proxy, error) {
	return natsgateway.Listen("127.0.0.1:0", net.JoinHostPort("127.0.0.1", strconv.Itoa(gatewayPort)), func(from string) *wanproxy.Link {
		return sc.links[[2]string{from, region}] // nil, so refused, for an unknown cluster
	})
}
