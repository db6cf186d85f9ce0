package loadgen

import (
	"slices"
	"testing"
)

// sample draws n key indexes and returns how often each came up, failing on
// an index out of range.
func sample(t *testing.T, p *keyPicker, keys, n int) []int {
	t.Helper()
	counts := make([]int, keys)
	for range n {
		k := p.next()
		if k < 0 || k >= keys {
			t.Fatalf("next() = %d, want a key in [0, %d)", k, keys)
		}
		counts[k]++
	}
	return counts
}

func TestUniformKeysAreEven(t *testing.T) {
	const keys, n = 100, 200_000
	counts := sample(t, newKeyPicker(Uniform, keys, DefaultZipfS, 1, 2), keys, n)
	// Each key expects 2000 draws with a standard deviation near 44.
	for k, c := range counts {
		if c < 1700 || c > 2300 {
			t.Errorf("key %d drawn %d times of %d, want about %d", k, c, n, n/keys)
		}
	}
}

func TestZipfKeysAreSkewed(t *testing.T) {
	const keys, n = 1000, 200_000
	counts := sample(t, newKeyPicker(Zipf, keys, 1.1, 1, 2), keys, n)
	// With s=1.1 over 1000 keys, key 0 takes about 18% of the draws
	// (1/sum((i+1)^-1.1)), against 0.1% for a uniform choice.
	if share := float64(counts[0]) / n; share < 0.12 || share > 0.25 {
		t.Errorf("hottest key share = %.3f, want about 0.18", share)
	}
	if counts[0] <= counts[1] || counts[1] <= counts[9] || counts[9] <= counts[99] {
		t.Errorf("counts of keys 0, 1, 9, 99 = %d, %d, %d, %d: want decreasing", counts[0], counts[1], counts[9], counts[99])
	}
	// The hot tenth of the keys takes most of the traffic.
	var top int
	for _, c := range counts[:keys/10] {
		top += c
	}
	if share := float64(top) / n; share < 0.6 {
		t.Errorf("share of the first 10%% of keys = %.3f, want above 0.6", share)
	}
	if last := slices.Max(counts[keys/2:]); last > n/keys {
		t.Errorf("a cold key was drawn %d times, more than the uniform %d", last, n/keys)
	}
}

func TestSingleKey(t *testing.T) {
	for _, dist := range []KeyDist{Uniform, Zipf} {
		counts := sample(t, newKeyPicker(dist, 1, DefaultZipfS, 3, 4), 1, 100)
		if counts[0] != 100 {
			t.Errorf("%s over one key: key 0 drawn %d of 100 times", dist, counts[0])
		}
	}
}

func TestKeyNames(t *testing.T) {
	got := keyNames("bench:", 3)
	if want := []string{"bench:0", "bench:1", "bench:2"}; !slices.Equal(got, want) {
		t.Fatalf("keyNames() = %q, want %q", got, want)
	}
}
