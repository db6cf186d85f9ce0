package engine

import (
	"github.com/limiterd/limiterd/internal/engine/leaseid"
	"github.com/limiterd/limiterd/internal/engine/request"
)

// parseLeaseID reads a lease id from a caller. Its errors are an
// *InvalidError of lease_id wrapping bucket.ErrInvalidLease.
func parseLeaseID(s string) (*leaseid.ID, error) {
	id, err := leaseid.Parse(s)
	if err != nil {
		return nil, &request.InvalidError{Field: "lease_id", Err: err}
	}
	return id, nil
}
