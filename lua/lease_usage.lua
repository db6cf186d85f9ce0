-- The leases of each key held now, changing nothing: the expired ones
-- are counted out, not dropped. KEYS the lease sets of one client (one
-- slot), then the adaptive limit of each (n sets, n limits); ARGV per key
-- its limit and adaptive range min and max (0 0: a fixed limit), then per
-- key what the request's priority class keeps of the limit (a fraction in
-- [0, 1), 0: nothing), as the acquire script reads it. Replies five
-- integers per key: allowed (1: an Acquire of a new member keeping that
-- would take a lease; 0: refused at the limit; 2: refused only for what
-- the class keeps), the leases held, when refused the time (µs) until the
-- soonest expires (for 2: until as many expire as the class needs to
-- fit), else 0, the latest expiry (µs since the epoch, 0 for none), and
-- the key's limit. Mirrors Leases.UsageKeeping in pkg/bucket.
local now = now_us()
local after = '(' .. fmt_int(now)
local n = #KEYS / 2
local out = {}
for i = 1, n do
  local key = KEYS[i]
  local b = 3 * i - 2
  local limit = leases_limit(KEYS[n + i], now, tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]))
  local room = limit
  local keep = tonumber(ARGV[3 * n + i] or '0')
  if keep > 0 then
    room = limit - math.floor(keep * limit)
  end
  local held = redis.pcall('ZCOUNT', key, after, '+inf')
  if type(held) ~= 'number' then held = 0 end
  local allowed, retry, latest = 1, 0, 0
  if held > 0 then
    latest = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
  end
  if held >= room then
    local k = 0
    allowed = 0
    if held < limit then
      k, allowed = held - room, 2
    end
    local at = redis.call('ZRANGEBYSCORE', key, after, '+inf', 'WITHSCORES', 'LIMIT', k, 1)
    retry = tonumber(at[2]) - now
  end
  out[#out + 1] = allowed
  out[#out + 1] = held
  out[#out + 1] = retry
  out[#out + 1] = latest
  out[#out + 1] = limit
end
return out
