-- Takes a lease for every key, all or nothing. KEYS the lease sets of one
-- client (one slot), then the adaptive limit of each (n sets, n limits);
-- ARGV[1] the lease's member, then per key its limit, lease length (µs),
-- and adaptive range min and max (0 0: a fixed limit). A member already
-- held is renewed. Replies four integers per key: allowed (1: held, or
-- would be had no other key refused), the leases held, the expiry (µs)
-- when taken, else the time until the soonest lease held expires for a
-- key that refused, else 0, and the key's limit.
local now = now_us()
local member = ARGV[1]
local n = #KEYS / 2
local counts, held, limits = {}, {}, {}
local all = true
for i = 1, n do
  local b = 4 * i - 2
  counts[i] = leases_trim(KEYS[i], now)
  held[i] = redis.call('ZSCORE', KEYS[i], member)
  limits[i] = leases_limit(KEYS[n + i], now, tonumber(ARGV[b]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]))
  if not held[i] and counts[i] >= limits[i] then
    all = false
  end
end
local out = {}
for i = 1, n do
  local key = KEYS[i]
  if all then
    local exp = now + tonumber(ARGV[4 * i - 1])
    redis.call('ZADD', key, fmt_int(exp), member)
    if not held[i] then counts[i] = counts[i] + 1 end
    leases_expire(key, exp, now)
    out[#out + 1] = 1
    out[#out + 1] = counts[i]
    out[#out + 1] = exp
  elseif not held[i] and counts[i] >= limits[i] then
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    out[#out + 1] = 0
    out[#out + 1] = counts[i]
    out[#out + 1] = tonumber(first[2]) - now
  else
    out[#out + 1] = 1
    out[#out + 1] = counts[i]
    out[#out + 1] = 0
  end
  out[#out + 1] = limits[i]
end
return out
