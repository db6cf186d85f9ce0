package region

import (
	"fmt"
	"slices"
)

// Home returns the home region of key.
//
// If explicit has key, Home returns explicit[key] as is: check the map once
// with [Topology.ValidateHomes]. Otherwise Home uses rendezvous (highest
// random weight) hashing: the home is the region with the highest weight
//
//	weight(name, key) = splitmix64(fnv1a64(name + "\x00" + key))
//
// where fnv1a64 is 64-bit FNV-1a (offset basis 0xcbf29ce484222325, prime
// 0x100000001b3) and splitmix64 is the finalizer of SplitMix64:
//
//	z ^= z >> 30; z *= 0xbf58476d1ce4e5b9
//	z ^= z >> 27; z *= 0x94d049bb133111eb
//	z ^= z >> 31
//
// A tie, which needs a 64-bit collision, goes to the byte-wise smaller name.
// The answer depends only on the set of region names and the key, never on
// the order of the regions in the file, so every process of a deployment
// agrees. Adding a region moves to it about 1/n of the keys and moves no key
// between the other regions; removing one moves only its keys.
//
// The weights are part of the wire contract between regions: changing them
// rehomes keys. Home does not allocate. It returns "" if the topology has no
// regions (the zero Topology) and key is not in explicit.
func (t *Topology) Home(key string, explicit map[string]string) string {
	if r, ok := explicit[key]; ok {
		return r
	}
	best := -1
	var bestW uint64
	for i, seed := range t.seeds {
		// names is sorted and the comparison strict, so ties go to the smaller name.
		if w := mix64(fnv1a(seed, key)); best < 0 || w > bestW {
			best, bestW = i, w
		}
	}
	if best < 0 {
		return ""
	}
	return t.names[best]
}

// ValidateHomes checks an explicit home map (key -> region name) against the
// topology: every key is non-empty and every region exists. The error names
// the first offending key in sorted order and wraps [ErrInvalid]. A nil or
// empty map is valid.
func (t *Topology) ValidateHomes(explicit map[string]string) error {
	keys := make([]string, 0, len(explicit))
	for k := range explicit {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		if k == "" {
			return fmt.Errorf("%w: explicit homes: empty key (home %q)", ErrInvalid, explicit[k])
		}
		if r := explicit[k]; !t.Has(r) {
			return fmt.Errorf("%w: explicit homes: key %q: region %q is not in the topology", ErrInvalid, k, r)
		}
	}
	return nil
}

const (
	fnvOffset64 = 0xcbf29ce484222325
	fnvPrime64  = 0x100000001b3
)

// fnv1a continues a 64-bit FNV-1a hash in state h over the bytes of s.
// Starting from fnvOffset64 it equals hash/fnv's New64a; it takes a string
// so that hashing a key does not allocate.
func fnv1a(h uint64, s string) uint64 {
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= fnvPrime64
	}
	return h
}

// mix64 is the SplitMix64 finalizer. FNV-1a avalanches poorly (the last
// byte of the key reaches the high bits through a single multiplication);
// the finalizer makes every input bit affect every output bit, so the
// comparison of weights does not pick up structure in names or keys.
func mix64(z uint64) uint64 {
	z ^= z >> 30
	z *= 0xbf58476d1ce4e5b9
	z ^= z >> 27
	z *= 0x94d049bb133111eb
	z ^= z >> 31
	return z
}
