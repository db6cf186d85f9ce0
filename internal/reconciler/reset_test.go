package reconciler

import (
	"encoding/json"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/limiterd/limiterd/pkg/gossip"
)

// waitExact waits until region counts want for key: a count above it is
// no failure yet (a reset not applied yet leaves more).
func (s *stack) waitExact(region, key string, want float64) {
	s.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for s.count(region, key) != want {
		if time.Now().After(deadline) {
			s.t.Fatalf("%s counts %v for %s after 30s, want %v", region, s.count(region, key), key, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// resetHTTP resets key of rule through region's limiterd admin API.
func (s *stack) resetHTTP(region, rule, key string) {
	s.t.Helper()
	req, err := http.NewRequest("POST", "http://"+s.regions[region].lim.HTTPAddr()+"/admin/rules/"+rule+"/keys/"+key+":reset", nil)
	if err != nil {
		s.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+stackAdminToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		Propagated bool `json:"propagated"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != http.StatusOK {
		s.t.Fatalf("reset %s/%s in %s: %s, %v", rule, key, region, resp.Status, err)
	}
	if !out.Propagated {
		s.t.Fatalf("reset %s/%s in %s: not propagated to the other regions", rule, key, region)
	}
}

// TestResetAcrossRegions: a key spent in us-east, reset there through
// the admin API, then spent again ends in eu-west as full minus the
// spends after the reset, as in us-east; the spends before it are
// forgiven in both.
func TestResetAcrossRegions(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 1)
	spend := func(n int) {
		t.Helper()
		for range n {
			if resp, err := s.check("us-east", "quota", "e"); err != nil || !resp.Allowed {
				t.Fatalf("check: %v, %v", resp, err)
			}
		}
	}
	spend(5)
	s.waitCount("eu-west", "e", 5)
	s.resetHTTP("us-east", "quota", "e")
	if got := s.count("us-east", "e"); got != 0 {
		t.Fatalf("us-east counts %v right after the reset, want 0", got)
	}
	spend(3)
	s.waitExact("eu-west", "e", 3)
	// Nothing later undoes it: not the spends before the reset, not the
	// reset again.
	time.Sleep(4 * s.interval)
	for _, r := range stackRegions {
		if got := s.count(r, "e"); got != 3 {
			t.Errorf("%s counts %v, want the 3 spent after the reset", r, got)
		}
	}
}

// batchOf is one flush of instance's spends in region, encoded.
func batchOf(t *testing.T, region, instance string, seq uint64, spends ...gossip.Spend) []byte {
	t.Helper()
	now := time.Now().UnixMicro()
	parts, err := gossip.Split(gossip.Header{Region: region, Instance: instance, Sequence: seq, FirstAdmitted: now, Flushed: now},
		spends, gossip.DefaultMaxMessageBytes)
	if err != nil || len(parts) != 1 {
		t.Fatalf("split: %d parts, %v", len(parts), err)
	}
	return parts[0]
}

// TestResetAppliedOnce: a flush that resets a key then spends on it,
// through the real relay, inbound stream and debit script: delivered again
// (its position not stored) it resets nothing again, and replayed as a new stream
// message after later spends it neither resets again nor loses them. The
// key ends as full minus what was spent after the reset.
func TestResetAppliedOnce(t *testing.T) {
	t.Parallel()
	s := newStack(t, quotaRules, 200*time.Millisecond, 0)
	s.startReconciler("us-east")
	var skip, skipped atomic.Bool
	s.startReconciler("eu-west", func(r *Reconciler) {
		r.beforeDone = func(string, uint64) bool {
			// The armed message's position is not stored the first time:
			// it is read again.
			if skip.CompareAndSwap(true, false) {
				skipped.Store(true)
				return false
			}
			return true
		}
	})
	s.waitReady()
	subject := gossip.PartitionSubject("us-east", 0)
	s.publish("reconciler-us-east", subject, batchOf(t, "us-east", "resetter", 1, gossip.Spend{Rule: "quota", Key: "r", Cost: 7}), "resetter-1-0")
	s.waitCount("eu-west", "r", 7)

	reset := batchOf(t, "us-east", "resetter", 2, gossip.Spend{Rule: "quota", Key: "r", Cost: 2, Reset: true})
	skip.Store(true)
	s.publish("reconciler-us-east", subject, reset, "resetter-2-0")
	s.waitExact("eu-west", "r", 2)
	s.publish("reconciler-us-east", subject, batchOf(t, "us-east", "resetter", 3, gossip.Spend{Rule: "quota", Key: "r", Cost: 1}), "resetter-3-0")
	s.waitCount("eu-west", "r", 3)
	if !skipped.Load() {
		t.Fatal("no position was lost")
	}

	// The reset replayed after the spends that followed it, without its
	// message id and with another, then one more spend: applied in order,
	// the replays must not reset the key.
	s.publish("reconciler-us-east", subject, reset, "")
	s.publish("reconciler-us-east", subject, reset, "resetter-2-0-after-the-window")
	s.publish("reconciler-us-east", subject, batchOf(t, "us-east", "resetter", 4, gossip.Spend{Rule: "quota", Key: "r", Cost: 1}), "resetter-4-0")
	s.waitCount("eu-west", "r", 4)
	time.Sleep(2 * time.Second) // any message read again is in
	if got := s.count("eu-west", "r"); got != 4 {
		t.Fatalf("eu-west counts %v, want 4: 2 + 1 + 1 spent after the reset", got)
	}
	rec := s.regions["eu-west"].recs[0]
	if got := testutil.ToFloat64(rec.m.apply.Replays.WithLabelValues("us-east")); got != 2 {
		t.Errorf("replays counted: %v, want 2", got)
	}
	if got := testutil.ToFloat64(rec.m.apply.Duplicates.WithLabelValues("us-east")); got < 1 {
		t.Errorf("duplicates counted: %v, want the reset read again among them", got)
	}
}
