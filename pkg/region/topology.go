// Package region describes the regions of a deployment and pins keys to a home region.
//
// A topology file lists the regions and the gRPC address of each region's
// limiterd:
//
//	regions:
//	  - name: us-east
//	    limiter_address: 127.0.0.1:8081
//	  - name: eu-west
//	    limiter_address: 127.0.0.1:8082
//
// Every process of a deployment loads the same set of regions, maybe listed in
// a different order, and [Topology.Home] gives each of them the same home
// region for the same key.
package region

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode"

	"go.yaml.in/yaml/v3"
)

// ErrInvalid wraps every error about the content of a topology, whether read
// from a file or given to [New], and about an explicit home map given to
// [Topology.ValidateHomes].
var ErrInvalid = errors.New("invalid topology")

// namePattern is the form of a region name: lower-case letters, digits and
// dashes, not starting with a dash, at most 63 bytes (a DNS label's length).
var namePattern = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,62}$`)

// ErrInvalidName: a region name not of the form namePattern describes.
var ErrInvalidName = errors.New("invalid region name")

// ValidateName reports whether name can name a region: 1 to 63 lower-case
// letters, digits and dashes, not starting with a dash. Its error wraps
// ErrInvalidName.
func ValidateName(name string) error {
	if !namePattern.MatchString(name) {
		return fmt.Errorf("%w: %q must match %s", ErrInvalidName, name, namePattern)
	}
	return nil
}

// Region is one region of a deployment, as written in a topology file.
type Region struct {
	// Name identifies the region, e.g. "us-east". It matches
	// ^[a-z0-9][a-z0-9-]{0,62}$ and is unique within a topology.
	Name string `yaml:"name"`
	// LimiterAddress is the host:port of the region's limiterd gRPC
	// service (a load balancer in production).
	LimiterAddress string `yaml:"limiter_address"`
}

// validate checks one region on its own; uniqueness is the topology's job.
func (r Region) validate() error {
	if err := ValidateName(r.Name); err != nil {
		return fmt.Errorf("name: %w", err)
	}
	if r.LimiterAddress == "" {
		return errors.New("limiter_address: missing")
	}
	host, port, err := net.SplitHostPort(r.LimiterAddress)
	if err != nil {
		return fmt.Errorf("limiter_address: %q is not host:port: %v", r.LimiterAddress, err)
	}
	if host == "" {
		// ":8081" would dial the local machine, never another region.
		return fmt.Errorf("limiter_address: %q has no host", r.LimiterAddress)
	}
	if strings.ContainsFunc(host, func(c rune) bool { return unicode.IsSpace(c) || unicode.IsControl(c) }) {
		return fmt.Errorf("limiter_address: host %q contains a space or a control character", host)
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 {
		return fmt.Errorf("limiter_address: port %q must be a number from 1 to 65535", port)
	}
	return nil
}

// Topology is a validated set of regions. A Topology is immutable and safe
// for concurrent use. The zero value has no regions: Home returns "" for
// every key not in the explicit map; use [Load], [Parse] or [New] to build one.
type Topology struct {
	regions []Region       // file order
	byName  map[string]int // name -> index in regions
	names   []string       // sorted
	seeds   []uint64       // seeds[i]: FNV-1a state after names[i] + "\x00"
}

// Regions returns the regions in file order. The caller may modify the
// returned slice.
func (t *Topology) Regions() []Region { return slices.Clone(t.regions) }

// Region returns the region called name, and whether there is one.
func (t *Topology) Region(name string) (Region, bool) {
	i, ok := t.byName[name]
	if !ok {
		return Region{}, false
	}
	return t.regions[i], true
}

// Names returns the region names in sorted (byte-wise) order. The caller may
// modify the returned slice.
func (t *Topology) Names() []string { return slices.Clone(t.names) }

// Has reports whether the topology has a region called name.
func (t *Topology) Has(name string) bool {
	_, ok := t.byName[name]
	return ok
}

type file struct {
	Regions []Region `yaml:"regions"`
}

// Load reads and validates a topology file.
func Load(path string) (*Topology, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(path, data)
}

// Parse decodes a topology file strictly (unknown keys and several YAML
// documents are errors) and validates every region. name is the file name
// used in errors. Errors name the file, the region and the field, and wrap
// [ErrInvalid].
func Parse(name string, data []byte) (*Topology, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var f file
	if err := dec.Decode(&f); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%s: %w: the file is empty", name, ErrInvalid)
		}
		return nil, fmt.Errorf("%s: %w: %v", name, ErrInvalid, err)
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s: %w: more than one YAML document", name, ErrInvalid)
	}
	t, err := New(f.Regions)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return t, nil
}

// New builds a topology from regions, validated as [Parse] does. It copies
// regions; errors wrap [ErrInvalid].
func New(regions []Region) (*Topology, error) {
	if len(regions) == 0 {
		return nil, fmt.Errorf("%w: regions: no regions", ErrInvalid)
	}
	t := &Topology{
		regions: slices.Clone(regions),
		byName:  make(map[string]int, len(regions)),
		names:   make([]string, 0, len(regions)),
	}
	for i, r := range t.regions {
		if err := r.validate(); err != nil {
			return nil, fmt.Errorf("%w: regions[%d] (name %q): %v", ErrInvalid, i, r.Name, err)
		}
		if j, dup := t.byName[r.Name]; dup {
			return nil, fmt.Errorf("%w: regions[%d] (name %q): name: already used by regions[%d]", ErrInvalid, i, r.Name, j)
		}
		t.byName[r.Name] = i
		t.names = append(t.names, r.Name)
	}
	slices.Sort(t.names)
	t.seeds = make([]uint64, len(t.names))
	for i, n := range t.names {
		t.seeds[i] = fnv1a(fnv1a(fnvOffset64, n), "\x00")
	}
	return t, nil
}
