-- The check script of fixed_window as released before ns state and micro-token counts
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
-- Fixed window. State: "index count" in one string. The expiry is set once,
-- at the window's end, when the window's first request is counted; later
-- requests keep it (a refreshed expiry would keep the window from closing).

-- The count of window idx, and whether the key holds another window.
local function fixed_window_read(key, idx)
  local v = read_string(key)
  if v then
    local a, b = string.match(v, '^(%d+) (%S+)$')
    if tonumber(a) == idx then
      return tonumber(b) or 0, false
    end
  end
  return 0, true
end

local function fixed_window_write(key, idx, w, count, fresh)
  local val = string.format('%d %.17g', idx, count)
  if fresh then
    redis.call('SET', key, val, 'PXAT', fmt_int(math.ceil((idx + 1) * w / 1000)))
  else
    redis.call('SET', key, val, 'KEEPTTL')
  end
end

local function fixed_window(key, cap, w, cost, now)
  local idx = window_index(now, w)
  local count, fresh = fixed_window_read(key, idx)
  local ends = (idx + 1) * w - now
  if count + cost <= cap then
    return 1, math.max(cap - (count + cost), 0), 0, ends, function()
      fixed_window_write(key, idx, w, count + cost, fresh)
    end
  end
  return 0, math.max(cap - count, 0), ends, ends, nil
end
local take = fixed_window
-- One check of one rule: KEYS[1] the bucket; ARGV capacity, rate or window
-- (µs), cost. Writes only when the request passes.
local allowed, remaining, retry, reset, commit =
  take(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), now_us())
if commit then commit() end
return {allowed, string.format('%.17g', remaining), retry, reset}
