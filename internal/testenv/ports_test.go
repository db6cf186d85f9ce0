package testenv_test

import (
	"testing"

	"github.com/limiterd/limiterd/internal/testenv"
)

func TestReservePortNeverRepeats(t *testing.T) {
	const offset = 10000
	seen := map[int]bool{}
	for range 50 {
		p, err := testenv.ReservePort()
		if err != nil {
			t.Fatal(err)
		}
		q, err := testenv.ReservePortPair(offset)
		if err != nil {
			t.Fatal(err)
		}
		for _, port := range []int{p, q, q + offset} {
			if seen[port] {
				t.Fatalf("port %d handed out twice", port)
			}
			seen[port] = true
			if !testenv.CanListen(port) {
				t.Fatalf("port %d is not free", port)
			}
		}
	}
}
