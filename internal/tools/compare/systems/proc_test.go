package systems

import (
	"os"
	"testing"
)

func TestParseStat(t *testing.T) {
	// A name with a space and a parenthesis; utime 1234, stime 56.
	line := "4242 (redis-server ) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 1234 56 0 0 20 0 5 0 100 1000 200\n"
	got, err := parseStat([]byte(line))
	if err != nil || got != 1290 {
		t.Errorf("parseStat: %d, %v; want 1290", got, err)
	}
	if _, err := parseStat([]byte("4242 no name")); err == nil {
		t.Error("parseStat of a line without a name: no error")
	}
	if _, err := cpuTicks(os.Getpid()); err != nil {
		t.Errorf("cpuTicks of this process: %v", err)
	}
}
