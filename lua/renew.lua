-- Extends a lease: KEYS the lease sets of one client; ARGV[1] the lease's
-- member, then per key the lease length (µs). Replies three integers per
-- key: 1 and the leases held and the new expiry (µs), or 0, the leases held
-- and 0 when the lease is gone (expired, released or never held).
local now = now_us()
local member = ARGV[1]
local out = {}
for i = 1, #KEYS do
  local key = KEYS[i]
  local n = leases_trim(key, now)
  if redis.call('ZSCORE', key, member) then
    local exp = now + tonumber(ARGV[1 + i])
    redis.call('ZADD', key, 'XX', fmt_int(exp), member)
    leases_expire(key, exp, now)
    out[#out + 1] = 1
    out[#out + 1] = n
    out[#out + 1] = exp
  else
    out[#out + 1] = 0
    out[#out + 1] = n
    out[#out + 1] = 0
  end
end
return out
