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
	leaseNonceLen  = 16
	leaseIDVersion = 1
	// leaseFallback marks a lease taken in this instance's fallback store
	// while the shared store was down.
	leaseFallback = 1
)

// ErrLeaseID: a lease id that is malformed (its *InvalidError names
// lease_id).
var ErrLeaseID = fmt.Errorf("lease_id: %w", bucket.ErrInvalidLease)

// leaseID is what a lease id carries: where its leases are held and which
// (rule, key) sets hold them, so that Release and Renew find them without a
// table, and the random member that no other caller can guess.
type leaseID struct {
	region string
	flags  byte
	nonce  [leaseNonceLen]byte
	parts  []leasePart
}

type leasePart struct{ rule, key string }

// member is the lease's member in every set that holds it.
func (id *leaseID) member() string { return base64.RawURLEncoding.EncodeToString(id.nonce[:]) }

func newLeaseID(region string, parts []leasePart) *leaseID {
	id := &leaseID{region: region, parts: parts}
	rand.Read(id.nonce[:]) // never fails (crypto/rand)
	return id
}

// String is the lease id as callers see it: base64url of version, region,
// flags, nonce and each part's rule and key, each with its length.
func (id *leaseID) String() string {
	b := []byte{leaseIDVersion, byte(len(id.region))}
	b = append(b, id.region...)
	b = append(b, id.flags)
	b = append(b, id.nonce[:]...)
	b = append(b, byte(len(id.parts)))
	for _, p := range id.parts {
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
	if v := r.byte(); v != leaseIDVersion {
		return nil, bad("not a lease id of this limiterd (version %d)", v)
	}
	id := &leaseID{region: string(r.bytes(int(r.byte())))}
	id.flags = r.byte()
	copy(id.nonce[:], r.bytes(leaseNonceLen))
	n := int(r.byte())
	if r.err == nil && (n < 1 || n > MaxLeasesPerCheck) {
		return nil, bad("%d rules, want 1 to %d", n, MaxLeasesPerCheck)
	}
	for range n {
		rule := string(r.bytes(int(r.byte())))
		kl, k := binary.Uvarint(r.b)
		if k <= 0 || kl > bucket.MaxKeyLen {
			r.err = errors.New("bad key length")
			break
		}
		r.b = r.b[k:]
		key := string(r.bytes(int(kl)))
		if r.err == nil && (rule == "" || bucket.ValidateKey(key) != nil) {
			r.err = errors.New("empty rule or key")
		}
		id.parts = append(id.parts, leasePart{rule: rule, key: key})
	}
	switch {
	case r.err != nil:
		return nil, bad("truncated or malformed")
	case len(r.b) != 0:
		return nil, bad("%d bytes after its end", len(r.b))
	case id.flags&^leaseFallback != 0:
		return nil, bad("unknown flags")
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
