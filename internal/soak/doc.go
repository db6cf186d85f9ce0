// Package soak holds the chaos soak (`make soak`, TestSoak): three regions
// of real servers under Zipf traffic while faults are injected at random,
// then an audit of what the regions recorded. The package has no code of
// its own outside its tests.
package soak
