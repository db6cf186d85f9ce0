package denycache

import (
	"strconv"
	"testing"
	"time"
)

func TestDenyCache(t *testing.T) {
	c := New(Shards * 2)
	c.Put(0, "r", "k", 2, c.Now(), 50*time.Millisecond, time.Second)
	if _, _, ok, _ := c.Get("r", "k", 1); ok {
		t.Fatal("a denial of cost 2 denied cost 1, which may pass")
	}
	retry, reset, ok, _ := c.Get("r", "k", 3)
	if !ok || retry <= 0 || retry > 50*time.Millisecond || reset <= 0 || reset > time.Second {
		t.Fatalf("get cost 3 = %v, %v, %v; want denied with 0 < retry <= 50ms", retry, reset, ok)
	}
	if _, _, ok, _ := c.Get("other", "k", 3); ok {
		t.Fatal("denial leaked to another rule")
	}
	time.Sleep(60 * time.Millisecond)
	// The first check after expiry probes the store; the others wait for it.
	if _, _, ok, probe := c.Get("r", "k", 3); ok || !probe {
		t.Fatalf("first check after the retry time: denied %v, probe %v; want a probe", ok, probe)
	}
	if _, _, ok, probe := c.Get("r", "k", 3); !ok || probe {
		t.Fatalf("second check while probing: denied %v, probe %v; want denied", ok, probe)
	}
	c.Forget("r", "k")
	if _, _, ok, probe := c.Get("r", "k", 3); ok || probe {
		t.Fatal("a forgotten key is still denied")
	}
	c.Put(0, "r", "p", 1, c.Now(), time.Millisecond, time.Millisecond)
	time.Sleep(2 * time.Millisecond)
	c.Get("r", "p", 1) // becomes the probe, which never reports
	time.Sleep(ProbeWindow + 10*time.Millisecond)
	if _, _, ok, probe := c.Get("r", "p", 1); ok || probe {
		t.Fatal("a probe that never reported keeps its key denied")
	}
	if c.Len() != 0 {
		t.Fatalf("expired denials kept: len %d", c.Len())
	}
	for i := range 10_000 {
		c.Put(0, "r", strconv.Itoa(i), 1, c.Now(), time.Hour, time.Hour)
	}
	if n := c.Len(); n > Shards*2 {
		t.Fatalf("cache of size %d holds %d", Shards*2, n)
	}
	c.Clear()
	if c.Len() != 0 {
		t.Fatal("clear left denials")
	}
	// A check decided under the old rules cannot put its denial after a
	// rule change.
	c.Reset(1)
	if c.Put(0, "r", "stale", 1, c.Now(), time.Hour, time.Hour) {
		t.Fatal("a denial of the old rules' generation was remembered after a reset")
	}
	if _, _, ok, _ := c.Get("r", "stale", 1); ok {
		t.Fatal("a denial of the old rules denies under the new ones")
	}
	if !c.Put(1, "r", "fresh", 1, c.Now(), time.Hour, time.Hour) {
		t.Fatal("a denial of the current generation was not remembered")
	}
	if New(0) != nil {
		t.Fatal("size 0 made a cache")
	}
}
