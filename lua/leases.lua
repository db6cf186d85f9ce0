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

-- Adaptive limits. A concurrency rule may make each key's limit follow the
-- latencies its callers report when they release (AIMD: see
-- pkg/bucket.Adaptive, which does the same). The key's limit is a hash
-- beside its lease set (same slot): l the limit, c the instant (µs) of its
-- last cut, g the samples counted towards one more, e the instant (µs) it
-- is kept until. Past e, or without it, the key's limit is the rule's.
local ADAPTIVE_TTL_US = 3600000000

-- The key's adaptive state at now: its limit (nil when none is kept), last
-- cut and samples towards one more. A key of another type reads as none.
local function leases_adaptive(akey, now)
  local v = redis.pcall('HMGET', akey, 'l', 'c', 'g', 'e')
  if type(v) == 'table' and not v.err and v[1] and v[4] and tonumber(v[4]) > now then
    return tonumber(v[1]), tonumber(v[2] or '0'), tonumber(v[3] or '0')
  end
  return nil, 0, 0
end

-- The limit of an Acquire at now: limit when amax is 0 (not adaptive),
-- else the key's adaptive limit while kept, else limit, within
-- [amin, amax].
local function leases_limit(akey, now, limit, amin, amax)
  if amax == 0 then
    return limit
  end
  local l = leases_adaptive(akey, now)
  return math.min(amax, math.max(amin, l or limit))
end

-- Moves the key's adaptive limit by a sample of a lease released at now
-- while held leases (it included) were held. Over target (µs), or failed:
-- x 9/10 rounded down, unless the request started before the last cut. At
-- or under it, with at least half the limit in use: one sample towards
-- one more, which comes when as many as the limit were counted.
local function leases_sample(akey, now, limit, amin, amax, target, held, dur, failed)
  local l, cut, good = leases_adaptive(akey, now)
  local cur = math.min(amax, math.max(amin, l or limit))
  if failed or dur > target then
    if now - dur >= cut then
      cur, cut, good = math.min(amax, math.max(amin, math.floor(cur * 9 / 10))), now, 0
    end
  elseif 2 * held >= cur then
    good = good + 1
    if good >= cur then
      cur, good = math.min(amax, math.max(amin, cur + 1)), 0
    end
  end
  if redis.call('TYPE', akey).ok ~= 'hash' then
    redis.call('DEL', akey)
  end
  redis.call('HSET', akey, 'l', fmt_int(cur), 'c', fmt_int(cut), 'g', fmt_int(good), 'e', fmt_int(now + ADAPTIVE_TTL_US))
  redis.call('PEXPIRE', akey, fmt_int(ADAPTIVE_TTL_US / 1000 + EXPIRY_PAD_MS))
end
