-- Window indexes and counts, shared by the window algorithms.

-- floor(now / w), exact for integers below 2^53.
local function window_index(now, w)
  local idx = math.floor(now / w)
  if idx * w > now then idx = idx - 1 end
  return idx
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

-- The instant a window algorithm reads a state of window a at: now, or the
-- start of window a when that is later. The store's clock can step back (a
-- failover to a node whose clock is behind, an NTP step); read at the
-- earlier instant, a later window's state would count as empty and be
-- rewritten under the earlier index, giving its spends back.
local function window_now(a, now, w)
  if a and a * w > now then return a * w end
  return now
end

-- The limit a window's check of a count leaving nxt (both micro) has: cap,
-- less the tokens held for the other regions' spends in flight
-- (hold.lua) when nxt is within HOLD_MAX of the limit, at most HOLD_MAX
-- of it. A check the hold refused is told to retry when the count would
-- fit under the held limit: when the spends in flight have landed, that
-- is when there is room.
local function window_held(key, cap, nxt, now)
  if nxt <= cap and nxt > cap * (1 - HOLD_MAX) then
    return micro(cap - math.min(hold_tokens(key, now), HOLD_MAX * cap))
  end
  return cap
end
