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

local function fixed_window_write(key, idx, w, count, fresh)
  local val = string.format('%d %.17g', idx, count)
  if fresh then
    redis.call('SET', key, val, 'PXAT', fmt_int(math.ceil((idx + 1) * w / 1000)))
  else
    redis.call('SET', key, val, 'KEEPTTL')
  end
end

local function fixed_window(key, cap, w, cost, now)
  local idx = window_index(now, w)
  local count, fresh = fixed_window_read(key, idx)
  cap, cost = micro(cap), window_cost(cost)
  local ends = (idx + 1) * w - now
  local nxt = micro(count + cost)
  if nxt <= cap then
    return 1, string.format('%.17g', math.max(micro(cap - nxt), 0)), 0, ends, function()
      fixed_window_write(key, idx, w, nxt, fresh)
    end
  end
  return 0, string.format('%.17g', math.max(micro(cap - count), 0)), ends, ends, nil
end
