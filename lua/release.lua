-- Gives a lease back: KEYS the lease sets of one client, then the adaptive
-- limit of each (n sets, n limits); ARGV[1] the lease's member, then per
-- key its limit, adaptive range min and max (0 0: a fixed limit), target
-- latency (µs), the request's duration (µs; -1: none reported) and 1 when
-- it failed. A sample reported moves the adaptive limit of a key whose
-- lease was held. Replies per key 1 when it was held, 0 when it was not
-- (unknown, released or expired: not an error).
local now = now_us()
local member = ARGV[1]
local n = #KEYS / 2
local out = {}
for i = 1, n do
  local b = 6 * i - 4
  local count = leases_trim(KEYS[i], now)
  out[i] = redis.call('ZREM', KEYS[i], member)
  local amax, dur = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 4])
  if out[i] == 1 and dur >= 0 and amax > 0 then
    leases_sample(KEYS[n + i], now, tonumber(ARGV[b]), tonumber(ARGV[b + 1]), amax, tonumber(ARGV[b + 3]), count, dur, ARGV[b + 5] == '1')
  end
end
return out
