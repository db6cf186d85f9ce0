-- Helpers shared by every algorithm. Every number written to Redis goes
-- through string.format: Lua's own number-to-string keeps 14 digits, which
-- would round a timestamp. The float operations are those of pkg/bucket, in
-- the same order, so the two make identical decisions.

-- How much remote spending a key's debt can hold beyond one capacity, in
-- µs (bucket.DebtHorizon): a debit takes a token bucket or GCRA down to at
-- most capacity + rate * 10 s of debt, a window's count up to limit +
-- max(limit, limit * 10 s / window).
local DEBT_HORIZON_US = 10000000

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

-- How long cost takes to refill at rate, in whole ns: rounded down, at
-- least 1, forgiving the binary rounding of decimal inputs (a quotient
-- within 2^-50 of itself below a whole number is that number), so 4.1
-- tokens at 1e6/s are 4100 ns. Costs that add up to the capacity add up to
-- at most its duration. Mirrors spendNs in pkg/bucket.
local function spend_ns(cost, rate)
  local x = cost * 1e9 / rate
  local n = math.floor(x)
  if x > n and n + 1 - x <= x * 2^-50 then n = n + 1 end
  if n < 1 then n = 1 end
  return n
end

-- Token bucket and GCRA state: one integer, minus the instant (ns since the
-- Unix epoch) at which the bucket is full again (GCRA's theoretical arrival
-- time). Redis keeps it as an integer, no larger than the µs it replaced.
-- The sign tells it from that previous format, whole µs, which still reads
-- as the same instant; and the previous scripts read a negative value as a
-- full bucket, not as a debt. A Lua number is exact to 2^53, so the value
-- is read and written as µs and the ns within them.

-- Writes the state of key: full again d ns (a whole number) after now.
local function bucket_write(key, now, d)
  local r = math.fmod(d, 1000)
  local q = math.floor((d - r) / 1000 + 0.5)
  redis.call('SET', key, string.format('-%d%03d', now + q, r), 'PX', fmt_int(math.ceil(d / 1e6) + EXPIRY_PAD_MS))
end

-- The time (ns) until the bucket of key is full again, read at now: 0 when
-- full, and never more than two capacities' duration and DEBT_HORIZON_US
-- (capacity + rate * 10 s of debt), which is as far as a debit goes. A
-- state beyond that was left by a larger capacity or a lower rate (a rule
-- changed under an active key): it is written back as the bound, which
-- reads the same, so the key waits at most (cost + capacity) / rate + 10 s
-- of the new rule and its debt refills from there. Also returns the
-- capacity's duration. Mirrors Limit.clampDebt in pkg/bucket.
local function bucket_debt(key, cap, rate, now)
  local full = spend_ns(cap, rate)
  local v = read_string(key)
  local d = 0
  if v then
    local us, ns
    if string.byte(v) == 45 then
      us, ns = tonumber(string.sub(v, 2, -4)), tonumber(string.sub(v, -3))
    else
      us, ns = tonumber(v), 0
    end
    if us and ns then
      d = (us - now) * 1000 + ns
      if d < 0 then d = 0 end
    end
  end
  local most = 2 * full + DEBT_HORIZON_US * 1000
  if d > most then
    d = most
    bucket_write(key, now, d)
  end
  return d, full
end

-- Rounds x to whole millionths: window counts and costs count in
-- millionths of a token, so fractional costs add up without drift.
local function micro(x)
  return math.floor(x * 1e6 + 0.5) / 1e6
end

-- What a cost counts in a window: whole millionths, at least one.
local function window_cost(cost)
  return math.max(micro(cost), 1e-6)
end

-- The highest count a debit leaves in a window: limit + max(limit,
-- limit * 10 s / window).
local function window_most(cap, w)
  cap = micro(cap)
  return micro(cap + math.max(cap, cap * DEBT_HORIZON_US / w))
end
