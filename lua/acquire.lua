-- Takes a lease for every key, all or nothing. KEYS the lease sets of one
-- client (one slot), then the adaptive limit of each (n sets, n limits);
-- ARGV[1] the lease's member, then per key its limit, lease length (µs),
-- and adaptive range min and max (0 0: a fixed limit), then per key what
-- the request's priority class keeps of the limit (a fraction in [0, 1),
-- 0: nothing): a new member takes a lease only while fewer than limit -
-- floor(keep * limit) are held. A member already held is renewed.
-- Replies four integers per key: allowed (1: held, or would be had no
-- other key refused; 0: refused at the limit; 2: refused only for what the
-- class keeps), the leases held, the expiry (µs) when taken, else for a
-- key that refused the time until the soonest lease held expires (for 2:
-- until as many expire as the class needs to fit), else 0, and the key's
-- limit. pkg/bucket.Leases.AcquireKeeping decides the same.
local now = now_us()
local member = ARGV[1]
local n = #KEYS / 2
local counts, held, limits, rooms = {}, {}, {}, {}
local all = true
for i = 1, n do
  local b = 4 * i - 2
  counts[i] = leases_trim(KEYS[i], now)
  held[i] = redis.call('ZSCORE', KEYS[i], member)
  limits[i] = leases_limit(KEYS[n + i], now, tonumber(ARGV[b]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]))
  rooms[i] = limits[i]
  local keep = tonumber(ARGV[1 + 4 * n + i] or '0')
  if keep > 0 then
    rooms[i] = limits[i] - math.floor(keep * limits[i])
  end
  if not held[i] and counts[i] >= rooms[i] then
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
  elseif not held[i] and counts[i] >= rooms[i] then
    local k, reply = 0, 0
    if counts[i] < limits[i] then
      k, reply = counts[i] - rooms[i], 2
    end
    local at = redis.call('ZRANGE', key, k, k, 'WITHSCORES')
    out[#out + 1] = reply
    out[#out + 1] = counts[i]
    out[#out + 1] = tonumber(at[2]) - now
  else
    out[#out + 1] = 1
    out[#out + 1] = counts[i]
    out[#out + 1] = 0
  end
  out[#out + 1] = limits[i]
end
return out
