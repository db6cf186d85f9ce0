// Package leaseid is the text of a concurrency lease id: where each of its
// leases is held and which (rule, key) sets hold them, so that a Release or
// a Renew finds them without a table, through any region; the topology
// generation the Acquire was routed with; and the random member no other
// caller can guess. It reads ids from callers (external input) strictly.
package leaseid

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
	// MaxParts bounds the concurrency rules one Acquire holds
	// leases of (all named in its one lease id).
	MaxParts = 8
	// MaxLen bounds a lease id's text: MaxParts rules of
	// the longest ids and keys.
	MaxLen = 8 << 10
	// NonceLen is the random part of a lease id, its member in every
	// lease set: 128 bits, never guessed.
	NonceLen = 16
	// Version 2 names the region holding each part; version 1 (one
	// region for every part, flags for all) is still read.
	Version   = 2
	VersionV1 = 1
	// Fallback marks a lease taken in the holding instance's fallback
	// store while its shared store was down.
	Fallback = 1
	// Regional marks a lease of a pinned rule held in the region of
	// the Acquire, with its share of the limit (limit / regions), because
	// the key's home region did not answer.
	Regional = 2
)

// ErrLeaseID: a lease id that is malformed.
var ErrLeaseID = fmt.Errorf("lease_id: %w", bucket.ErrInvalidLease)

// ID is what a lease id carries: where each of its leases is held and
// which (rule, key) sets hold them (a part held in another region is
// forwarded there), the topology generation the Acquire was routed with,
// and the random member that no other caller can guess.
type ID struct {
	// Region is the region of the Acquire; Gen the generation of the
	// topology it was routed with (0: none).
	Region string
	Gen    uint64
	Nonce  [NonceLen]byte
	Parts  []Part
}

// Part is one concurrency rule's lease: held in Region, in the store its
// Flags say.
type Part struct {
	Rule, Key string
	Region    string
	Flags     byte
}

// Member is the lease's member in every set that holds it.
func (id *ID) Member() string { return base64.RawURLEncoding.EncodeToString(id.Nonce[:]) }

// New is a lease id of an Acquire in region, routed with topology
// generation gen, holding parts, with a fresh random member.
func New(region string, gen uint64, parts []Part) *ID {
	id := &ID{Region: region, Gen: gen, Parts: parts}
	rand.Read(id.Nonce[:]) // never fails (crypto/rand)
	return id
}

// String is the lease id as callers see it: base64url of version, region,
// generation, nonce and each part's holding region (empty: the id's
// region), flags, rule and key, each with its length.
func (id *ID) String() string {
	b := []byte{Version, byte(len(id.Region))}
	b = append(b, id.Region...)
	b = binary.AppendUvarint(b, id.Gen)
	b = append(b, id.Nonce[:]...)
	b = append(b, byte(len(id.Parts)))
	for _, p := range id.Parts {
		held := p.Region
		if held == id.Region {
			held = ""
		}
		b = append(b, byte(len(held)))
		b = append(b, held...)
		b = append(b, p.Flags)
		b = append(b, byte(len(p.Rule)))
		b = append(b, p.Rule...)
		b = binary.AppendUvarint(b, uint64(len(p.Key)))
		b = append(b, p.Key...)
	}
	return base64.RawURLEncoding.EncodeToString(b)
}

// Parse reads a lease id from a caller: external input. Its errors wrap
// ErrLeaseID (and so bucket.ErrInvalidLease).
func Parse(s string) (*ID, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrLeaseID, fmt.Sprintf(format, args...))
	}
	if s == "" {
		return nil, bad("empty")
	}
	if len(s) > MaxLen {
		return nil, bad("%d bytes, the most is %d", len(s), MaxLen)
	}
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return nil, bad("not base64url")
	}
	r := reader{b: b}
	v := r.byte()
	if v != Version && v != VersionV1 {
		return nil, bad("not a lease id of this limiterd (version %d)", v)
	}
	id := &ID{Region: string(r.bytes(int(r.byte())))}
	var flags byte // version 1: one set of flags for every part
	if v == VersionV1 {
		flags = r.byte()
	} else {
		id.Gen = r.uvarint()
	}
	copy(id.Nonce[:], r.bytes(NonceLen))
	n := int(r.byte())
	if r.err == nil && (n < 1 || n > MaxParts) {
		return nil, bad("%d rules, want 1 to %d", n, MaxParts)
	}
	for range n {
		p := Part{Region: id.Region, Flags: flags}
		if v == Version {
			if held := string(r.bytes(int(r.byte()))); held != "" {
				p.Region = held
			}
			p.Flags = r.byte()
		}
		p.Rule = string(r.bytes(int(r.byte())))
		kl := r.uvarint()
		if r.err == nil && kl > bucket.MaxKeyLen {
			r.err = errors.New("bad key length")
		}
		p.Key = string(r.bytes(int(kl)))
		if r.err != nil {
			break
		}
		if p.Rule == "" || bucket.ValidateKey(p.Key) != nil {
			r.err = errors.New("empty rule or key")
			break
		}
		if p.Flags&^(Fallback|Regional) != 0 {
			return nil, bad("unknown flags")
		}
		id.Parts = append(id.Parts, p)
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
