// Package scale holds the scale model (`make scale`, TestScale): the spend
// stream of several regions' limiterd fleets, made by synthetic publishers
// (spendpub's own, fed Zipf traffic), carried by real NATS superclusters,
// reconcilers and Redis Clusters, and what reconciliation costs each
// region: debit scripts, Redis and reconciler CPU against the Redis CPU
// the same checks cost, messages and bytes per link, apply lag, and how
// far each key's unpublished spend stays within its budget. The package
// has no code of its own outside its tests.
package scale
