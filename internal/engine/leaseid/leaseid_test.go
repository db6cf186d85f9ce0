package leaseid

import (
	"encoding/base64"
	"errors"
	"slices"
	"testing"

	"github.com/limiterd/limiterd/pkg/bucket"
)

// leaseIDV1 is a lease id of version 1: one region and one set of flags
// for every part.
func leaseIDV1(region string, flags byte, rule, key string) string {
	b := []byte{VersionV1, byte(len(region))}
	b = append(b, region...)
	b = append(b, flags)
	b = append(b, make([]byte, NonceLen)...)
	b = append(b, 1, byte(len(rule)))
	b = append(b, rule...)
	b = append(b, byte(len(key)))
	b = append(b, key...)
	return base64.RawURLEncoding.EncodeToString(b)
}

// TestLeaseIDVersions: a version 1 id (every part in its one region) is
// still read; a version 2 id names each part's region and round-trips.
func TestLeaseIDVersions(t *testing.T) {
	id, err := Parse(leaseIDV1("eu", Fallback, "r", "k"))
	if err != nil {
		t.Fatal(err)
	}
	if want := (Part{Rule: "r", Key: "k", Region: "eu", Flags: Fallback}); len(id.Parts) != 1 || id.Parts[0] != want {
		t.Fatalf("v1 parts = %+v, want %+v", id.Parts, want)
	}
	v2 := New("eu", 7, []Part{{Rule: "r", Key: "k", Region: "eu"}, {Rule: "p", Key: "k2", Region: "us", Flags: Regional}})
	back, err := Parse(v2.String())
	if err != nil {
		t.Fatal(err)
	}
	if back.Gen != 7 || back.Region != "eu" || back.Member() != v2.Member() || !slices.Equal(back.Parts, v2.Parts) {
		t.Fatalf("round trip = %+v, want %+v", back, v2)
	}
}

func FuzzParseLeaseID(f *testing.F) {
	f.Add(New("eu", 3, []Part{{Rule: "r", Key: "k", Region: "eu"}, {Rule: "p", Key: "k", Region: "us", Flags: Fallback}}).String())
	f.Add(leaseIDV1("eu", Fallback, "r", "k"))
	f.Add("")
	f.Fuzz(func(t *testing.T, s string) {
		id, err := Parse(s)
		if err != nil {
			if !errors.Is(err, ErrLeaseID) || !errors.Is(err, bucket.ErrInvalidLease) {
				t.Fatalf("error %v", err)
			}
			return
		}
		if back, err := Parse(id.String()); err != nil || back.String() != id.String() {
			t.Fatalf("round trip of %q: %v", s, err)
		}
	})
}
