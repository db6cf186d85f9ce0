-- The check script of token_bucket as released before ns state and micro-token counts
-- (commit 1d9ad8c), with the fixed clock: kept to test reading and writing
-- state across an upgrade or a rollback.
-- A fixed clock for conformance tests: the instant comes as the last ARGV.
-- Production scripts are built with clock.lua instead and take no time input.
local function now_us()
  return tonumber(ARGV[#ARGV])
end
-- Helpers shared by every algorithm. Every number written to Redis goes
-- through string.format: Lua's own number-to-string keeps 14 digits, which
-- would round a microsecond timestamp.

-- Rounds a duration in microseconds to the nearest whole one, at least 1.
local function round_us(x)
  local n = math.floor(x + 0.5)
  if n < 1 then n = 1 end
  return n
end

-- Rounds up, at least 1: a rejection never says "retry now".
local function ceil_us(x)
  local n = math.ceil(x)
  if n < 1 then n = 1 end
  return n
end

-- The value of key as a string, or nil. A key of another type (a rule
-- changed algorithm) is deleted and reads as absent.
local function read_string(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' then
    redis.call('DEL', key)
    return nil
  end
  if not v then return nil end
  return v
end

-- floor(now / w), exact for integers below 2^53.
local function window_index(now, w)
  local idx = math.floor(now / w)
  if idx * w > now then idx = idx - 1 end
  return idx
end

local function fmt_int(n)
  return string.format('%d', n)
end
-- Token bucket. State: one integer, the instant (µs) at which the bucket is
-- full again; tokens(now) = capacity - (full - now) * rate. The key expires
-- when the bucket would be full, so idle clients cost no memory.

-- The instant the bucket of key is full again, read at now: never before
-- now, and never more than one capacity of debt ahead (tokens >= -capacity),
-- which is as far as a debit goes (debit.lua). A stored instant beyond that
-- was left by a larger capacity or a lower rate (a rule changed under an
-- active key): it is written back as the bound, which reads the same, so the
-- key waits at most (cost + capacity) / rate of the new rule and its debt
-- refills from there. Mirrors Limit.clampDebt in pkg/bucket.
local function token_bucket_full(key, cap, rate, now)
  local full = tonumber(read_string(key) or now) or now
  local most = now + round_us(2 * cap * 1e6 / rate)
  if full > most then
    full = most
    redis.call('SET', key, fmt_int(full), 'PX', fmt_int(math.ceil((full - now) / 1000)))
  end
  if full < now then full = now end
  return full
end

-- Returns allowed, remaining, retry_us, reset_us, and on success a commit.
local function token_bucket(key, cap, rate, cost, now)
  local full = token_bucket_full(key, cap, rate, now)
  local tokens = cap - (full - now) * rate / 1e6
  if tokens >= cost then
    full = full + round_us(cost * 1e6 / rate)
    return 1, math.max(cap - (full - now) * rate / 1e6, 0), 0, full - now, function()
      redis.call('SET', key, fmt_int(full), 'PX', fmt_int(math.ceil((full - now) / 1000)))
    end
  end
  return 0, math.max(tokens, 0), ceil_us((cost - tokens) * 1e6 / rate), full - now, nil
end
local take = token_bucket
-- One check of one rule: KEYS[1] the bucket; ARGV capacity, rate or window
-- (µs), cost. Writes only when the request passes.
local allowed, remaining, retry, reset, commit =
  take(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), now_us())
if commit then commit() end
return {allowed, string.format('%.17g', remaining), retry, reset}
