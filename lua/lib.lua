-- Helpers shared by every script. Every number written to Redis goes
-- through string.format: Lua's own number-to-string keeps 14 digits, which
-- would round a timestamp. The float operations of every algorithm are
-- those of pkg/bucket, in the same order, so the two make identical
-- decisions. Each script holds only the helpers its algorithms use
-- (instant.lua, window.lua): a script defines every function again on each
-- call.

-- How much remote spending a key's debt can hold beyond one capacity, in
-- µs (bucket.DebtHorizon): a debit takes a token bucket or GCRA down to at
-- most capacity + rate * 10 s of debt, a window's count up to limit +
-- max(limit, limit * 10 s / window).
local DEBT_HORIZON_US = 10000000

-- How long a token bucket's or GCRA's key outlives the instant it is full
-- again, at most (ns; bucket.KeepFull): the capacity's duration, up to 10
-- s. An absent key has then been full for at least that long, which lets a
-- debit that refilled before it arrived change nothing (debit.lua).
local KEEP_FULL_NS = 10000000000

-- The value of key as a string, or nil, changing nothing; and whether
-- the key holds another type.
local function peek_string(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' then return nil, true end
  if not v then return nil, false end
  return v, false
end

-- The value of key as a string, or nil. A key of another type (a rule
-- changed algorithm) is deleted and reads as absent.
local function read_string(key)
  local v, other = peek_string(key)
  if other then redis.call('DEL', key) end
  return v
end

local function fmt_int(n)
  return string.format('%d', n)
end
