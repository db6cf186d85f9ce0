-- Fixed window. State: "index count" in one string, the count in tokens,
-- a whole number of millionths (see micro in window.lua). The expiry is set
-- once, at the window's end, when the window's first request is counted;
-- later requests keep it (a refreshed expiry would keep the window from
-- closing).

-- The count of window idx, and whether the key holds another window.
local function fixed_window_read(key, idx)
  local v = read_string(key)
  if v then
    local a, b = string.match(v, '^(%d+) (%S+)$')
    if tonumber(a) == idx then
      return micro(tonumber(b) or 0), false
    end
  end
  return 0, true
end

-- The count a window algorithm reads at now: of now's window, or of a later
-- window the key holds, read at that window's start (window_now). Returns
-- the count, whether the key holds no such window, its index and the
-- instant read at.
local function fixed_window_of(v, w, now)
  local idx = window_index(now, w)
  if v then
    local a, b = string.match(v, '^(%d+) (%S+)$')
    a = tonumber(a)
    if a and a >= idx then
      return micro(tonumber(b) or 0), false, a, window_now(a, now, w)
    end
  end
  return 0, true, idx, now
end

local function fixed_window_at(key, w, now)
  return fixed_window_of(read_string(key), w, now)
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
  local count, fresh, idx
  count, fresh, idx, now = fixed_window_at(key, w, now)
  cap, cost = micro(cap), window_cost(cost)
  local ends = (idx + 1) * w - now
  local nxt = micro(count + cost)
  if nxt <= window_held(key, cap, nxt, now) then
    return 1, string.format('%.17g', math.max(micro(cap - nxt), 0)), 0, ends, function()
      fixed_window_write(key, idx, w, nxt, fresh)
    end
  end
  return 0, string.format('%.17g', math.max(micro(cap - count), 0)), ends, ends, nil
end

-- What a check of cost would see now (usage.lua), changing nothing; the
-- window is clear (reset 0) when it counts nothing.
local function fixed_window_usage(key, cap, w, cost, now)
  local count, _, idx
  count, _, idx, now = fixed_window_of((peek_string(key)), w, now)
  cap, cost = micro(cap), window_cost(cost)
  local ends = (idx + 1) * w - now
  local reset = 0
  if count > 0 then reset = ends end
  local left = string.format('%.17g', math.max(micro(cap - count), 0))
  local nxt = micro(count + cost)
  if nxt <= window_held(key, cap, nxt, now) then
    return 1, left, 0, reset
  end
  return 0, left, ends, reset
end
