// Package region describes the regions of a deployment and pins keys to a home region.
//
// A topology file lists the regions and the gRPC address of each region's
// limiterd:
//
//	generation: 2                      # optional, default 0
//	effective_at: 2026-05-01T12:00:00Z # optional, RFC 3339
//	previous_regions: [us-east]        # optional, needs effective_at
//	regions:
//	  - name: us-east
//	    limiter_address: 127.0.0.1:8081
//	  - name: eu-west
//	    limiter_address: 127.0.0.1:8082
//
// A file replaced at run time must raise generation to change the regions
// or their addresses ([Topology.CheckNext]); effective_at is the instant
// every process switches to it, each by its own clock. previous_regions
// names the regions of the generation it replaces, so that a process that
// starts on it knows where the keys it moved were homed before
// ([Topology.Previous]).
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
	"time"
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
		return fmt.Errorf("limiter_address: %q is not host:port: %w", r.LimiterAddress, err)
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
	generation  uint64
	effectiveAt time.Time
	previous    []string       // previous_regions, as written
	regions     []Region       // file order
	byName      map[string]int // name -> index in regions
	names       []string       // sorted
	seeds       []uint64       // seeds[i]: FNV-1a state after names[i] + "\x00"
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

// Generation is the file's generation (0 when it has none). A later file
// that changes the regions or their addresses must have a higher one.
func (t *Topology) Generation() uint64 { return t.generation }

// EffectiveAt is the instant the topology takes effect, as the file's
// effective_at gives it; the zero time when it has none (at once).
func (t *Topology) EffectiveAt() time.Time { return t.effectiveAt }

// Previous is the topology of the generation this one replaced, as the
// file's previous_regions names it, for Home only: its regions have the
// addresses this topology gives them, none for a region it no longer has.
// Nil when the file has no previous_regions.
func (t *Topology) Previous() *Topology {
	if len(t.previous) == 0 {
		return nil
	}
	p := &Topology{byName: make(map[string]int, len(t.previous)), names: slices.Clone(t.previous)}
	for i, n := range t.previous {
		r, _ := t.Region(n)
		r.Name = n
		p.regions = append(p.regions, r)
		p.byName[n] = i
	}
	slices.Sort(p.names)
	p.seeds = seedsOf(p.names)
	return p
}

// SameRegions reports whether t and o have the same regions with the same
// addresses, in any order.
func (t *Topology) SameRegions(o *Topology) bool {
	if len(t.regions) != len(o.regions) {
		return false
	}
	for _, r := range t.regions {
		if or, ok := o.Region(r.Name); !ok || or != r {
			return false
		}
	}
	return true
}

// Errors of [Topology.CheckNext]; both wrap [ErrInvalid].
var (
	// ErrGenerationLower: a topology whose generation is lower than the one
	// it would replace.
	ErrGenerationLower = fmt.Errorf("%w: generation lower than the one in force", ErrInvalid)
	// ErrGenerationNotRaised: a topology that changes the regions or their
	// addresses and keeps the generation of the one it would replace.
	ErrGenerationNotRaised = fmt.Errorf("%w: regions changed without a higher generation", ErrInvalid)
)

// CheckNext reports whether next may replace t: its generation is not
// lower, and it is higher if the regions or their addresses differ. The
// error names the field and wraps ErrGenerationLower or
// ErrGenerationNotRaised.
func (t *Topology) CheckNext(next *Topology) error {
	switch {
	case next.generation < t.generation:
		return fmt.Errorf("%w: generation: %d is lower than %d", ErrGenerationLower, next.generation, t.generation)
	case next.generation == t.generation && !t.SameRegions(next):
		return fmt.Errorf("%w: generation: %d, as before, but regions differ (%s); raise generation to change them",
			ErrGenerationNotRaised, next.generation, t.diff(next))
	}
	return nil
}

// diff says how next's regions differ from t's, for errors and logs.
func (t *Topology) diff(next *Topology) string {
	var parts []string
	for _, r := range next.regions {
		if old, ok := t.Region(r.Name); !ok {
			parts = append(parts, r.Name+" added")
		} else if old.LimiterAddress != r.LimiterAddress {
			parts = append(parts, r.Name+".limiter_address changed")
		}
	}
	for _, r := range t.regions {
		if !next.Has(r.Name) {
			parts = append(parts, r.Name+" removed")
		}
	}
	return strings.Join(parts, ", ")
}

type file struct {
	// Generation and EffectiveAt are decoded by hand, so that their errors
	// name them.
	Generation      yaml.Node `yaml:"generation"`
	EffectiveAt     yaml.Node `yaml:"effective_at"`
	PreviousRegions []string  `yaml:"previous_regions"`
	Regions         []Region  `yaml:"regions"`
}

// header decodes the generation and effective_at of f.
func (f *file) header() (gen uint64, at time.Time, err error) {
	if f.Generation.Kind != 0 {
		var n int64
		if f.Generation.Kind != yaml.ScalarNode || f.Generation.Tag != "!!int" || f.Generation.Decode(&n) != nil || n < 0 {
			return 0, time.Time{}, fmt.Errorf("%w: generation: %q is not a non-negative integer", ErrInvalid, f.Generation.Value)
		}
		gen = uint64(n)
	}
	if f.EffectiveAt.Kind != 0 {
		var s string
		if f.EffectiveAt.Kind != yaml.ScalarNode || f.EffectiveAt.Decode(&s) != nil {
			return 0, time.Time{}, fmt.Errorf("%w: effective_at: not an RFC 3339 time", ErrInvalid)
		}
		if at, err = time.Parse(time.RFC3339, s); err != nil {
			return 0, time.Time{}, fmt.Errorf("%w: effective_at: %q is not an RFC 3339 time (2026-05-01T12:00:00Z)", ErrInvalid, s)
		}
	}
	return gen, at, nil
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
		return nil, fmt.Errorf("%s: %w: %w", name, ErrInvalid, err)
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s: %w: more than one YAML document", name, ErrInvalid)
	}
	gen, at, err := f.header()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	t, err := New(f.Regions)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	t.generation, t.effectiveAt = gen, at
	if err := t.setPrevious(f.PreviousRegions); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return t, nil
}

// setPrevious checks and keeps a file's previous_regions: valid names,
// each once, and an effective_at to count the handoff from.
func (t *Topology) setPrevious(names []string) error {
	if len(names) == 0 {
		return nil
	}
	if t.effectiveAt.IsZero() {
		return fmt.Errorf("%w: previous_regions: needs effective_at, the instant the keys it moved changed home", ErrInvalid)
	}
	for i, n := range names {
		if err := ValidateName(n); err != nil {
			return fmt.Errorf("%w: previous_regions[%d]: %w", ErrInvalid, i, err)
		}
		if j := slices.Index(names[:i], n); j >= 0 {
			return fmt.Errorf("%w: previous_regions[%d] (%q): already listed as previous_regions[%d]", ErrInvalid, i, n, j)
		}
	}
	t.previous = slices.Clone(names)
	return nil
}

// New builds a topology of generation 0 from regions, validated as [Parse]
// does. It copies regions; errors wrap [ErrInvalid].
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
			return nil, fmt.Errorf("%w: regions[%d] (name %q): %w", ErrInvalid, i, r.Name, err)
		}
		if j, dup := t.byName[r.Name]; dup {
			return nil, fmt.Errorf("%w: regions[%d] (name %q): name: already used by regions[%d]", ErrInvalid, i, r.Name, j)
		}
		t.byName[r.Name] = i
		t.names = append(t.names, r.Name)
	}
	slices.Sort(t.names)
	t.seeds = seedsOf(t.names)
	return t, nil
}

// seedsOf are the hash states of names for Home.
func seedsOf(names []string) []uint64 {
	seeds := make([]uint64, len(names))
	for i, n := range names {
		seeds[i] = fnv1a(fnv1a(fnvOffset64, n), "\x00")
	}
	return seeds
}
