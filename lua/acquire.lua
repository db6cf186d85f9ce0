-- Takes a lease for every key, all or nothing. KEYS the lease sets of one
-- client (one slot); ARGV[1] the lease's member, then per key its limit and
-- lease length (µs). A member already held is renewed. Replies three
-- integers per key: allowed (1: held, or would be had no other key
-- refused), the leases held, and the expiry (µs) when taken, else the time
-- until the soonest lease held expires for a key that refused, else 0.
local now = now_us()
local member = ARGV[1]
local counts, held = {}, {}
local all = true
for i = 1, #KEYS do
  counts[i] = leases_trim(KEYS[i], now)
  held[i] = redis.call('ZSCORE', KEYS[i], member)
  if not held[i] and counts[i] >= tonumber(ARGV[2 * i]) then
    all = false
  end
end
local out = {}
for i = 1, #KEYS do
  local key = KEYS[i]
  if all then
    local exp = now + tonumber(ARGV[2 * i + 1])
    redis.call('ZADD', key, fmt_int(exp), member)
    if not held[i] then counts[i] = counts[i] + 1 end
    leases_expire(key, exp, now)
    out[#out + 1] = 1
    out[#out + 1] = counts[i]
    out[#out + 1] = exp
  elseif not held[i] and counts[i] >= tonumber(ARGV[2 * i]) then
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    out[#out + 1] = 0
    out[#out + 1] = counts[i]
    out[#out + 1] = tonumber(first[2]) - now
  else
    out[#out + 1] = 1
    out[#out + 1] = counts[i]
    out[#out + 1] = 0
  end
end
return out
