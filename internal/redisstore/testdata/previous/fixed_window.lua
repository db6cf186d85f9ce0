-- The fixed_window algorithm as released before ns state (commit 1d9ad8c); see lib.lua.
-- Fixed window. State: "index count" in one string. The expiry is set once,
-- at the window's end, when the window's first request is counted; later
-- requests keep it (a refreshed expiry would keep the window from closing).

-- The count of window idx, and whether the key holds another window.
local function fixed_window_read(key, idx)
  local v = read_string(key)
  if v then
    local a, b = string.match(v, '^(%d+) (%S+)$')
    if tonumber(a) == idx then
      return tonumber(b) or 0, false
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
  local ends = (idx + 1) * w - now
  if count + cost <= cap then
    return 1, math.max(cap - (count + cost), 0), 0, ends, function()
      fixed_window_write(key, idx, w, count + cost, fresh)
    end
  end
  return 0, math.max(cap - count, 0), ends, ends, nil
end
