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

-- Makes the key last at least until exp (µs), the expiry of the lease
-- just taken or renewed: no lease held expires later than the latest one
-- taken or renewed, so the key outlives its leases, and an expiry is never
-- shortened (PTTL is -1 for a key just made, without one).
local function leases_expire(key, exp, now)
  local ms = math.ceil((exp - now) / 1000) + EXPIRY_PAD_MS
  if redis.call('PTTL', key) < ms then
    redis.call('PEXPIRE', key, fmt_int(ms))
  end
end
