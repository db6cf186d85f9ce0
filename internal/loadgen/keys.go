package loadgen

import (
	"math/rand/v2"
	"strconv"
)

// keyPicker picks key indexes in [0, n) under a distribution. It is not safe
// for concurrent use: each worker has its own.
type keyPicker struct {
	n    int
	rng  *rand.Rand
	zipf *rand.Zipf // nil for Uniform
}

// newKeyPicker returns a picker over n keys; s is the Zipf exponent (> 1).
func newKeyPicker(dist KeyDist, n int, s float64, seed1, seed2 uint64) *keyPicker {
	p := &keyPicker{n: n, rng: rand.New(rand.NewPCG(seed1, seed2))}
	if dist == Zipf && n > 1 {
		// P(k) is proportional to (1+k)^-s for k in [0, n-1].
		p.zipf = rand.NewZipf(p.rng, s, 1, uint64(n-1))
	}
	return p
}

func (p *keyPicker) next() int {
	if p.zipf != nil {
		return int(p.zipf.Uint64())
	}
	return p.rng.IntN(p.n)
}

// keyNames returns the n keys of a run: prefix followed by 0 to n-1.
func keyNames(prefix string, n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = prefix + strconv.Itoa(i)
	}
	return keys
}
