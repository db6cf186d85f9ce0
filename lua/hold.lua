-- The hold: what the other regions have admitted of a token bucket, GCRA,
-- sliding or fixed window and this region has not heard of yet, estimated
-- from their debits. A check near the limit leaves it in the bucket, so
-- the regions' spends in flight do not take the key past its limit when
-- they land.
--
-- A bucket's hold lives in a hash beside it (its key and '~h'), one field
-- per source region and partition (the debit's marker), each
-- "<received> <updated_us> <since_us> <lag_us> <batch>":
--   received: the tokens that source's debits carried, decayed by
--     exp(-age / tau), tau 0.5 s;
--   updated_us: when received was last added to (the store's clock);
--   since_us: when the source was first heard of in this run of debits;
--   lag_us: the amount-weighted mean of (debited - last admitted), on the
--     two clocks, between 0 and 1 s;
--   batch: the tokens a debit carries, on average (what the source holds
--     unpublished is half of that, on average).
-- The source's rate is received over the decayed time it was heard for
-- (at least 0.1 s); the hold from it is rate * lag + batch / 2, decaying
-- once it stops. hold_record.lua writes it. A check script defines every
-- function on each call: this file keeps the checks' part to one. A check
-- holds at most HOLD_MAX of the capacity.

-- A hold never keeps more than this fraction of the capacity: a check
-- whose spend leaves more than that in the bucket reads no hold.
local HOLD_MAX = 0.5

-- The tokens held for the bucket key, read at now (not bounded).
local function hold_tokens(key, now)
  local vals = redis.call('HVALS', key .. '~h')
  local tokens = 0
  for i = 1, #vals do
    local received, updated, since, lag, batch = string.match(vals[i], '^(%S+) (%S+) (%S+) (%S+) (%S+)$')
    received, updated, since, lag, batch = tonumber(received), tonumber(updated), tonumber(since), tonumber(lag), tonumber(batch)
    if received and updated and since and lag and batch then
      local k = math.exp(-math.max(now - updated, 0) / 500000)
      local window = math.max(500000 * (1 - math.exp(-math.max(now - since, 0) / 500000)), 100000)
      local held = received * k / window * lag + batch / 2 * k
      if held == held and held > 0 then tokens = tokens + held end
    end
  end
  return tokens
end
