-- The leases of each key held now, changing nothing: the expired ones
-- are counted out, not dropped. KEYS the lease sets of one client (one
-- slot); ARGV[i] the limit of KEYS[i]. Replies four integers per key:
-- allowed (1: an Acquire of a new member would take a lease), the leases
-- held, the time (µs) until the soonest expires when full (else 0), and
-- the latest expiry (µs since the epoch, 0 for none). Mirrors
-- Leases.Usage in pkg/bucket.
local now = now_us()
local after = '(' .. fmt_int(now)
local out = {}
for i = 1, #KEYS do
  local key = KEYS[i]
  local n = redis.pcall('ZCOUNT', key, after, '+inf')
  if type(n) ~= 'number' then n = 0 end
  local allowed, retry, latest = 1, 0, 0
  if n > 0 then
    latest = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
  end
  if n >= tonumber(ARGV[i]) then
    local first = redis.call('ZRANGEBYSCORE', key, after, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    allowed, retry = 0, tonumber(first[2]) - now
  end
  out[#out + 1] = allowed
  out[#out + 1] = n
  out[#out + 1] = retry
  out[#out + 1] = latest
end
return out
