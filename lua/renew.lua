-- Extends a lease: KEYS the lease sets of one client, then the adaptive
-- limit of each (n sets, n limits); ARGV[1] the lease's member, then per
-- key its limit, lease length (µs), and adaptive range min and max (0 0: a
-- fixed limit), as acquire.lua takes them. Replies four integers per key: 1 and the leases held and
-- the new expiry (µs), or 0, the leases held and 0 when the lease is gone
-- (expired, released or never held); then the key's limit.
local now = now_us()
local member = ARGV[1]
local n = #KEYS / 2
local out = {}
for i = 1, n do
  local key = KEYS[i]
  local b = 4 * i - 2
  local held = leases_trim(key, now)
  local limit = leases_limit(KEYS[n + i], now, tonumber(ARGV[b]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]))
  if redis.call('ZSCORE', key, member) then
    local exp = now + tonumber(ARGV[b + 1])
    redis.call('ZADD', key, 'XX', fmt_int(exp), member)
    leases_expire(key, exp, now)
    out[#out + 1] = 1
    out[#out + 1] = held
    out[#out + 1] = exp
  else
    out[#out + 1] = 0
    out[#out + 1] = held
    out[#out + 1] = 0
  end
  out[#out + 1] = limit
end
return out
