-- The leases of each key held now, changing nothing: the expired ones
-- are counted out, not dropped. KEYS the lease sets of one client (one
-- slot), then the adaptive limit of each (n sets, n limits); ARGV per key
-- its limit and adaptive range min and max (0 0: a fixed limit). Replies
-- five integers per key: allowed (1: an Acquire of a new member would
-- take a lease), the leases held, the time (µs) until the soonest expires
-- when full (else 0), the latest expiry (µs since the epoch, 0 for none),
-- and the key's limit. Mirrors Leases.Usage in pkg/bucket.
local now = now_us()
local after = '(' .. fmt_int(now)
local n = #KEYS / 2
local out = {}
for i = 1, n do
  local key = KEYS[i]
  local b = 3 * i - 2
  local limit = leases_limit(KEYS[n + i], now, tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]))
  local held = redis.pcall('ZCOUNT', key, after, '+inf')
  if type(held) ~= 'number' then held = 0 end
  local allowed, retry, latest = 1, 0, 0
  if held > 0 then
    latest = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
  end
  if held >= limit then
    local first = redis.call('ZRANGEBYSCORE', key, after, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    allowed, retry = 0, tonumber(first[2]) - now
  end
  out[#out + 1] = allowed
  out[#out + 1] = held
  out[#out + 1] = retry
  out[#out + 1] = latest
  out[#out + 1] = limit
end
return out
