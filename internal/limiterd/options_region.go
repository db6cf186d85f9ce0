package limiterd

import (
	"errors"
	"flag"
	"regexp"
	"time"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/internal/topowatch"
	"github.com/limiterd/limiterd/pkg/region"
)

var instancePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)

// RegionOptions are this instance's place: its region and fleet, and the
// peer regions it forwards pinned rules' checks to.
type RegionOptions struct {
	// Name is this instance's region name.
	Name string
	// Instance names this limiterd in its region's fleet and in spend
	// messages; default host-pid.
	Instance string
	// FleetSize, when > 0, is the number of limiterd instances sharing a
	// region's limits: a fail-open rule whose store is down decides here
	// with limit / FleetSize. 0: the live count, from a heartbeat in the
	// region's Redis (the last count seen holds through an outage).
	FleetSize int

	// TopologyFile lists the regions and their limiterd addresses, for
	// forwarding checks of pinned rules to a key's home region.
	TopologyFile string
	// TopologyPoll is how often TopologyFile is read again (0:
	// topowatch.DefaultPoll).
	TopologyPoll time.Duration
	// ForwardTimeout bounds a check forwarded to the home region.
	ForwardTimeout time.Duration
	// HandoffMaxWindow caps the handoff window of moved pinned keys (0:
	// each rule's own).
	HandoffMaxWindow time.Duration
	// ForwardTLSCAFile enables TLS to other regions' limiterd, trusting
	// this CA; the gRPC listener's certificate, if any, is the client's.
	ForwardTLSCAFile string
	// PeerSecretFile holds the secret that peer regions share: sent with
	// every check forwarded to a home region, required of every call to
	// the Peer service (unless the caller's certificate is allowed by
	// PeerIdentities). One of the two is required with TopologyFile.
	PeerSecretFile string
	// PeerIdentities are the client certificate identities (DNS or URI
	// SAN, or common name) of peer regions' limiterd, verified by the
	// listener's --grpc.tls-client-ca-file.
	PeerIdentities []string
}

// RegisterFlags defines r's flags on fs, with DefaultOptions' defaults.
func (r *RegionOptions) RegisterFlags(fs *flag.FlagSet) {
	d := DefaultOptions().Region
	fs.StringVar(&r.Name, "region", d.Name, "name of this region")
	fs.StringVar(&r.Instance, "instance", d.Instance, "name of this instance in spend messages (default: host name and pid)")
	fs.IntVar(&r.FleetSize, "fleet.size", d.FleetSize, "limiterd instances in this region: fail-open rules whose store is down decide with limit / fleet.size (0: the live count, by a heartbeat in Redis)")
	fs.StringVar(&r.TopologyFile, "region.topology-file", d.TopologyFile, "YAML list of regions and their limiterd addresses, for pinned rules")
	fs.DurationVar(&r.TopologyPoll, "region.topology-poll", d.TopologyPoll, "how often --region.topology-file is read again; a changed file is checked and put in force at its effective_at")
	fs.DurationVar(&r.ForwardTimeout, "region.forward-timeout", d.ForwardTimeout, "deadline of a check forwarded to a key's home region")
	fs.DurationVar(&r.HandoffMaxWindow, "region.handoff-max-window", d.HandoffMaxWindow, "the longest a pinned key moved here by a topology switch or a home_keys change takes its old home's bucket (0: each rule's own handoff window); past it the key starts from a full bucket")
	fs.StringVar(&r.ForwardTLSCAFile, "region.forward-tls-ca-file", d.ForwardTLSCAFile, "CA bundle of other regions' limiterd: forward pinned checks over TLS")
	fs.StringVar(&r.PeerSecretFile, "region.peer-secret-file", d.PeerSecretFile, "file holding the secret peer regions share (mode 0600, at least 16 characters): sent with forwarded checks, required of Peer calls")
	fs.Var(redisstore.AddrsFlag{Addrs: &r.PeerIdentities}, "region.peer-identities", "comma-separated client certificate identities (DNS/URI SAN or CN) of peer regions' limiterd, allowed to call the Peer service (needs --grpc.tls-client-ca-file)")
}

// Validate reports every bad field, each naming its flag.
func (r RegionOptions) Validate() error {
	var e flagErrs
	err := region.ValidateName(r.Name)
	e.add(err != nil, "--region: %w", err)
	e.add(!instancePattern.MatchString(r.Instance) || len(r.Instance) > 100, "--instance: %q must match %s", r.Instance, instancePattern)
	e.add(r.FleetSize < 0 || r.FleetSize > 100_000, "--fleet.size: must be 0 (the live count) to 100000, got %d", r.FleetSize)
	e.add(r.TopologyFile != "" && r.PeerSecretFile == "" && len(r.PeerIdentities) == 0, "--region.peer-secret-file or --region.peer-identities: one is required with --region.topology-file, so that only peer regions may decide pinned rules' checks")
	e.add(r.TopologyPoll < topowatch.MinPoll || r.TopologyPoll > topowatch.MaxPoll, "--region.topology-poll: must be in [%v, %v], got %v", topowatch.MinPoll, topowatch.MaxPoll, r.TopologyPoll)
	e.add(r.ForwardTimeout < 0 || r.ForwardTimeout > time.Minute, "--region.forward-timeout: must be in (0, 1m], got %v", r.ForwardTimeout)
	e.add(r.HandoffMaxWindow != 0 && (r.HandoffMaxWindow < time.Second || r.HandoffMaxWindow > 30*24*time.Hour), "--region.handoff-max-window: must be 0 (each rule's own window) or in [1s, 720h], got %v", r.HandoffMaxWindow)
	return errors.Join(e...)
}
