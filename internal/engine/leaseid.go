package engine

import "github.com/limiterd/limiterd/internal/engine/leaseid"

// Bounds of a lease id (see leaseid).
const (
	// MaxLeasesPerCheck bounds the concurrency rules one Acquire holds
	// leases of (all named in its one lease id).
	MaxLeasesPerCheck = leaseid.MaxParts
	// MaxLeaseIDLen bounds a lease id's text.
	MaxLeaseIDLen = leaseid.MaxLen
)

// ErrLeaseID: a lease id that is malformed (its *InvalidError names
// lease_id).
var ErrLeaseID = leaseid.ErrLeaseID

// parseLeaseID reads a lease id from a caller. Its errors are an
// *InvalidError of lease_id wrapping bucket.ErrInvalidLease.
func parseLeaseID(s string) (*leaseid.ID, error) {
	id, err := leaseid.Parse(s)
	if err != nil {
		return nil, &InvalidError{Field: "lease_id", Err: err}
	}
	return id, nil
}
