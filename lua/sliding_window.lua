-- Sliding window counter. State: "index current previous" in one string,
-- the counts in tokens, whole numbers of millionths (see micro in window.lua);
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
      return micro(tonumber(b) or 0), micro(tonumber(c) or 0)
    elseif a == idx - 1 then
      return 0, micro(tonumber(b) or 0)
    end
  end
  return 0, 0
end

-- The counts a window algorithm reads at now: of now's window, or of a
-- later window the key holds, read at that window's start (window_now).
-- Returns the current and previous counts, the window's index and the
-- instant read at.
local function sliding_window_of(v, w, now)
  local idx = window_index(now, w)
  if v then
    local a, b, c = string.match(v, '^(%d+) (%S+) (%S+)$')
    a = tonumber(a)
    if a and a >= idx then
      return micro(tonumber(b) or 0), micro(tonumber(c) or 0), a, window_now(a, now, w)
    elseif a == idx - 1 then
      return 0, micro(tonumber(b) or 0), idx, now
    end
  end
  return 0, 0, idx, now
end

local function sliding_window_at(key, w, now)
  return sliding_window_of(read_string(key), w, now)
end

-- A refusal's retry (µs from now) and the reset of counts cur and prev of
-- window idx read at now, for cost under cap (the limit less any hold). A
-- cost above a held limit in an empty window fits in the next one.
local function sliding_window_refusal(cur, prev, idx, w, cap, cost, now)
  local at
  if micro(cur + cost) <= cap and prev > 0 then
    at = idx * w + math.ceil((1 - (cap - cost - cur) / prev) * w)
  elseif cur > 0 then
    at = (idx + 1) * w + math.ceil((1 - (cap - cost) / cur) * w)
  else
    at = (idx + 1) * w
  end
  local reset = 0
  if cur > 0 then
    reset = (idx + 2) * w - now
  elseif prev > 0 then
    reset = (idx + 1) * w - now
  end
  return math.max(at - now, 1), reset
end

local function sliding_window_write(key, idx, w, cur, prev, now)
  redis.call('SET', key, string.format('%d %.17g %.17g', idx, cur, prev),
    'PX', fmt_int(math.ceil(((idx + 2) * w - now) / 1000) + EXPIRY_PAD_MS))
end

local function sliding_window(key, cap, w, cost, now)
  local cur, prev, idx
  cur, prev, idx, now = sliding_window_at(key, w, now)
  local f = (now - idx * w) / w
  cap, cost = micro(cap), window_cost(cost)
  local est = prev * (1 - f) + cur
  local nxt = micro(est + cost)
  local held = window_held(key, cap, nxt, now)
  if nxt <= held then
    return 1, string.format('%.17g', math.max(micro(cap - nxt), 0)), 0, (idx + 2) * w - now, function()
      sliding_window_write(key, idx, w, micro(cur + cost), prev, now)
    end
  end
  local retry, reset = sliding_window_refusal(cur, prev, idx, w, held, cost, now)
  return 0, string.format('%.17g', math.max(micro(cap - est), 0)), retry, reset, nil
end

-- What a check of cost would see now (usage.lua), changing nothing.
local function sliding_window_usage(key, cap, w, cost, now)
  local cur, prev, idx
  cur, prev, idx, now = sliding_window_of((peek_string(key)), w, now)
  local f = (now - idx * w) / w
  cap, cost = micro(cap), window_cost(cost)
  local est = prev * (1 - f) + cur
  local left = string.format('%.17g', math.max(micro(cap - est), 0))
  local nxt = micro(est + cost)
  local held = window_held(key, cap, nxt, now)
  local retry, reset = sliding_window_refusal(cur, prev, idx, w, held, cost, now)
  if nxt <= held then
    return 1, left, 0, reset
  end
  return 0, left, retry, reset
end
