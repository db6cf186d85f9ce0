-- The hold: what the other regions have admitted of a token bucket or GCRA
-- and this region has not heard of yet, estimated from their debits. A
-- check near the limit leaves it in the bucket, so the regions' spends in
-- flight do not take the key past its limit when they land.
--
-- A bucket's hold lives in a hash beside it (its key and '~h'), one field
-- per source region and partition (the debit's marker), each
-- "<received> <updated_us> <since_us> <lag_us> <batch>":
--   received: the tokens that source's debits carried, decayed by
--     exp(-age / HOLD_TAU_US);
--   updated_us: when received was last added to (the store's clock);
--   since_us: when the source was first heard of in this run of debits;
--   lag_us: the amount-weighted mean of (debited - last admitted), on the
--     two clocks, between 0 and HOLD_MAX_LAG_US;
--   batch: the tokens a debit carries, on average (what the source holds
--     unpublished is half of that, on average).
-- The source's rate is received over the decayed time it was heard for;
-- the hold from it is rate * lag + batch / 2, decaying once it stops.
-- Only debits of a bucket at least HOLD_RECORD of the way to empty record:
-- the long tail's debits of full buckets cost nothing more.
local HOLD_TAU_US = 500000
local HOLD_MIN_WINDOW_US = 100000
local HOLD_MAX_LAG_US = 1000000
local HOLD_TTL_MS = 2500
local HOLD_RECORD = 0.25
-- A hold never keeps more than this fraction of the capacity: a check
-- whose spend leaves more than that in the bucket reads no hold.
local HOLD_MAX = 0.5

local function hold_key(key)
  return key .. '~h'
end

-- The tokens held for one source, read at now, from its field's value.
local function hold_tokens(v, now)
  local received, updated, since, lag, batch = string.match(v, '^(%S+) (%S+) (%S+) (%S+) (%S+)$')
  received, updated, since, lag, batch = tonumber(received), tonumber(updated), tonumber(since), tonumber(lag), tonumber(batch)
  if not (received and updated and since and lag and batch) then return 0 end
  local age = math.max(now - updated, 0)
  local k = math.exp(-age / HOLD_TAU_US)
  local window = HOLD_TAU_US * (1 - math.exp(-math.max(now - since, 0) / HOLD_TAU_US))
  if window < HOLD_MIN_WINDOW_US then window = HOLD_MIN_WINDOW_US end
  local held = received * k / window * lag + batch / 2 * k
  if held ~= held or held < 0 then return 0 end
  return held
end

-- The hold of the bucket key (ns of its refill at rate), at most
-- HOLD_MAX of full (the capacity's ns).
local function hold_ns(key, rate, full, now)
  local vals = redis.call('HVALS', hold_key(key))
  if #vals == 0 then return 0 end
  local tokens = 0
  for i = 1, #vals do
    tokens = tokens + hold_tokens(vals[i], now)
  end
  local ns = math.floor(tokens * 1e9 / rate)
  local most = math.floor(HOLD_MAX * full)
  if ns > most then ns = most end
  return ns
end

-- The room a check has: room, less the hold when the spend s would leave
-- less than HOLD_MAX of the capacity (d: the debt before it).
local function hold_room(key, rate, full, d, s, room, now)
  if d + s > room or d + s <= room - math.floor(HOLD_MAX * full) then
    return room
  end
  return room - hold_ns(key, rate, full, now)
end

-- Records a debit of amount in the hold of the bucket key, from the source
-- whose marker is field, last admitted at seen (µs, the source's clock),
-- when the debit left the bucket d ns from full of full ns.
local function hold_record(key, field, amount, seen, d, full, now)
  if not (seen and seen > 0 and amount > 0) or d < HOLD_RECORD * full then return end
  local hk = hold_key(key)
  local lag = now - seen
  if lag < 0 then lag = 0 end
  if lag > HOLD_MAX_LAG_US then lag = HOLD_MAX_LAG_US end
  local received, since, mean, batch = amount, now - HOLD_MIN_WINDOW_US, lag, amount
  local v = redis.call('HGET', hk, field)
  if v then
    local r, u, s, l, b = string.match(v, '^(%S+) (%S+) (%S+) (%S+) (%S+)$')
    r, u, s, l, b = tonumber(r), tonumber(u), tonumber(s), tonumber(l), tonumber(b)
    if r and u and s and l and b and now - u < 4 * HOLD_TAU_US then
      local old = r * math.exp(-math.max(now - u, 0) / HOLD_TAU_US)
      received = old + amount
      since = s
      mean = (l * old + lag * amount) / received
      batch = b + (amount - b) / 4
    end
  end
  redis.call('HSET', hk, field, string.format('%.6g %d %d %d %.6g', received, now, since, math.floor(mean), batch))
  redis.call('PEXPIRE', hk, HOLD_TTL_MS + EXPIRY_PAD_MS)
end
