-- The fixed clock and the helpers of the check scripts as released before
-- ns state and micro-token counts (commit 1d9ad8c). With one algorithm's
-- file of this directory and single.lua they make that algorithm's check
-- script (previousScript in arith_test.go), kept to test reading and
-- writing state across an upgrade or a rollback.
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
