package engine

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// Bounds of a lease id.
const (
	// MaxLeasesPerCheck bounds the concurrency rules one Acquire holds
	// leases of (all named in its one lease id).
	MaxLeasesPerCheck = 8
	// MaxLeaseIDLen bounds a lease id's text: MaxLeasesPerCheck rules of
	// the longest ids and keys.
	MaxLeaseIDLen = 8 << 10
	// leaseNonceLen is the random part of a lease id, its member in every
	// lease set: 128 bits, never guessed.
	leaseNonceLen = 16
	// leaseIDVersion 2 names the region holding each part; version 1 (one
	// region for every part, flags for all) is still read.
	leaseIDVersion   = 2
	leaseIDVersionV1 = 1
	// partFallback marks a lease taken in the holding instance's fallback
	// store while its shared store was down.
	partFallback = 1
	// partRegional marks a lease of a pinned rule held in the region of
	// the Acquire, with its share of the limit (limit / regions), because
	// the key's home region did not answer.
	partRegional = 2
)

// ErrLeaseID: a lease id that is malformed (its *InvalidError names
// lease_id).
var ErrLeaseID = fmt.Errorf("lease_id: %w", bucket.ErrInvalidLease)

// leaseID is what a lease id carries: where each of its leases is held and
// which (rule, key) sets hold them, so that Release and Renew find them
// without a table (through any region: a part held elsewhere is forwarded
// there), the topology generation the Acquire was routed with, and the
// random member that no other caller can guess.
type leaseID struct {
	// region is the region of the Acquire; gen the generation of the
	// topology it was routed with (0: none).
	region string
	gen    uint64
	nonce  [leaseNonceLen]byte
	parts  []leasePart
}

// leasePart is one concurrency rule's lease: held in region, in the store
// its flags say.
type leasePart struct {
	rule, key string
	region    string
	flags     byte
}

// member is the lease's member in every set that holds it.
func (id *leaseID) member() string { return base64.RawURLEncoding.EncodeToString(id.nonce[:]) }

func newLeaseID(region string, gen uint64, parts []leasePart) *leaseID {
	id := &leaseID{region: region, gen: gen, parts: parts}
	rand.Read(id.nonce[:]) // never fails (crypto/rand)
	return id
}

// String is the lease id as callers see it: base64url of version, region,
// generation, nonce and each part's holding region (empty: the id's
// region), flags, rule and key, each with its length.
func (id *leaseID) String() string {
	b := []byte{leaseIDVersion, byte(len(id.region))}
	b = append(b, id.region...)
	b = binary.AppendUvarint(b, id.gen)
	b = append(b, id.nonce[:]...)
	b = append(b, byte(len(id.parts)))
	for _, p := range id.parts {
		held := p.region
		if held == id.region {
			held = ""
		}
		b = append(b, byte(len(held)))
		b = append(b, held...)
		b = append(b, p.flags)
		b = append(b, byte(len(p.rule)))
		b = append(b, p.rule...)
		b = binary.AppendUvarint(b, uint64(len(p.key)))
		b = append(b, p.key...)
	}
	return base64.RawURLEncoding.EncodeToString(b)
}

// parseLeaseID reads a lease id from a caller: external input. Its errors
// are an *InvalidError of lease_id wrapping bucket.ErrInvalidLease.
func parseLeaseID(s string) (*leaseID, error) {
	bad := func(format string, args ...any) error {
		return &InvalidError{Field: "lease_id", Err: fmt.Errorf("%w: %s", ErrLeaseID, fmt.Sprintf(format, args...))}
	}
	if s == "" {
		return nil, bad("empty")
	}
	if len(s) > MaxLeaseIDLen {
		return nil, bad("%d bytes, the most is %d", len(s), MaxLeaseIDLen)
	}
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return nil, bad("not base64url")
	}
	r := reader{b: b}
	v := r.byte()
	if v != leaseIDVersion && v != leaseIDVersionV1 {
		return nil, bad("not a lease id of this limiterd (version %d)", v)
	}
	id := &leaseID{region: string(r.bytes(int(r.byte())))}
	var flags byte // version 1: one set of flags for every part
	if v == leaseIDVersionV1 {
		flags = r.byte()
	} else {
		id.gen = r.uvarint()
	}
	copy(id.nonce[:], r.bytes(leaseNonceLen))
	n := int(r.byte())
	if r.err == nil && (n < 1 || n > MaxLeasesPerCheck) {
		return nil, bad("%d rules, want 1 to %d", n, MaxLeasesPerCheck)
	}
	for range n {
		p := leasePart{region: id.region, flags: flags}
		if v == leaseIDVersion {
			if held := string(r.bytes(int(r.byte()))); held != "" {
				p.region = held
			}
			p.flags = r.byte()
		}
		p.rule = string(r.bytes(int(r.byte())))
		kl := r.uvarint()
		if r.err == nil && kl > bucket.MaxKeyLen {
			r.err = errors.New("bad key length")
		}
		p.key = string(r.bytes(int(kl)))
		if r.err != nil {
			break
		}
		if p.rule == "" || bucket.ValidateKey(p.key) != nil {
			r.err = errors.New("empty rule or key")
			break
		}
		if p.flags&^(partFallback|partRegional) != 0 {
			return nil, bad("unknown flags")
		}
		id.parts = append(id.parts, p)
	}
	switch {
	case r.err != nil:
		return nil, bad("truncated or malformed")
	case len(r.b) != 0:
		return nil, bad("%d bytes after its end", len(r.b))
	}
	return id, nil
}

// reader reads a lease id's bytes; past the end it keeps an error.
type reader struct {
	b   []byte
	err error
}

func (r *reader) byte() byte {
	if len(r.b) < 1 {
		r.err = errors.New("short")
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *reader) uvarint() uint64 {
	v, k := binary.Uvarint(r.b)
	if k <= 0 {
		r.err = errors.New("bad varint")
		r.b = nil
		return 0
	}
	r.b = r.b[k:]
	return v
}

func (r *reader) bytes(n int) []byte {
	if len(r.b) < n {
		r.err = errors.New("short")
		r.b = nil
		return nil
	}
	out := r.b[:n]
	r.b = r.b[n:]
	return out
}
