// Package lua holds the Redis scripts of every algorithm and composes them
// into the scripts the store loads.
//
// Each algorithm file defines one local function with the same signature,
// take(key, capacity, rate_or_window_us, cost, now) returning allowed,
// remaining, retry_us, reset_us and, when allowed, a commit function that
// writes the new state. The remaining is what the scripts reply: for a
// window a string, for a sliding log an integer, for a token bucket or GCRA
// the time (ns) until the bucket is full again (bucket.Limit.Remaining makes
// the tokens left of it). A script is a clock, the shared helpers, the
// algorithm and a main part; deciding before writing is what lets one
// script check several rules all or nothing.
package lua

import (
	"embed"
	"fmt"
	"strings"
)

//go:embed *.lua
var files embed.FS

// Algorithms are the names of the algorithm files, without ".lua".
var Algorithms = []string{"token_bucket", "gcra", "sliding_window", "sliding_log", "fixed_window"}

// Clock selects how a script reads the time.
type Clock int

const (
	// StoreClock reads Redis's TIME: what production scripts use.
	StoreClock Clock = iota
	// FixedClock reads the instant (µs) from the last ARGV, for tests that
	// step through fixed instants.
	FixedClock
)

// Single returns the script that checks one rule of the named algorithm:
// KEYS[1] the bucket, ARGV capacity, rate (tokens/s) or window (µs), cost,
// and with FixedClock the instant. It replies {allowed, remaining (see the
// package comment), retry_us, reset_us}.
func Single(algorithm string, clock Clock) (string, error) {
	alg, err := read(algorithm)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	b.WriteString(mustRead(clockFile(clock)))
	b.WriteString(mustRead("lib"))
	for _, h := range helpers[algorithm] {
		b.WriteString(mustRead(h))
	}
	b.WriteString(alg)
	fmt.Fprintf(&b, "local take = %s\n", algorithm)
	b.WriteString(mustRead("single"))
	return b.String(), nil
}

// helpers are the helper files each algorithm needs besides lib. A script
// defines each of its functions again on every call, so the check scripts
// hold only their own.
var helpers = map[string][]string{
	"token_bucket":   {"hold", "instant"},
	"gcra":           {"hold", "instant"},
	"sliding_window": {"hold", "window"},
	"fixed_window":   {"hold", "window"},
}

// Handoff returns the script that hands a pinned key's buckets to its new
// home region at a topology switch (see handoff.lua for its operations,
// keys and arguments).
func Handoff(clock Clock) string { return withAll(clock, "debit") + mustRead("handoff") }

// Settle returns the script that settles a spend made as an estimate with
// its actual cost, once (see settle.lua).
func Settle(clock Clock) string {
	return withAll(clock, "debit") + mustRead("undo_lib") + mustRead("settle")
}

// Debit returns the script that applies one source region's spends for one
// client at most once (see debit_main.lua for its keys and arguments).
func Debit(clock Clock) string {
	return withAll(clock, "debit") + mustRead("undo_lib") + mustRead("hold_record") + mustRead("debit_client") + mustRead("debit_main")
}

// DebitBatch returns the script that applies one source region's spends
// for several clients of one node, each at most once, in one call (see
// debit_batch_main.lua for its keys and arguments). A script defines its
// functions again on every call: one call for many clients pays that
// once.
func DebitBatch(clock Clock) string {
	return withAll(clock, "debit") + mustRead("undo_lib") + mustRead("hold_record") + mustRead("debit_client") + mustRead("debit_batch_main")
}

// Seen returns the script that records the first stream sequence of a
// spend message (see seen.lua); it reads no clock and no helper.
func Seen() string { return mustRead("seen") }

// SeenBatch returns the script that records the first stream sequence of
// several spend messages whose records are on one node (see
// seen_batch.lua).
func SeenBatch() string { return mustRead("seen_batch") }

// PartitionPosition returns the script that moves a partition's applied
// position forward, never back (see partition_position.lua).
func PartitionPosition() string { return mustRead("partition_position") }

// Multi returns the script that checks several rules of one client all or
// nothing (see multi_main.lua).
func Multi(clock Clock) string { return withAll(clock, "multi_main") }

// Usage returns the script that reads what a check of several rules would
// see now, changing nothing (see usage.lua).
func Usage(clock Clock) string { return withAll(clock, "usage") }

// LeaseUsage returns the script that reads the leases of concurrency rules
// held now, changing nothing (see lease_usage.lua).
func LeaseUsage(clock Clock) string {
	return mustRead(clockFile(clock)) + mustRead("lib") + mustRead("leases") + mustRead("lease_usage")
}

// Undo returns the script that gives back the spends of an all-or-nothing
// check refused by another client slot (see undo.lua).
func Undo(clock Clock) string { return withAll(clock, "undo_lib") + mustRead("undo") }

// withAll is a clock, every helper, every algorithm, then main.
func withAll(clock Clock, main string) string {
	var b strings.Builder
	b.WriteString(mustRead(clockFile(clock)))
	b.WriteString(mustRead("lib"))
	b.WriteString(mustRead("hold"))
	b.WriteString(mustRead("instant"))
	b.WriteString(mustRead("window"))
	for _, a := range Algorithms {
		b.WriteString(mustRead(a))
	}
	b.WriteString(mustRead(main))
	return b.String()
}

// Reserve returns the script that reserves the slot of a paced request on
// several token bucket or GCRA rules of one client (see reserve_main.lua).
func Reserve(clock Clock) string { return withInstant(clock, "reserve_main") }

// Unreserve returns the script that gives a paced request's reservation
// back while nothing was spent after it (see unreserve.lua).
func Unreserve(clock Clock) string { return withInstant(clock, "unreserve") }

// withInstant is a clock, lib, the token bucket's helpers (its hold
// among them), then main.
func withInstant(clock Clock, main string) string {
	return mustRead(clockFile(clock)) + mustRead("lib") + mustRead("hold") + mustRead("instant") + mustRead(main)
}

// Refund returns the script that gives leased tokens back to a token
// bucket or GCRA (see refund.lua). It reads the state with the algorithms'
// own functions, so it is composed like Multi.
func Refund(clock Clock) string { return withAll(clock, "refund") }

// Lease operations of concurrency rules, one script each.
const (
	LeaseAcquire = "acquire"
	LeaseRelease = "release"
	LeaseRenew   = "renew"
)

// Lease returns the script of a lease operation of concurrency rules
// (LeaseAcquire, LeaseRelease or LeaseRenew; see leases.lua and the
// operation's file for keys, arguments and reply): a clock, lib, the lease
// helpers and the operation.
func Lease(op string, clock Clock) string {
	switch op {
	case LeaseAcquire, LeaseRelease, LeaseRenew:
	default:
		panic("lua: no lease operation " + op)
	}
	return mustRead(clockFile(clock)) + mustRead("lib") + mustRead("leases") + mustRead(op)
}

func clockFile(c Clock) string {
	if c == FixedClock {
		return "clock_fixed"
	}
	return "clock"
}

func read(name string) (string, error) {
	for _, a := range Algorithms {
		if a == name {
			return mustRead(name), nil
		}
	}
	return "", fmt.Errorf("no script for algorithm %q", name)
}

func mustRead(name string) string {
	b, err := files.ReadFile(name + ".lua")
	if err != nil {
		panic("lua: embedded script missing: " + name) // the embed pattern guarantees it
	}
	return string(b)
}
