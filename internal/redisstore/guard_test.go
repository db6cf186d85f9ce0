package redisstore

import "testing"

// TestUnsafePolicy: every bucket has an expiry, so a volatile-* policy
// evicts live counters exactly like allkeys-*; only noeviction keeps them.
func TestUnsafePolicy(t *testing.T) {
	tests := []struct {
		name   string
		policy string
		unsafe bool
	}{
		{name: "noeviction", policy: "noeviction", unsafe: false},
		{name: "allkeys-lru", policy: "allkeys-lru", unsafe: true},
		{name: "allkeys-lfu", policy: "allkeys-lfu", unsafe: true},
		{name: "allkeys-random", policy: "allkeys-random", unsafe: true},
		{name: "volatile-lru", policy: "volatile-lru", unsafe: true},
		{name: "volatile-lfu", policy: "volatile-lfu", unsafe: true},
		{name: "volatile-random", policy: "volatile-random", unsafe: true},
		{name: "volatile-ttl", policy: "volatile-ttl", unsafe: true},
		{name: "a policy of a later Redis", policy: "allkeys-something-new", unsafe: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := (MemoryReading{Policy: tt.policy}).Unsafe(); got != tt.unsafe {
				t.Errorf("MemoryReading{Policy: %q}.Unsafe() = %v, want %v", tt.policy, got, tt.unsafe)
			}
		})
	}
}
