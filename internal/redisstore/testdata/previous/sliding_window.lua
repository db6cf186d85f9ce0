-- The check script of sliding_window as released before ns state and micro-token counts
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
-- Sliding window counter. State: "index current previous" in one string;
-- estimate = previous * (1 - f) + current, f the elapsed fraction of the
-- current window. Expires two windows after the current one began, since it
-- serves as the next window's previous one.

-- The current and previous counts of window idx.
local function sliding_window_read(key, idx)
  local v = read_string(key)
  if v then
    local a, b, c = string.match(v, '^(%d+) (%S+) (%S+)$')
    a = tonumber(a)
    if a == idx then
      return tonumber(b) or 0, tonumber(c) or 0
    elseif a == idx - 1 then
      return 0, tonumber(b) or 0
    end
  end
  return 0, 0
end

local function sliding_window_write(key, idx, w, cur, prev, now)
  redis.call('SET', key, string.format('%d %.17g %.17g', idx, cur, prev),
    'PX', fmt_int(math.ceil(((idx + 2) * w - now) / 1000)))
end

local function sliding_window(key, cap, w, cost, now)
  local idx = window_index(now, w)
  local f = (now - idx * w) / w
  local cur, prev = sliding_window_read(key, idx)
  local est = prev * (1 - f) + cur
  if est + cost <= cap then
    return 1, math.max(cap - (est + cost), 0), 0, (idx + 2) * w - now, function()
      sliding_window_write(key, idx, w, cur + cost, prev, now)
    end
  end
  local at
  if cur + cost <= cap then
    at = idx * w + math.ceil((1 - (cap - cost - cur) / prev) * w)
  else
    at = (idx + 1) * w + math.ceil((1 - (cap - cost) / cur) * w)
  end
  local reset = 0
  if cur > 0 then
    reset = (idx + 2) * w - now
  elseif prev > 0 then
    reset = (idx + 1) * w - now
  end
  return 0, math.max(cap - est, 0), math.max(at - now, 1), reset, nil
end
local take = sliding_window
-- One check of one rule: KEYS[1] the bucket; ARGV capacity, rate or window
-- (µs), cost. Writes only when the request passes.
local allowed, remaining, retry, reset, commit =
  take(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), now_us())
if commit then commit() end
return {allowed, string.format('%.17g', remaining), retry, reset}
