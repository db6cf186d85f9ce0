package region

import (
	"errors"
	"hash/fnv"
	"strconv"
	"strings"
	"testing"
)

func mustNew(t testing.TB, names ...string) *Topology {
	t.Helper()
	regions := make([]Region, len(names))
	for i, n := range names {
		regions[i] = Region{Name: n, LimiterAddress: "limiter." + n + ":8081"}
	}
	topo, err := New(regions)
	if err != nil {
		t.Fatal(err)
	}
	return topo
}

func testKey(i int) string { return "tenant-" + strconv.Itoa(i) + ":api" }

// referenceWeight computes the weight as Home's documentation defines it,
// with the standard library's FNV-1a, so an optimisation of Home that
// changes the weights fails.
func referenceWeight(name, key string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(name + "\x00" + key))
	return mix64(h.Sum64())
}

func referenceHome(names []string, key string) string {
	var best string
	var bestW uint64
	for i, n := range names {
		w := referenceWeight(n, key)
		if i == 0 || w > bestW || (w == bestW && n < best) {
			best, bestW = n, w
		}
	}
	return best
}

func TestMix64IsSplitMix64(t *testing.T) {
	// The first output of SplitMix64 seeded with 0 finalises the state
	// 0 + 0x9e3779b97f4a7c15 (the reference implementation's test vector).
	if got, want := mix64(0x9e3779b97f4a7c15), uint64(0xe220a8397b1dcdaf); got != want {
		t.Fatalf("mix64 = %#x, want %#x", got, want)
	}
}

func TestHomeMatchesDocumentedHash(t *testing.T) {
	names := []string{"us-east", "eu-west", "ap-south", "sa-east", "0"}
	topo := mustNew(t, names...)
	for i := range 5000 {
		key := testKey(i)
		if got, want := topo.Home(key, nil), referenceHome(names, key); got != want {
			t.Fatalf("Home(%q) = %q, documented hash gives %q", key, got, want)
		}
	}
	for _, key := range []string{"", "\x00", strings.Repeat("k", 1000), "ключ"} {
		if got, want := topo.Home(key, nil), referenceHome(names, key); got != want {
			t.Fatalf("Home(%q) = %q, documented hash gives %q", key, got, want)
		}
	}
}

// The weights are a contract between processes, maybe of different
// versions: pinned values catch a change of the hash. They were checked
// against an independent Python implementation of the documented formula.
func TestHomeGolden(t *testing.T) {
	topo := mustNew(t, "us-east", "eu-west", "ap-south")
	tests := []struct {
		name string
		key  string
		want string
	}{
		{"empty key", "", "ap-south"},
		{"tenant 1", "tenant-1:api", "us-east"},
		{"tenant 2", "tenant-2:api", "eu-west"},
		{"tenant 3", "tenant-3:api", "ap-south"},
		{"user", "user:42", "ap-south"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := topo.Home(tt.key, nil); got != tt.want {
				t.Fatalf("Home(%q) = %q, want %q", tt.key, got, tt.want)
			}
		})
	}
	if got, want := referenceWeight("us-east", "user:42"), uint64(0xdffabd86e5f98e63); got != want {
		t.Fatalf("weight(us-east, user:42) = %#x, want %#x", got, want)
	}
}

func TestHomeDeterministic(t *testing.T) {
	a := mustNew(t, "us-east", "eu-west", "ap-south", "sa-east")
	b := mustNew(t, "sa-east", "ap-south", "us-east", "eu-west")
	for i := range 10000 {
		key := testKey(i)
		first := a.Home(key, nil)
		if again := a.Home(key, nil); again != first {
			t.Fatalf("Home(%q) = %q then %q", key, first, again)
		}
		if other := b.Home(key, nil); other != first {
			t.Fatalf("Home(%q) = %q, or %q with the regions in another order", key, first, other)
		}
	}
}

func TestHomeExplicit(t *testing.T) {
	topo := mustNew(t, "us-east", "eu-west", "ap-south")
	hashed := topo.Home("tenant-1:api", nil)
	other := "us-east"
	if hashed == other {
		other = "eu-west"
	}
	explicit := map[string]string{"tenant-1:api": other}
	tests := []struct {
		name     string
		key      string
		explicit map[string]string
		want     string
	}{
		{"explicit wins over hashing", "tenant-1:api", explicit, other},
		{"key not in map falls back to hashing", "tenant-2:api", explicit, topo.Home("tenant-2:api", nil)},
		{"nil map", "tenant-1:api", nil, hashed},
		{"empty map", "tenant-1:api", map[string]string{}, hashed},
		{"region given as is", "k", map[string]string{"k": "not-validated"}, "not-validated"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := topo.Home(tt.key, tt.explicit); got != tt.want {
				t.Fatalf("Home(%q) = %q, want %q", tt.key, got, tt.want)
			}
		})
	}
}

func TestHomeZeroTopology(t *testing.T) {
	var topo Topology
	if got := topo.Home("k", nil); got != "" {
		t.Fatalf("Home on the zero Topology = %q, want \"\"", got)
	}
	if got := topo.Home("k", map[string]string{"k": "us-east"}); got != "us-east" {
		t.Fatalf("Home on the zero Topology with an explicit home = %q", got)
	}
	if topo.Has("k") || len(topo.Names()) != 0 || len(topo.Regions()) != 0 {
		t.Fatal("the zero Topology has regions")
	}
}

func TestHomeDistribution(t *testing.T) {
	const keys = 30000
	topo := mustNew(t, "us-east", "eu-west", "ap-south")
	counts := map[string]int{}
	for i := range keys {
		counts[topo.Home(testKey(i), nil)]++
	}
	even := keys / 3
	for _, name := range topo.Names() {
		if c := counts[name]; c < even*95/100 || c > even*105/100 {
			t.Errorf("%s has %d keys, want %d ± 5%%", name, c, even)
		}
	}
	if len(counts) != 3 {
		t.Errorf("keys went to %v, want only the 3 regions", counts)
	}
}

func TestHomeAddRegion(t *testing.T) {
	const keys = 30000
	before := mustNew(t, "us-east", "eu-west", "ap-south")
	after := mustNew(t, "us-east", "eu-west", "ap-south", "sa-east")
	moved := 0
	for i := range keys {
		key := testKey(i)
		was, is := before.Home(key, nil), after.Home(key, nil)
		if was == is {
			continue
		}
		if is != "sa-east" {
			t.Fatalf("key %q moved from %s to %s, an old region", key, was, is)
		}
		moved++
	}
	if moved < keys*20/100 || moved > keys*30/100 {
		t.Fatalf("%d of %d keys moved to the new region, want 20%%..30%%", moved, keys)
	}
}

func TestHomeRemoveRegion(t *testing.T) {
	const keys = 30000
	all := []string{"us-east", "eu-west", "ap-south", "sa-east"}
	before := mustNew(t, all...)
	for _, removed := range all {
		t.Run(removed, func(t *testing.T) {
			var rest []string
			for _, n := range all {
				if n != removed {
					rest = append(rest, n)
				}
			}
			after := mustNew(t, rest...)
			moved := 0
			for i := range keys {
				key := testKey(i)
				was, is := before.Home(key, nil), after.Home(key, nil)
				if was != removed && is != was {
					t.Fatalf("key %q moved from %s to %s though %s was removed", key, was, is, removed)
				}
				if was == removed {
					moved++
				}
			}
			if moved == 0 {
				t.Fatalf("no key was homed in %s", removed)
			}
		})
	}
}

func TestHomeDoesNotAllocate(t *testing.T) {
	topo := mustNew(t, "us-east", "eu-west", "ap-south")
	explicit := map[string]string{"pinned": "us-east"}
	key := "tenant-12345:api"
	if n := testing.AllocsPerRun(100, func() { topo.Home(key, explicit) }); n != 0 {
		t.Fatalf("Home allocates %v times per call, want 0", n)
	}
}

func TestValidateHomes(t *testing.T) {
	topo := mustNew(t, "us-east", "eu-west")
	tests := []struct {
		name     string
		explicit map[string]string
		want     string // "" means valid
	}{
		{"nil", nil, ""},
		{"empty", map[string]string{}, ""},
		{"known regions", map[string]string{"a": "us-east", "b": "eu-west"}, ""},
		{"unknown region", map[string]string{"a": "us-east", "b": "ap-south"}, `key "b": region "ap-south" is not in the topology`},
		{"empty region", map[string]string{"a": ""}, `key "a": region "" is not in the topology`},
		{"empty key", map[string]string{"": "us-east"}, "empty key"},
		{"first bad key in sorted order", map[string]string{"z": "x", "m": "y"}, `key "m"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := topo.ValidateHomes(tt.explicit)
			if tt.want == "" {
				if err != nil {
					t.Fatalf("ValidateHomes: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("ValidateHomes = %v, want an error wrapping ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("ValidateHomes = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}

func BenchmarkHome(b *testing.B) {
	explicit := map[string]string{"pinned": "us-east"}
	for _, n := range []int{3, 10} {
		names := make([]string, n)
		for i := range names {
			names[i] = "region-" + strconv.Itoa(i)
		}
		topo := mustNew(b, names...)
		b.Run(strconv.Itoa(n)+"-regions", func(b *testing.B) {
			key := "tenant-12345:api"
			b.ReportAllocs()
			for b.Loop() {
				topo.Home(key, explicit)
			}
		})
	}
	b.Run("explicit", func(b *testing.B) {
		topo := mustNew(b, "us-east", "eu-west", "ap-south")
		b.ReportAllocs()
		for b.Loop() {
			topo.Home("pinned", explicit)
		}
	})
}
