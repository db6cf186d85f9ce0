-- Gives a lease back: KEYS the lease sets of one client; ARGV[1] the
-- lease's member. Replies per key 1 when it was held, 0 when it was not
-- (unknown, released or expired: not an error).
local now = now_us()
local out = {}
for i = 1, #KEYS do
  leases_trim(KEYS[i], now)
  out[i] = redis.call('ZREM', KEYS[i], ARGV[1])
end
return out
