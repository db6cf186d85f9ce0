-- The token bucket and GCRA: one state, the same admissions.

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

-- How long (ns) a key of a bucket whose capacity lasts full ns outlives
-- the instant it is full again (see KEEP_FULL_NS).
local function bucket_keep(full)
  return math.min(full, KEEP_FULL_NS)
end

-- Writes the state of key: full again d ns (a whole number, at least 0)
-- after now; the key lives bucket_keep(full) beyond that.
local function bucket_write(key, now, d, full)
  -- d % 1000 is exact while d / 1000 has room for three decimals.
  local r = d % 1000
  if r < 0 then r = r + 1000 end
  local q = (d - r) / 1000
  if d >= 2^52 then
    r = math.fmod(d, 1000)
    q = math.floor((d - r) / 1000 + 0.5)
  end
  redis.call('SET', key, string.format('-%d%03d', now + q, r), 'PX',
    fmt_int(math.ceil(d / 1e6) + math.ceil(bucket_keep(full) / 1e6) + EXPIRY_PAD_MS))
end

-- How far (ns) the instant the state v is full again lies after now:
-- below 0 when it was full before now; nil when v is not a state.
local function bucket_ahead(v, now)
  if not v then return nil end
  local us, ns
  if #v == 20 then
    -- '-' and 19 digits (ns instants from 2001 to 2286): the last three
    -- are the ns within the µs.
    local x, y, z = string.byte(v, -3, -1)
    us, ns = tonumber(string.sub(v, 2, -4)), x * 100 + y * 10 + z - 5328
  else
    us, ns = tonumber(v), 0
  end
  if not us then return nil end
  return (us - now) * 1000 + ns
end

-- The time (ns) until the bucket of key is full again, read at now: 0 when
-- full, and never more than two capacities' duration and DEBT_HORIZON_US
-- (capacity + rate * 10 s of debt), which is as far as a debit goes. A
-- state beyond that was left by a larger capacity or a lower rate (a rule
-- changed under an active key): it is written back as the bound, which
-- reads the same, so the key waits at most (cost + capacity) / rate + 10 s
-- of the new rule and its debt refills from there. Also returns the
-- capacity's duration. Mirrors Limit.clampDebt in pkg/bucket.
-- bucket_debt_of reads the state v (a string, or nil) and writes nothing:
-- it also returns whether v was beyond the bound.
local function bucket_debt_of(v, cap, rate, now)
  local full = spend_ns(cap, rate)
  local d = bucket_ahead(v, now) or 0
  if d < 0 then d = 0 end
  local most = 2 * full + DEBT_HORIZON_US * 1000
  if d > most then
    return most, full, true
  end
  return d, full, false
end

-- bucket_debt reads key, and writes the bound back when it was beyond.
local function bucket_debt(key, cap, rate, now)
  local d, full, clamped = bucket_debt_of(read_string(key), cap, rate, now)
  if clamped then bucket_write(key, now, d, full) end
  return d, full
end

-- The room (ns) a spend of s on a debt of d has: room, less the tokens held
-- for the other regions' spends in flight (hold.lua) when the spend would
-- leave less than HOLD_MAX of the capacity (full ns), at most that much.
-- The bucket's counterpart of window_held.
local function instant_held(key, rate, full, d, s, room, now)
  local most = math.floor(HOLD_MAX * full)
  if d + s <= room and d + s > room - most then
    return room - math.min(math.floor(hold_tokens(key, now) * 1e9 / rate), most)
  end
  return room
end

-- What a check of cost would see now (usage.lua), changing nothing: the
-- debt is read clamped, and not written back.
local function instant_usage(key, cap, rate, cost, now, keep)
  local d, full = bucket_debt_of((peek_string(key)), cap, rate, now)
  local s = spend_ns(cost, rate)
  local room = full
  if keep and keep > 0 then room = full - math.floor(keep * full) end
  room = instant_held(key, rate, full, d, s, room, now)
  if d + s <= room then
    return 1, d, 0, (d + 999) / 1000
  end
  return 0, d, (d + s - room + 999) / 1000, (d + 999) / 1000
end

-- The check of a token bucket or GCRA (token_bucket.lua, gcra.lua): a
-- request passes when its spend fits, (full - now) + spend(cost) <=
-- spend(capacity), in whole ns, so costs that add up to the capacity pass
-- at one instant. Returns allowed, remaining, retry_us, reset_us and, on
-- success, a commit; the remaining is the time (ns) until the bucket is full
-- again, of which the store makes the tokens or requests left (it is an
-- integer, which a float formatted as a string would not be, and costs the
-- script nothing to write). Redis replies a number as an integer, truncated:
-- (x + 999) / 1000 is x ns in µs rounded up, so a refusal never says 0.
-- keep (a fraction of the capacity in [0, 1), or nil) is the reserve the
-- request must leave for the priority classes above its own: its spend
-- must fit in full less floor(keep * full) ns, and less the hold of the
-- other regions' spends in flight when it leaves the bucket near empty
-- (hold.lua). Mirrors takeInstant in pkg/bucket, where there is no hold:
-- only a reconciler's debits write one.
local function instant_take(key, cap, rate, cost, now, keep)
  local d, full = bucket_debt(key, cap, rate, now)
  local s = spend_ns(cost, rate)
  local room = full
  if keep and keep > 0 then room = full - math.floor(keep * full) end
  room = instant_held(key, rate, full, d, s, room, now)
  if d + s <= room then
    d = d + s
    return 1, d, 0, (d + 999) / 1000, function()
      bucket_write(key, now, d, full)
    end
  end
  return 0, d, (d + s - room + 999) / 1000, (d + 999) / 1000, nil
end
