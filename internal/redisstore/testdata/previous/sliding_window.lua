-- The sliding_window algorithm as released before ns state (commit 1d9ad8c); see lib.lua.
-- Sliding window counter. State: "index current previous" in one string;
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
      return tonumber(b) or 0, tonumber(c) or 0
    elseif a == idx - 1 then
      return 0, tonumber(b) or 0
    end
  end
  return 0, 0
end

local function sliding_window_write(key, idx, w, cur, prev, now)
  redis.call('SET', key, string.format('%d %.17g %.17g', idx, cur, prev),
    'PX', fmt_int(math.ceil(((idx + 2) * w - now) / 1000)))
end

local function sliding_window(key, cap, w, cost, now)
  local idx = window_index(now, w)
  local f = (now - idx * w) / w
  local cur, prev = sliding_window_read(key, idx)
  local est = prev * (1 - f) + cur
  if est + cost <= cap then
    return 1, math.max(cap - (est + cost), 0), 0, (idx + 2) * w - now, function()
      sliding_window_write(key, idx, w, cur + cost, prev, now)
    end
  end
  local at
  if cur + cost <= cap then
    at = idx * w + math.ceil((1 - (cap - cost - cur) / prev) * w)
  else
    at = (idx + 1) * w + math.ceil((1 - (cap - cost) / cur) * w)
  end
  local reset = 0
  if cur > 0 then
    reset = (idx + 2) * w - now
  elseif prev > 0 then
    reset = (idx + 1) * w - now
  end
  return 0, math.max(cap - est, 0), math.max(at - now, 1), reset, nil
end
