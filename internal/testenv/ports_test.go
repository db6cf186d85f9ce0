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

// TestReservePortAvoidsTheStack: no port handed out, nor its pair, falls in
// the band of fixed ports the local stack binds (its Redis cluster bus
// ports and delaying links), which tests beside a stack would collide with.
func TestReservePortAvoidsTheStack(t *testing.T) {
	const offset = 10000
	for range 2000 {
		p, err := testenv.ReservePortPair(offset)
		if err != nil {
			t.Fatal(err)
		}
		for _, port := range []int{p, p + offset} {
			if port >= 17000 && port <= 18999 {
				t.Fatalf("port %d handed out: the local stack binds 17000-18999", port)
			}
		}
	}
}
