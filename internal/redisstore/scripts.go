package redisstore

import (
	"fmt"

	"github.com/redis/go-redis/v9"

	"github.com/limiterd/limiterd/lua"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// The scripts the store runs, built once with the store's clock.
var (
	singleScripts = func() (out [len(scriptAlgorithms)]*redis.Script) {
		for i, a := range scriptAlgorithms {
			src, err := lua.Single(string(a), lua.StoreClock)
			if err != nil {
				panic(fmt.Sprintf("redisstore: %v", err)) // scriptAlgorithms names embedded files only
			}
			out[i] = redis.NewScript(src)
		}
		return out
	}()
	multiScript = redis.NewScript(lua.Multi(lua.StoreClock))
	undoScript  = redis.NewScript(lua.Undo(lua.StoreClock))
	debitScript = redis.NewScript(lua.Debit(lua.StoreClock))
	// debitBatchScript applies one or several messages to several clients
	// of a node.
	debitBatchScript = redis.NewScript(lua.DebitBatch(lua.StoreClock))
	refundScript     = redis.NewScript(lua.Refund(lua.StoreClock))
	settleScript     = redis.NewScript(lua.Settle(lua.StoreClock))
	seenScript       = redis.NewScript(lua.Seen())
	// seenBatchScript records several messages on one node.
	seenBatchScript = redis.NewScript(lua.SeenBatch())
	// handoffScript hands pinned keys' buckets to their new home region.
	handoffScript = redis.NewScript(lua.Handoff(lua.StoreClock))
	// usageScript and leaseUsageScript read without writing.
	usageScript      = redis.NewScript(lua.Usage(lua.StoreClock))
	leaseUsageScript = redis.NewScript(lua.LeaseUsage(lua.StoreClock))
	// The lease operations of concurrency rules: acquire, release, renew.
	leaseScripts = [3]*redis.Script{
		redis.NewScript(lua.Lease(lua.LeaseAcquire, lua.StoreClock)),
		redis.NewScript(lua.Lease(lua.LeaseRelease, lua.StoreClock)),
		redis.NewScript(lua.Lease(lua.LeaseRenew, lua.StoreClock)),
	}
)

var scriptAlgorithms = [...]bucket.Algorithm{bucket.TokenBucket, bucket.GCRA, bucket.SlidingWindow, bucket.SlidingLog, bucket.FixedWindow}

func scriptIndex(a bucket.Algorithm) int {
	for i, s := range scriptAlgorithms {
		if s == a {
			return i
		}
	}
	return -1
}

// allScripts lists every script the store keeps loaded on its nodes.
func allScripts() []*redis.Script {
	return append(singleScripts[:len(singleScripts):len(singleScripts)], multiScript, undoScript, debitScript, debitBatchScript, refundScript, settleScript, seenScript, seenBatchScript, reserveScript, unreserveScript, handoffScript, usageScript, leaseUsageScript,
		leaseScripts[0], leaseScripts[1], leaseScripts[2])
}
