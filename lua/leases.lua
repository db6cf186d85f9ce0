-- Concurrency leases. State: a sorted set of the leases of one (rule, key)
-- held, each member a lease's random id, scored by the instant (µs) it
-- expires. Every call first drops the leases at or past their expiry, so a
-- lease neither released nor renewed frees its slot; the key expires with
-- its latest lease. pkg/bucket.Leases does the same in the same order.

-- Drops the expired leases; returns how many are held. A key of another
-- type is deleted and reads as empty.
local function leases_trim(key, now)
  local r = redis.pcall('ZREMRANGEBYSCORE', key, '-inf', fmt_int(now))
  if type(r) == 'table' and r.err then
    redis.call('DEL', key)
  end
  return redis.call('ZCARD', key)
end

-- Sets the key's expiry to that of its latest lease.
local function leases_expire(key, now)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #last == 0 then return end
  redis.call('PEXPIRE', key, fmt_int(math.ceil((tonumber(last[2]) - now) / 1000) + EXPIRY_PAD_MS))
end
