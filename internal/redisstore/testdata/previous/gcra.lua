-- The check script of gcra as released before ns state and micro-token counts
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
-- GCRA. State: one integer, the theoretical arrival time (µs). A request of
-- cost moves it by cost emission intervals and passes when the new value is
-- within the burst tolerance of now. Reports whole requests remaining.

-- The theoretical arrival time of key read at now: never before now, and
-- never more than two tolerances ahead (one capacity of debt, as far as a
-- debit goes); a later one (a rule changed under an active key) is written
-- back as the bound, as token_bucket_full does. Mirrors Limit.clampDebt.
local function gcra_tat(key, cap, rate, now)
  local tat = tonumber(read_string(key) or now) or now
  local most = now + 2 * round_us(cap * 1e6 / rate)
  if tat > most then
    tat = most
    redis.call('SET', key, fmt_int(tat), 'PX', fmt_int(math.ceil((tat - now) / 1000)))
  end
  if tat < now then tat = now end
  return tat
end

local function gcra(key, cap, rate, cost, now)
  local tolerance = round_us(cap * 1e6 / rate)
  local tat = gcra_tat(key, cap, rate, now)
  local nxt = tat + round_us(cost * 1e6 / rate)
  local allow_at = nxt - tolerance
  if allow_at > now then
    return 0, math.max(math.floor((tolerance - (tat - now)) * rate / 1e6), 0), allow_at - now, tat - now, nil
  end
  return 1, math.max(math.floor((tolerance - (nxt - now)) * rate / 1e6), 0), 0, nxt - now, function()
    redis.call('SET', key, fmt_int(nxt), 'PX', fmt_int(math.ceil((nxt - now) / 1000)))
  end
end
local take = gcra
-- One check of one rule: KEYS[1] the bucket; ARGV capacity, rate or window
-- (µs), cost. Writes only when the request passes.
local allowed, remaining, retry, reset, commit =
  take(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), now_us())
if commit then commit() end
return {allowed, string.format('%.17g', remaining), retry, reset}
