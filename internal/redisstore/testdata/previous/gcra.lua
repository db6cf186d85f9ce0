-- The gcra algorithm as released before ns state (commit 1d9ad8c); see lib.lua.
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
